#!/usr/bin/env python
"""Speculative decoding (n-gram prompt lookup) against plain decoding, same run, same machine.

A benchmark, not a test. Workloads:
  grounded  16 passages of 300-800 tokens (sentences drawn from a fixed bank with a seed;
            some words misspelt), each followed by a task on it: repeat it word for word,
            correct its spelling and write it out, or summarise it; greedy, up to
            --grounded-tokens tokens, stopping at EOS; one request at a time.
  chat      the 64 chat questions x 128 tokens, greedy, ignore_eos, all at once (batch64).
  served    (--served) the grounded requests one at a time through the three-service stack
            (OpenAI streaming chat), the engine started with and without --speculative-config.

Sides alternate request by request (in-process) or server by server (served), --rounds times.
Every figure is a median over rounds. In-process each measurement uses a fresh engine core over
the one loaded model, so no side gets the other's prefix cache.

Metrics: decode tok/s = (tokens - 1) / (last token - first token), a request's own decode
speed; e2e tok/s = tokens / (submission -> last token); for the grounded set the sums over its
requests. Acceptance rate = accepted / guessed tokens; mean accepted length = 1 + accepted /
drafts (tokens a speculating sample gains per step). Greedy outputs are checked equal.

    .venv/bin/python benchmarks/speculative.py [--served] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import sys
import time

BENCHMARKS = pathlib.Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from common import chat_prompts, environment, format_table, log  # noqa: E402

from tessera.bench.metrics import median  # noqa: E402

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
SENTENCES = [
    "The harbour town woke slowly, its fishing boats rocking against the stone quay.",
    "Every morning the baker opened his shutters at five and the smell of bread filled the square.",
    "A narrow road climbed from the market to the old chapel on the hill.",
    "In winter the wind came off the sea with a sharp, salty edge that found every gap in a coat.",
    "The school had three classrooms, a library of donated books and a garden the children kept.",
    "On Saturdays the square filled with stalls selling cheese, honey, wool and second-hand tools.",
    "The lighthouse keeper wrote down every ship that passed in a leather notebook.",
    "Most families had lived in the town for generations and knew each other by their grandparents' names.",
    "When the storm of 1953 flooded the lower streets, the whole town carried sandbags through the night.",
    "The council meets on the first Tuesday of each month in the room above the post office.",
    "Tourists arrive in July and August, drawn by the beaches and the cliffs to the north.",
    "The river that runs through the valley powers a small mill that still grinds flour.",
    "A new railway station opened in 1911, and for fifty years trains ran twice a day to the city.",
    "The museum holds maps, photographs and the logbooks of ships built in the local yard.",
    "Children learn to swim in the sheltered cove below the church before they can ride a bicycle.",
    "The annual regatta ends with a supper of grilled fish served on long tables by the water.",
    "Since the fishing fleet shrank, many young people have moved away to find work in the city.",
    "Volunteers repaired the sea wall last spring using stone from the quarry behind the farms.",
    "The doctor's surgery is open four days a week and a nurse visits the outlying farms on Fridays.",
    "At night the streets are quiet except for the sound of the sea and the occasional car.",
    "The local newspaper prints the tide times, the church notices and the results of the darts league.",
    "A footpath follows the coast for twelve miles, passing ruined cottages and a Bronze Age fort.",
    "The pub at the end of the harbour has served the same ale since the eighteenth century.",
    "Gulls gather on the roofs of the fish market, waiting for the boats to come in with their catch.",
    "The town's only bookshop also sells stamps, fishing line and postcards of the lighthouse.",
    "In the autumn the hills turn brown and gold and the first fires are lit in the cottages.",
    "A retired teacher runs a history club that meets in the library every Thursday evening.",
    "The harbour master keeps a record of every vessel that enters, with its name, crew and cargo.",
    "Electric buses replaced the old diesel ones in 2021, running hourly to the nearby villages.",
    "Some say the town will change beyond recognition in the next twenty years, and others disagree.",
]
TASKS = ["Repeat the passage above word for word.",
         "Correct the spelling mistakes in the passage above and write out the whole corrected passage.",
         "Summarise the passage above in a few sentences."]


def misspell(sentence: str, rng: random.Random) -> str:
    words = sentence.split()
    for i in rng.sample(range(len(words)), k=max(1, len(words) // 8)):
        w = words[i]
        if len(w) > 4:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def grounded_texts(tokenizer, n: int = 16, seed: int = 7) -> list[str]:
    """n user messages: a passage of 300-800 tokens followed by a task on it."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        target = rng.randint(300, 800)
        sentences: list[str] = []
        while len(tokenizer.encode(" ".join(sentences))) < target:
            s = rng.choice(SENTENCES)
            sentences.append(misspell(s, rng) if rng.random() < 0.5 else s)
        out.append(" ".join(sentences) + "\n\n" + TASKS[i % len(TASKS)])
    return out


def grounded_prompts(tokenizer, n: int = 16, seed: int = 7) -> list[list[int]]:
    """The grounded messages' token ids after the chat template."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               return_dict=False))
            for text in grounded_texts(tokenizer, n, seed)]


def run_engine(loaded, config, prompts: list[list[int]], params) -> dict:
    """The prompts all at once on a fresh engine core: per request tokens and timings, step totals."""
    from tessera_engine.core import EngineCore
    from tessera_engine.request import EngineCoreRequest

    core = EngineCore(config, loaded)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", p, params))
    tokens = {i: [] for i in range(len(prompts))}
    first, last = {}, {}
    totals = {"drafts": 0, "guessed": 0, "accepted": 0}
    while core.has_unfinished():
        step = core.run_step()
        now = time.perf_counter()
        totals["drafts"] += step.iteration.num_drafts
        totals["guessed"] += step.iteration.num_draft_tokens
        totals["accepted"] += step.iteration.num_accepted_tokens
        for o in step.outputs:
            i = int(o.request_id[1:])
            if o.new_token_ids:
                tokens[i].extend(o.new_token_ids)
                first.setdefault(i, now)
                last[i] = now
    wall = time.perf_counter() - t0
    del core
    return {"tokens": tokens, "first": first, "last": last, "t0": t0, "wall": wall, **totals}


def inprocess(args) -> dict:
    from transformers import AutoTokenizer

    from tessera.common.model_source import resolve_model
    from tessera_engine.backend_plan import plan_backends
    from tessera_engine.config import EngineConfig
    from tessera_engine.sampling_params import SamplingParams

    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    grounded = grounded_prompts(tok)
    chats = chat_prompts(tok, 64)
    plan, loaded = plan_backends(EngineConfig())
    spec = args.speculative_config
    configs = {"plain": EngineConfig(), "ngram": EngineConfig(speculative_config=spec)}
    if args.fixed_batch_limit:  # vLLM's way: speculation whenever at most this many samples run
        configs["ngram_cap"] = EngineConfig(speculative_config=spec.rstrip()[:-1] + f', "disable_by_batch_size": {args.fixed_batch_limit}}}')
    greedy = SamplingParams(temperature=0.0, max_tokens=args.grounded_tokens)
    burst = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    run_engine(loaded, configs["plain"], grounded[:1], greedy)  # warm-up: shapes, allocator
    rounds = {side: [] for side in configs}
    outputs = {side: {} for side in configs}
    for r in range(args.rounds):
        per = {side: {"tokens": 0, "decode_s": 0.0, "e2e_s": 0.0, "drafts": 0, "guessed": 0, "accepted": 0}
               for side in configs}
        for i, prompt in enumerate(grounded):
            order = list(configs) if (i + r) % 2 == 0 else list(reversed(configs))
            for side in order:
                res = run_engine(loaded, configs[side], [prompt], greedy)
                n = len(res["tokens"][0])
                outputs[side][i] = res["tokens"][0]
                acc = per[side]
                acc["tokens"] += n
                acc["decode_s"] += res["last"][0] - res["first"][0]
                acc["e2e_s"] += res["last"][0] - res["t0"]
                for k in ("drafts", "guessed", "accepted"):
                    acc[k] += res[k]
                acc.setdefault("decode_tokens", 0)
                acc["decode_tokens"] += n - 1
        chat = {}
        for side in (configs if r % 2 == 0 else reversed(list(configs))):
            res = run_engine(loaded, configs[side], chats, burst)
            chat[side] = sum(map(len, res["tokens"].values())) / res["wall"]
        for side in configs:
            a = per[side]
            rounds[side].append({"decode_tok_s": a["decode_tokens"] / a["decode_s"], "e2e_tok_s": a["tokens"] / a["e2e_s"],
                                 "tokens": a["tokens"], "acceptance": a["accepted"] / a["guessed"] if a["guessed"] else None,
                                 "mean_accepted_len": 1 + a["accepted"] / a["drafts"] if a["drafts"] else None,
                                 "chat_tok_s": chat[side]})
        log(f"round {r + 1}: " + json.dumps({s: {k: round(v, 3) if isinstance(v, float) else v
                                                for k, v in rounds[s][-1].items()} for s in configs}))
    same = outputs["plain"] == outputs["ngram"]

    def med(side, key):
        vals = [x[key] for x in rounds[side] if x[key] is not None]
        return median(vals) if vals else None

    result = {side: {k: med(side, k) for k in rounds[side][0]} for side in configs}
    result["greedy_outputs_equal"] = same
    result["ratio_grounded_decode"] = result["ngram"]["decode_tok_s"] / result["plain"]["decode_tok_s"]
    result["ratio_grounded_e2e"] = result["ngram"]["e2e_tok_s"] / result["plain"]["e2e_tok_s"]
    result["ratio_chat_burst"] = result["ngram"]["chat_tok_s"] / result["plain"]["chat_tok_s"]
    if "ngram_cap" in configs:
        result["ratio_grounded_decode_cap"] = result["ngram_cap"]["decode_tok_s"] / result["plain"]["decode_tok_s"]
        result["ratio_chat_burst_cap"] = result["ngram_cap"]["chat_tok_s"] / result["plain"]["chat_tok_s"]
        same = same and outputs["ngram_cap"] == outputs["plain"]
    result["dtype"] = str(plan.dtype)
    return result


def served(args) -> dict:
    from transformers import AutoTokenizer

    from servers import TesseraServer

    from tessera.bench.backends import OpenAIBackend, http_client
    from tessera.bench.datasets import SampleRequest
    from tessera.common.model_source import resolve_model

    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    messages = grounded_texts(tok)  # sent as chat messages: the server applies the template

    async def one_by_one(server) -> list:
        async with http_client(1) as client:
            send = OpenAIBackend(client, server.root_url, server.model_id, chat=True, ignore_eos=False)
            out = []
            for m in messages:
                out.append(await send(SampleRequest(prompt=m, prompt_len=0, expected_output_len=args.grounded_tokens)))
            return out

    sides = {"plain": [], "ngram": ["--speculative-config", args.speculative_config]}
    rounds = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in (sides if r % 2 == 0 else reversed(list(sides))):
            server = TesseraServer(600, engine_args=sides[side])
            server.start()
            try:
                asyncio.run(one_by_one(server))  # warm-up pass
                reqs = asyncio.run(one_by_one(server))
            finally:
                server.stop()
            tokens = sum(x.output_tokens - 1 for x in reqs)
            decode_s = sum(x.latency - x.ttft for x in reqs)
            rounds[side].append({"decode_tok_s": tokens / decode_s,
                                 "texts": [x.text for x in reqs]})
            log(f"served round {r + 1} {side}: {rounds[side][-1]['decode_tok_s']:.1f} tok/s")
    res = {side: {"decode_tok_s": median([x["decode_tok_s"] for x in rounds[side]])} for side in sides}
    res["texts_equal"] = rounds["plain"][0]["texts"] == rounds["ngram"][0]["texts"]
    res["ratio_served_decode"] = res["ngram"]["decode_tok_s"] / res["plain"]["decode_tok_s"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--speculative-config", default=NGRAM,
                    help="the speculating side's --speculative-config (default: n-gram, 4 guesses; the "
                         "side keeps the name ngram in the report whatever the method)")
    ap.add_argument("--grounded-tokens", type=int, default=256)
    ap.add_argument("--served", action="store_true", help="also the served single-request comparison")
    ap.add_argument("--fixed-batch-limit", type=int, default=4,
                    help="also a side with disable_by_batch_size set to this (0: not)")
    ap.add_argument("--no-inprocess", action="store_true")
    ap.add_argument("--out", default="results/speculative.json")
    args = ap.parse_args()
    report = {"environment": environment()}
    if not args.no_inprocess:
        report["inprocess"] = inprocess(args)
    if args.served:
        report["served"] = served(args)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    rows = []
    if "inprocess" in report:
        ip = report["inprocess"]
        for side in [k for k in ("plain", "ngram", "ngram_cap") if k in ip]:
            s = ip[side]
            rows.append([side, f"{s['decode_tok_s']:.1f}", f"{s['e2e_tok_s']:.1f}",
                         "-" if s["acceptance"] is None else f"{s['acceptance']:.2f}",
                         "-" if s["mean_accepted_len"] is None else f"{s['mean_accepted_len']:.2f}",
                         f"{s['chat_tok_s']:.1f}"])
    print("\n".join(format_table(["side", "grounded decode tok/s", "grounded e2e tok/s", "acceptance",
                                  "mean accepted len", "chat 64x128 tok/s"], rows)))
    if "inprocess" in report:
        ip = report["inprocess"]
        print(f"grounded_decode_ratio={ip['ratio_grounded_decode']:.2f} grounded_e2e_ratio={ip['ratio_grounded_e2e']:.2f} "
              f"chat_burst_ratio={ip['ratio_chat_burst']:.3f} greedy_outputs_equal={ip['greedy_outputs_equal']}")
        if "ratio_grounded_decode_cap" in ip:
            print(f"with disable_by_batch_size {args.fixed_batch_limit}: grounded_decode_ratio="
                  f"{ip['ratio_grounded_decode_cap']:.2f} chat_burst_ratio={ip['ratio_chat_burst_cap']:.3f}")
    if "served" in report:
        sv = report["served"]
        print(f"served_decode_ratio={sv['ratio_served_decode']:.2f} (plain {sv['plain']['decode_tok_s']:.1f}, "
              f"ngram {sv['ngram']['decode_tok_s']:.1f} tok/s) texts_equal={sv['texts_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
