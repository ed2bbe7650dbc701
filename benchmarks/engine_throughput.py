#!/usr/bin/env python
"""Engine throughput benchmark: tessera's engine core vs HF transformers static batching.

A benchmark, not a test. Both sides run in this one process, on the same
weights (the GGUF dequantized by transformers' reader) and dtype, on the same
prompt token ids, interleaved repeat by repeat so machine noise hits both.

Scenarios (--scenarios, comma separated):
  batch64  64 distinct chat prompts x 128 output tokens, greedy, ignore_eos, all
           submitted at t0; HF: one generate over the 64 (left padding, pad = eos).
  single   one request x 256 output tokens; HF: generate with batch size 1.
  scale    the engine alone at 64, 128 and 256 concurrent requests x 128 tokens
           (--scale-hf adds HF static batches of the same size).
  mixed    requests whose output lengths are drawn from [16, 512] (seeded), stopping
           at eos; HF: static batches of 64, max_new_tokens = the batch's longest
           drawn length, counting only each request's useful tokens.

Metrics (per measurement; medians over --repeats are quoted):
  output tokens/s  useful output tokens / wall time from submission to the last token
  TTFT             engine: add_request -> first token of the request (all added at t0);
                   HF: generate() call -> logits of the first step (the prefill), taken
                   by a no-op LogitsProcessor that timestamps every step; for later HF
                   batches of the mixed workload the wait for earlier batches is included
  TPOT             (finish time - first token time) / (tokens - 1), per request
  peak RSS         highest sampled RSS of the process during the measurement (both
                   models and the engine's preallocated KV cache are resident)

The last line printed is `ratio_vs_hf_static=<x>`: batch64 engine tokens/s over HF's.
Results go to results/engine_throughput.json (or --out).

  python benchmarks/engine_throughput.py                       # everything
  python benchmarks/engine_throughput.py --scenarios batch64,single --repeats 5
  python benchmarks/engine_throughput.py --quick                # smoke run
  python benchmarks/engine_throughput.py --profile              # + engine step-time breakdown
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import pathlib
import sys
import time
import warnings

os.environ.setdefault("TQDM_DISABLE", "1")
from tessera_engine import openmp_env  # noqa: E402

openmp_env.apply()  # as the engine service runs: before torch loads libgomp

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (StepBreakdown, add_engine_flags, chat_prompts, draw_lengths, engine_config,  # noqa: E402
                    environment, fmt, format_table, log, maxrss_mib, measure_usage, wait_for_quiet)

from tessera.bench.metrics import median, summarize  # noqa: E402
from tessera.common.model_source import resolve_model  # noqa: E402
from tessera_engine.core import EngineCore  # noqa: E402
from tessera_engine.models.loader import load_model  # noqa: E402
from tessera_engine.request import EngineCoreRequest  # noqa: E402
from tessera_engine.sampling_params import SamplingParams  # noqa: E402

ALL_SCENARIOS = ("batch64", "single", "scale", "mixed")
EXTRA_SCENARIOS = ("quantized",)  # run only when named in --scenarios
REPO = pathlib.Path(__file__).resolve().parent.parent

TARGETS = {
    "batch64.ratio_vs_hf_static": 2.0,
    "single.decode_ratio_vs_hf": 2.3,
    "mixed.ratio_vs_hf_static": 2.5,
}


# -- arguments ---------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(ALL_SCENARIOS),
                    help=f"comma separated, from {','.join(ALL_SCENARIOS + EXTRA_SCENARIOS)} (default: "
                         f"{','.join(ALL_SCENARIOS)}; quantized: the GGUF's quantized weights against "
                         f"--gguf-dequantize, single and batch64)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="measurements per scenario and side; medians are quoted (default 3; scale and mixed 2)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 repeat, 32 output tokens, single 64, scale 64/128, mixed 16..128")
    ap.add_argument("--num-prompts", type=int, default=64, help="batch64: number of requests")
    ap.add_argument("--output-tokens", type=int, default=None, help="batch64/scale: output tokens (default 128)")
    ap.add_argument("--single-tokens", type=int, default=None, help="single: output tokens (default 256)")
    ap.add_argument("--scale-levels", default=None, help="scale: concurrent requests (default 64,128,256)")
    ap.add_argument("--scale-hf", action="store_true", help="scale: also run HF static batches of each size")
    ap.add_argument("--mixed-requests", type=int, default=64, help="mixed: number of requests")
    ap.add_argument("--mixed-min", type=int, default=16)
    ap.add_argument("--mixed-max", type=int, default=None, help="mixed: longest drawn output (default 512)")
    ap.add_argument("--hf-batch-size", type=int, default=64, help="mixed: HF static batch size")
    ap.add_argument("--seed", type=int, default=0, help="mixed: seed of the drawn lengths")
    add_engine_flags(ap)
    ap.add_argument("--wait-quiet", type=float, default=20.0,
                    help="before each measurement wait up to this many seconds for other processes to use "
                         "< --quiet-cores cores (0 = never wait)")
    ap.add_argument("--quiet-cores", type=float, default=0.3)
    ap.add_argument("--no-hf", action="store_true", help="engine only (no baseline, no ratios)")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="quantized: also run llama.cpp's single-request decode on the same GGUF, runs alternating "
                         "(llama-cpp-python is installed once into <TESSERA_BENCH_CACHE>/llama-cpp-venv)")
    ap.add_argument("--profile", action="store_true",
                    help="after the scenarios, run batch64 once more on the engine with a step-time breakdown")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--out", default=str(REPO / "results" / "engine_throughput.json"))
    args = ap.parse_args(argv)

    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in args.scenarios if s not in ALL_SCENARIOS + EXTRA_SCENARIOS]
    if bad:
        ap.error(f"unknown scenario(s) {bad}; choose from {ALL_SCENARIOS + EXTRA_SCENARIOS}")
    q = args.quick
    args.output_tokens = args.output_tokens or (32 if q else 128)
    args.single_tokens = args.single_tokens or (64 if q else 256)
    args.mixed_max = args.mixed_max or (128 if q else 512)
    args.scale_levels = [int(x) for x in (args.scale_levels or ("64,128" if q else "64,128,256")).split(",")]
    if args.repeats is None:
        args.repeats_for = {"batch64": 1 if q else 3, "single": 1 if q else 3,
                            "scale": 1 if q else 2, "mixed": 1 if q else 2, "quantized": 1 if q else 2}
    else:
        args.repeats_for = {s: args.repeats for s in ALL_SCENARIOS + EXTRA_SCENARIOS}
    return args


# -- the benchmark -------------------------------------------------------------------
class StepTimer:
    """A no-op LogitsProcessor that timestamps each decoding step of HF generate."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.threads:
            torch.set_num_threads(args.threads)
        self.dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
        self.device = torch.device("cpu")
        self.load_s: dict[str, float] = {}

        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        warnings.filterwarnings("ignore")
        logging.getLogger("tessera_engine").setLevel(logging.WARNING)

        self.src = resolve_model(args.model)
        t = time.perf_counter()
        self.tok = AutoTokenizer.from_pretrained(self.src.directory, gguf_file=self.src.gguf_file)
        self.load_s["tokenizer"] = time.perf_counter() - t
        eos = self.tok.eos_token_id
        self.eos_id = int(eos if eos is not None else 0)

        t = time.perf_counter()
        self.loaded = load_model(args.model, None, self.dtype, self.device)
        self.load_s["engine_weights"] = time.perf_counter() - t

        self.hf = None
        if not args.no_hf:
            from transformers import AutoModelForCausalLM

            t = time.perf_counter()
            kw = {"gguf_file": self.src.gguf_file} if self.src.gguf_file else {}
            self.hf = AutoModelForCausalLM.from_pretrained(self.src.directory, dtype=self.dtype, **kw).eval()
            self.load_s["hf_weights"] = time.perf_counter() - t
        self.baseline_info = self._check_same_weights()

    def _check_same_weights(self) -> dict:
        if self.hf is None:
            return {}
        eng = self.loaded.model
        hf_q = self.hf.model.layers[0].self_attn.q_proj
        q = eng.layers[0].self_attn.q_size
        same = (torch.equal(eng.embed_tokens.weight, self.hf.model.embed_tokens.weight)
                and torch.equal(eng.layers[0].self_attn.qkv_proj.weight[:q], hf_q.weight)
                and torch.equal(eng.layers[-1].mlp.down_proj.weight, self.hf.model.layers[-1].mlp.down_proj.weight))
        return {
            "same_weights_checked": bool(same),
            "hf_linear_type": f"{type(hf_q).__module__}.{type(hf_q).__name__}",
            "hf_param_dtype": str(hf_q.weight.dtype),
            "hf_attn_implementation": getattr(self.hf.config, "_attn_implementation", None),
            "padding": "left, pad_token_id = eos",
        }

    # -- engine ------------------------------------------------------------------------
    def new_core(self, **overrides) -> EngineCore:
        a = self.args
        return EngineCore(engine_config(a, **overrides), self.loaded)

    def run_engine(self, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool,
                   breakdown: StepBreakdown | None = None, **overrides) -> dict:
        """All requests submitted at t0 to a fresh engine core (empty prefix cache), run to completion."""
        gc.collect()
        core = self.new_core(**overrides)
        if breakdown is not None:
            breakdown.attach(core)
        n = len(prompts)
        added = [0.0] * n
        first: list[float | None] = [None] * n
        finish: list[float | None] = [None] * n
        tokens: list[list[int]] = [[] for _ in range(n)]
        index = {f"r{i}": i for i in range(n)}
        steps = 0
        with measure_usage() as usage:
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                core.add_request(EngineCoreRequest(
                    f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=ignore_eos)))
                added[i] = time.perf_counter()
            while core.has_unfinished():
                outs = core.step()
                now = time.perf_counter()
                steps += 1
                for o in outs:
                    i = index[o.request_id]
                    if o.new_token_ids:
                        if first[i] is None:
                            first[i] = now
                        tokens[i].extend(o.new_token_ids)
                    if o.finish_reason is not None:
                        finish[i] = now
            t_end = time.perf_counter()
        stats = core.stats()
        if breakdown is not None:
            breakdown.restore()
        del core
        gc.collect()
        if ignore_eos:
            wrong = [i for i in range(n) if len(tokens[i]) != max_tokens[i]]
            if wrong:
                raise RuntimeError(f"engine produced the wrong number of tokens for requests {wrong[:5]}")
        ttft = [first[i] - added[i] for i in range(n) if first[i] is not None]
        tpot = [(finish[i] - first[i]) / (len(tokens[i]) - 1) for i in range(n)
                if first[i] is not None and finish[i] is not None and len(tokens[i]) > 1]
        total = sum(len(t) for t in tokens)
        wall = t_end - t0
        return {
            "output_tokens": total,
            "wall_s": wall,
            "tokens_per_s": total / wall,
            "ttft_median_s": median(ttft),
            "ttft_max_s": max(ttft) if ttft else None,
            "tpot_median_s": median(tpot),
            "steps": steps,
            "prefix_cache_hit_rate": (stats.prefix_cache_hits / stats.prefix_cache_queries
                                      if stats.prefix_cache_queries else 0.0),
            "preemptions": stats.num_preemptions,
            "peak_rss_mib": usage.peak_rss_mib,
            "usage": usage.as_dict(),
            "_tokens": tokens,
        }

    # -- HF static batching ------------------------------------------------------------------
    def run_hf(self, prompts: list[list[int]], max_tokens: list[int], stop_at_eos: bool, batch_size: int) -> dict:
        """Static batches in order: left padded with eos, max_new_tokens = the batch's longest request.

        A request's useful tokens are its first max_tokens[i] (up to and including eos when
        stop_at_eos). Throughput counts useful tokens only, over the whole wall time.
        """
        from transformers import GenerationConfig, LogitsProcessorList

        gc.collect()
        n = len(prompts)
        first: list[float] = [0.0] * n
        finish: list[float] = [0.0] * n
        tokens: list[list[int]] = [[] for _ in range(n)]
        computed = 0  # token positions generated, useful or not (padding work)
        batches = []
        for b in range(0, n, batch_size):
            rows = list(range(b, min(n, b + batch_size)))
            width = max(len(prompts[i]) for i in rows)
            ids = torch.full((len(rows), width), self.eos_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[r, width - len(prompts[i]):] = 1
            batches.append((rows, ids, mask, max(max_tokens[i] for i in rows)))
        with measure_usage() as usage:
            t0 = time.perf_counter()
            for rows, ids, mask, max_new in batches:
                timer = StepTimer()
                gen_cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, use_cache=True,
                                           pad_token_id=self.eos_id,
                                           eos_token_id=self.eos_id if stop_at_eos else [])
                with torch.inference_mode():
                    out = self.hf.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                           logits_processor=LogitsProcessorList([timer]))
                gen = out[:, ids.shape[1]:].tolist()
                computed += len(rows) * len(gen[0])
                for r, i in enumerate(rows):
                    seq = gen[r][:max_tokens[i]]
                    if stop_at_eos and self.eos_id in seq:
                        seq = seq[:seq.index(self.eos_id) + 1]
                    tokens[i] = seq
                    first[i] = timer.times[0] - t0
                    finish[i] = timer.times[len(seq) - 1] - t0
            wall = time.perf_counter() - t0
        if not stop_at_eos:
            wrong = [i for i in range(n) if len(tokens[i]) != max_tokens[i]]
            if wrong:
                raise RuntimeError(f"HF produced the wrong number of tokens for requests {wrong[:5]}")
        total = sum(len(t) for t in tokens)
        tpot = [(finish[i] - first[i]) / (len(tokens[i]) - 1) for i in range(n) if len(tokens[i]) > 1]
        return {
            "output_tokens": total,
            "computed_tokens": computed,
            "wall_s": wall,
            "tokens_per_s": total / wall,
            "ttft_median_s": median(first),
            "ttft_max_s": max(first),
            "tpot_median_s": median(tpot),
            "num_batches": len(batches),
            "peak_rss_mib": usage.peak_rss_mib,
            "usage": usage.as_dict(),
            "_tokens": tokens,
        }

    # -- warm-up --------------------------------------------------------------------------
    def warmup(self, prompts: list[list[int]]) -> None:
        t = time.perf_counter()
        self.run_engine(prompts, [4] * len(prompts), ignore_eos=True)
        self.run_engine(prompts[:1], [4], ignore_eos=True)
        if self.hf is not None:
            self.run_hf(prompts, [4] * len(prompts), stop_at_eos=False, batch_size=len(prompts))
            self.run_hf(prompts[:1], [4], stop_at_eos=False, batch_size=1)
        self.load_s["warmup"] = time.perf_counter() - t


def _strip(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_")}


def _medians(samples: list[dict]) -> dict:
    keys = ("tokens_per_s", "ttft_median_s", "tpot_median_s", "peak_rss_mib", "wall_s", "output_tokens")
    return {k: summarize([s[k] for s in samples]) for k in keys if k in samples[0]}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or a != a or b != b:
        return None
    return a / b


def _pair(bench: Bench, name: str, reps: int, engine_fn, hf_fn) -> dict:
    """Alternate engine / HF measurements (engine first on even repeats) and collect them."""
    eng, hf = [], []
    for r in range(reps):
        order = [("engine", engine_fn, eng), ("hf", hf_fn, hf)]
        if r % 2:
            order.reverse()
        for side, fn, bucket in order:
            if fn is None:
                continue
            waited = wait_for_quiet(bench.args.wait_quiet, bench.args.quiet_cores, log)
            res = fn()
            res["waited_for_quiet_s"] = waited
            bucket.append(res)
            log(f"[{name} {r + 1}/{reps}] {side:6s} {res['tokens_per_s']:8.1f} tok/s  "
                f"wall {res['wall_s']:6.1f} s  ttft {res['ttft_median_s']:.3f} s  "
                f"tpot {res['tpot_median_s'] * 1e3:6.1f} ms  rss {res['peak_rss_mib']:.0f} MiB  "
                f"foreign cores {res['usage']['foreign_cores'] or 0:.2f}"
                + ("  NOISY" if (res['usage']['foreign_cores'] or 0) > bench.args.quiet_cores else ""))
    return {"engine": eng, "hf": hf}


def scenario_batch64(bench: Bench, prompts: list[list[int]], reps: int) -> dict:
    a = bench.args
    mt = [a.output_tokens] * len(prompts)
    runs = _pair(bench, "batch64", reps,
                 lambda: bench.run_engine(prompts, mt, ignore_eos=True),
                 None if bench.hf is None else lambda: bench.run_hf(prompts, mt, False, len(prompts)))
    out = {"workload": f"{len(prompts)} chat prompts x {a.output_tokens} output tokens, greedy, ignore_eos, "
                       f"all submitted at t0; HF: one static batch of {len(prompts)}",
           "prompt_tokens": sum(map(len, prompts)),
           "engine": _medians(runs["engine"])}
    if runs["hf"]:
        out["hf"] = _medians(runs["hf"])
        out["ratio_vs_hf_static"] = _ratio(out["engine"]["tokens_per_s"]["median"], out["hf"]["tokens_per_s"]["median"])
        out["paired_ratios"] = [e["tokens_per_s"] / h["tokens_per_s"] for e, h in zip(runs["engine"], runs["hf"])]
        e_tok, h_tok = runs["engine"][-1]["_tokens"], runs["hf"][-1]["_tokens"]
        prefixes = [_common_prefix(e, h) for e, h in zip(e_tok, h_tok)]
        out["greedy_agreement_with_hf"] = {
            "median_common_prefix_tokens": median(prefixes),
            "identical_requests": sum(p == a.output_tokens for p in prefixes),
            "first_token_identical": sum(p >= 1 for p in prefixes),
            "of": len(prefixes),
            "note": "bf16 numerics differ (fused QKV, paged SDPA vs padded SDPA), so greedy paths may fork",
        }
    out["engine_runs"] = [_strip(r) for r in runs["engine"]]
    out["hf_runs"] = [_strip(r) for r in runs["hf"]]
    return out


def scenario_single(bench: Bench, prompt: list[int], reps: int) -> dict:
    a = bench.args
    mt = [a.single_tokens]
    runs = _pair(bench, "single", reps,
                 lambda: bench.run_engine([prompt], mt, ignore_eos=True),
                 None if bench.hf is None else lambda: bench.run_hf([prompt], mt, False, 1))
    out = {"workload": f"1 request ({len(prompt)} prompt tokens) x {a.single_tokens} output tokens, greedy, "
                       f"ignore_eos; HF: generate with batch size 1",
           "engine": _medians(runs["engine"])}
    out["engine"]["decode_tokens_per_s"] = summarize([1 / r["tpot_median_s"] for r in runs["engine"]])
    if runs["hf"]:
        out["hf"] = _medians(runs["hf"])
        out["hf"]["decode_tokens_per_s"] = summarize([1 / r["tpot_median_s"] for r in runs["hf"]])
        out["decode_ratio_vs_hf"] = _ratio(out["hf"]["tpot_median_s"]["median"],
                                           out["engine"]["tpot_median_s"]["median"])
        out["end_to_end_ratio_vs_hf"] = _ratio(out["engine"]["tokens_per_s"]["median"],
                                               out["hf"]["tokens_per_s"]["median"])
    out["engine_runs"] = [_strip(r) for r in runs["engine"]]
    out["hf_runs"] = [_strip(r) for r in runs["hf"]]
    return out


def scenario_quantized(bench: Bench, prompts: list[list[int]], reps: int) -> dict:
    """The GGUF's quantized weights (the default) against --gguf-dequantize on the same loaded
    model, runs alternating: single-request decode and the batch64 workload; with --llama-cpp,
    llama.cpp's single-request decode on the same file and prompt joins the single rotation."""
    a = bench.args
    out: dict = {"workload": "single: 1 request x --single-tokens; batch64: --num-prompts x --output-tokens; "
                             "greedy, ignore_eos; quantized = default, dense = --gguf-dequantize"}
    llama_py = None
    if a.llama_cpp:
        from peers import llama_cpp_python as llama_cpp_peer

        llama_py = llama_cpp_peer.ensure_llama_cpp(llama_cpp_peer.default_venv())
    for name, ps, mt in (("single", [prompts[2]], [a.single_tokens]),
                         ("batch64", prompts, [a.output_tokens] * len(prompts))):
        runs: dict[str, list[dict]] = {"quantized": [], "dense": []}
        order = [("quantized", False), ("dense", True)]
        if llama_py is not None and name == "single":
            runs["llama.cpp"] = []
            order.append(("llama.cpp", None))
        for r in range(reps):
            for side, dequantize in (order if r % 2 == 0 else order[::-1]):
                wait_for_quiet(a.wait_quiet, a.quiet_cores, log)
                if dequantize is None:
                    res = llama_cpp_peer.single_decode(llama_py, str(bench.src.path), ps[0], mt[0])
                    res["_tokens"] = [res.pop("tokens")]
                else:
                    res = bench.run_engine(ps, mt, ignore_eos=True, gguf_dequantize=dequantize)
                runs[side].append(res)
                log(f"[quantized/{name} {r + 1}/{reps}] {side:9s} {res['tokens_per_s']:8.1f} tok/s  "
                    f"tpot {res['tpot_median_s'] * 1e3:6.2f} ms  ttft {res['ttft_median_s']:.3f} s")
        q, d = _medians(runs["quantized"]), _medians(runs["dense"])
        out[name] = {"quantized": q, "dense": d,
                     "ratio_tokens_per_s": _ratio(q["tokens_per_s"]["median"], d["tokens_per_s"]["median"]),
                     "ratio_decode": _ratio(d["tpot_median_s"]["median"], q["tpot_median_s"]["median"]),
                     "quantized_runs": [_strip(r) for r in runs["quantized"]],
                     "dense_runs": [_strip(r) for r in runs["dense"]]}
        if runs.get("llama.cpp"):
            lc = _medians(runs["llama.cpp"])
            out[name]["llama_cpp"] = lc
            out[name]["llama_cpp_runs"] = [_strip(r) for r in runs["llama.cpp"]]
            # decode speed against llama.cpp's: its TPOT over ours
            out[name]["ratio_decode_vs_llama_cpp"] = _ratio(lc["tpot_median_s"]["median"], q["tpot_median_s"]["median"])
            lc_eval = median([r["eval_tpot_median_s"] for r in runs["llama.cpp"]])
            out[name]["llama_cpp_decode_only_tpot_s"] = lc_eval
            out[name]["ratio_decode_vs_llama_cpp_decode_only"] = _ratio(lc_eval, q["tpot_median_s"]["median"])
            ours, theirs = runs["quantized"][0]["_tokens"][0], runs["llama.cpp"][0]["_tokens"][0]
            out[name]["same_tokens_as_llama_cpp"] = _common_prefix(ours, theirs)
    return out


def scenario_scale(bench: Bench, reps: int, reuse64: list[dict] | None) -> dict:
    a = bench.args
    levels = {}
    for n in a.scale_levels:
        prompts = chat_prompts(bench.tok, n)
        mt = [a.output_tokens] * n
        if reuse64 is not None and n == a.num_prompts and not a.scale_hf:
            runs = {"engine": reuse64, "hf": []}
            reused = True
        else:
            runs = _pair(bench, f"scale{n}", reps,
                         lambda: bench.run_engine(prompts, mt, ignore_eos=True),
                         (lambda: bench.run_hf(prompts, mt, False, n)) if a.scale_hf and bench.hf else None)
            reused = False
        lv = {"engine": _medians(runs["engine"]), "prompt_tokens": sum(map(len, prompts))}
        if reused:
            lv["reused_from"] = "batch64"
        if runs["hf"]:
            lv["hf"] = _medians(runs["hf"])
            lv["ratio_vs_hf_static"] = _ratio(lv["engine"]["tokens_per_s"]["median"],
                                              lv["hf"]["tokens_per_s"]["median"])
        lv["engine_runs"] = [_strip(r) for r in runs["engine"]]
        lv["hf_runs"] = [_strip(r) for r in runs["hf"]]
        levels[str(n)] = lv
    tps = [levels[str(n)]["engine"]["tokens_per_s"]["median"] for n in a.scale_levels]
    return {
        "workload": f"engine at {a.scale_levels} concurrent requests x {a.output_tokens} output tokens, greedy, "
                    f"ignore_eos, all submitted at t0 (prompts beyond 64 are styled variants of the 64)",
        "levels": levels,
        "tokens_per_s_by_level": dict(zip(map(str, a.scale_levels), tps)),
        "throughput_rising": all(b > x for x, b in zip(tps, tps[1:])),
    }


def scenario_mixed(bench: Bench, reps: int) -> dict:
    a = bench.args
    n = a.mixed_requests
    prompts = chat_prompts(bench.tok, n)
    lengths = draw_lengths(n, a.mixed_min, a.mixed_max, a.seed)
    runs = _pair(bench, "mixed", reps,
                 lambda: bench.run_engine(prompts, lengths, ignore_eos=False),
                 None if bench.hf is None else lambda: bench.run_hf(prompts, lengths, True, a.hf_batch_size))
    out = {
        "workload": f"{n} chat prompts, output lengths drawn uniformly from [{a.mixed_min}, {a.mixed_max}] "
                    f"(seed {a.seed}, sum {sum(lengths)}), greedy, stop at eos; all submitted at t0",
        "hf_method": f"static batches of {a.hf_batch_size} in submission order, one generate each with "
                     f"max_new_tokens = the batch's longest drawn length, eos stops a row (pad = eos, the "
                     f"batch ends when every row stopped or at max_new_tokens); a request's useful tokens are "
                     f"its first drawn-length tokens, cut after eos; tokens/s = useful tokens / total wall time; "
                     f"TTFT counted from t0 (includes waiting for earlier batches)",
        "drawn_lengths": lengths,
        "engine": _medians(runs["engine"]),
    }
    if runs["hf"]:
        out["hf"] = _medians(runs["hf"])
        out["hf"]["computed_tokens"] = runs["hf"][-1]["computed_tokens"]
        out["ratio_vs_hf_static"] = _ratio(out["engine"]["tokens_per_s"]["median"],
                                           out["hf"]["tokens_per_s"]["median"])
        out["paired_ratios"] = [e["tokens_per_s"] / h["tokens_per_s"] for e, h in zip(runs["engine"], runs["hf"])]
    out["engine_runs"] = [_strip(r) for r in runs["engine"]]
    out["hf_runs"] = [_strip(r) for r in runs["hf"]]
    return out


def profile_batch64(bench: Bench, prompts: list[list[int]]) -> dict:
    bd = StepBreakdown()
    res = bench.run_engine(prompts, [bench.args.output_tokens] * len(prompts), ignore_eos=True, breakdown=bd)
    rep = bd.report()
    rep["tokens_per_s_with_timers"] = res["tokens_per_s"]
    rep["wall_s"] = res["wall_s"]
    return rep


# -- report ---------------------------------------------------------------------------------
def print_table(results: dict) -> None:
    rows = []

    def add(label: str, side: dict | None, ratio=None) -> None:
        if not side:
            return
        m = {k: v["median"] for k, v in side.items() if isinstance(v, dict) and "median" in v}
        rows.append((label, fmt(m.get("tokens_per_s"), ".1f"), fmt(m.get("ttft_median_s"), ".3f"),
                     fmt(m.get("tpot_median_s"), ".1f", 1e3), fmt(m.get("peak_rss_mib"), ".0f"),
                     fmt(ratio, ".2f") + ("x" if ratio else "")))

    sc = results["scenarios"]
    if "batch64" in sc:
        add("batch64 engine", sc["batch64"]["engine"], sc["batch64"].get("ratio_vs_hf_static"))
        add("batch64 hf-static", sc["batch64"].get("hf"))
    if "single" in sc:
        add("single engine", sc["single"]["engine"], sc["single"].get("decode_ratio_vs_hf"))
        add("single hf", sc["single"].get("hf"))
    if "scale" in sc:
        for n, lv in sc["scale"]["levels"].items():
            add(f"scale{n} engine", lv["engine"], lv.get("ratio_vs_hf_static"))
            add(f"scale{n} hf-static", lv.get("hf"))
    if "mixed" in sc:
        add("mixed engine", sc["mixed"]["engine"], sc["mixed"].get("ratio_vs_hf_static"))
        add("mixed hf-static", sc["mixed"].get("hf"))
    if "quantized" in sc:
        for name in ("single", "batch64"):
            part = sc["quantized"][name]
            add(f"{name} quantized", part["quantized"],
                part["ratio_decode"] if name == "single" else part["ratio_tokens_per_s"])
            add(f"{name} dense", part["dense"])
            if "llama_cpp" in part:
                add(f"{name} llama.cpp", part["llama_cpp"], part["ratio_decode_vs_llama_cpp"])
                print(f"llama.cpp decode only (llama_decode of one token, no sampling): "
                      f"{part['llama_cpp_decode_only_tpot_s'] * 1e3:.2f} ms, our quantized TPOT / it: "
                      f"{1 / part['ratio_decode_vs_llama_cpp_decode_only']:.3f}")
    for line in format_table(("scenario", "out tok/s", "TTFT s", "TPOT ms", "RSS MiB", "ratio"), rows):
        print(line)
    print("(medians over repeats; ratio = engine/HF tokens/s, single: HF TPOT / engine TPOT (decode); "
          "quantized rows: against --gguf-dequantize, single by decode TPOT; llama.cpp row: "
          "its TPOT / our quantized TPOT)")


def evaluate_targets(results: dict) -> dict:
    sc = results["scenarios"]
    out = {}
    for key, target in TARGETS.items():
        name, field = key.split(".")
        if name in sc and sc[name].get(field) is not None:
            v = sc[name][field]
            out[key] = {"value": v, "target": f">= {target}", "met": v >= target}
    if "scale" in sc:
        out["scale.throughput_rising"] = {"value": sc["scale"]["tokens_per_s_by_level"],
                                          "target": "rising with concurrency", "met": sc["scale"]["throughput_rising"]}
    return out


def _noisy_runs(results: dict, threshold: float) -> list[str]:
    """Measurements during which other processes kept more than `threshold` cores busy."""
    found = []

    def scan(prefix: str, node: dict) -> None:
        for side in ("engine_runs", "hf_runs"):
            for i, r in enumerate(node.get(side, [])):
                fc = r.get("usage", {}).get("foreign_cores")
                if fc is not None and fc > threshold and not node.get("reused_from"):
                    found.append(f"{prefix}.{side}[{i}] ({fc:.2f} cores)")

    for name, sc in results["scenarios"].items():
        scan(name, sc)
        for n, lv in sc.get("levels", {}).items():
            scan(f"{name}{n}", lv)
    return found


def run_scenarios(bench: Bench, prompts: list[list[int]]) -> dict:
    """Each scenario of --scenarios in order (scale reuses batch64's engine runs at 64); name -> its results."""
    args = bench.args
    sc: dict = {}
    for name in args.scenarios:
        reps = args.repeats_for[name]
        if name == "batch64":
            sc["batch64"] = scenario_batch64(bench, prompts, reps)
        elif name == "single":
            sc["single"] = scenario_single(bench, prompts[2], reps)
        elif name == "scale":
            reuse = None
            if "batch64" in sc:
                reuse = sc["batch64"]["engine_runs"]
            sc["scale"] = scenario_scale(bench, reps, reuse)
        elif name == "mixed":
            sc["mixed"] = scenario_mixed(bench, reps)
        elif name == "quantized":
            sc["quantized"] = scenario_quantized(bench, prompts, reps)
    return sc


def describe_run(bench: Bench) -> dict:
    """The results file's header: command, environment, model, engine settings, baseline, metric definitions."""
    args = bench.args
    return {
        "benchmark": "engine_throughput",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "environment": environment(),
        "model": bench.loaded.name,
        "dtype": args.dtype,
        "engine_config": {"kv_cache_gib": args.kv_cache_gib, "max_num_seqs": args.max_num_seqs,
                          "max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size,
                          "enable_prefix_caching": not args.no_prefix_caching},
        "baseline": {"kind": "HF transformers generate, static batching", **bench.baseline_info},
        "repeats": {s: args.repeats_for[s] for s in args.scenarios},
        "load_s": bench.load_s,
        "metric_definitions": {
            "tokens_per_s": "useful output tokens / wall time from first submission to last token",
            "ttft": "engine: add_request -> first output token; HF: generate() call -> first step's logits "
                    "(no-op LogitsProcessor timestamps), from t0 for later static batches",
            "tpot": "(finish - first token) / (tokens - 1) per request; median over requests",
            "peak_rss_mib": "highest sampled RSS of the whole process during the measurement (both models "
                            "and the engine's preallocated KV cache resident)",
            "medians": "each figure is the median over repeats of the per-run value",
        },
        "scenarios": {},
    }


def headline_ratio(sc: dict) -> float | None:
    """batch64's engine/HF ratio, else the first of mixed and scale that has one."""
    headline = sc.get("batch64", {}).get("ratio_vs_hf_static")
    if headline is None:  # fall back to whichever scenario has a baseline
        for name in ("mixed", "scale"):
            headline = sc.get(name, {}).get("ratio_vs_hf_static")
            if headline is not None:
                break
    return headline


def print_report(results: dict, out: pathlib.Path, quiet_cores: float) -> None:
    """The table, the profile (if any), each target, the noisy-run warning and the headline line."""
    print()
    print_table(results)
    if "profile_batch64" in results:
        p = results["profile_batch64"]
        print(f"\nengine step breakdown, batch64 ({p['steps']} steps, {p['total_s']:.1f} s):")
        for k, v in p["phases"].items():
            print(f"  {v['share'] * 100:5.1f}%  {v['seconds']:7.2f} s  {k}")
    print()
    for k, v in results["targets"].items():
        val = v["value"]
        val = f"{val:.2f}" if isinstance(val, float) else json.dumps({a: round(b, 1) for a, b in val.items()}) \
            if isinstance(val, dict) else val
        print(f"target {k}: {val} ({v['target']}) {'MET' if v['met'] else 'MISSED'}")
    noisy = results["noisy_runs"]["runs"]
    if noisy:
        print(f"WARNING: {len(noisy)} measurement(s) ran while other processes used > {quiet_cores} cores: "
              + ", ".join(noisy))
    print(f"saved {out} (total {results['total_s']:.0f} s)")
    headline = results["ratio_vs_hf_static"]
    print(f"ratio_vs_hf_static={fmt(headline, '.2f') if headline is not None else 'nan'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    bench = Bench(args)
    prompts = chat_prompts(bench.tok, args.num_prompts)
    log(f"loaded in {sum(bench.load_s.values()):.1f} s; {torch.get_num_threads()} threads; dtype {args.dtype}; "
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    bench.warmup(prompts)
    log(f"warm-up done in {bench.load_s['warmup']:.1f} s")

    results = describe_run(bench)
    results["scenarios"] = run_scenarios(bench, prompts)
    if args.profile:
        results["profile_batch64"] = profile_batch64(bench, prompts)
    results["targets"] = evaluate_targets(results)
    noisy = _noisy_runs(results, args.quiet_cores)
    results["noisy_runs"] = {"threshold_foreign_cores": args.quiet_cores, "count": len(noisy), "runs": noisy}
    results["process_max_rss_mib"] = maxrss_mib()
    results["total_s"] = time.perf_counter() - t_start
    results["ratio_vs_hf_static"] = headline_ratio(results["scenarios"])

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_report(results, out, args.quiet_cores)
    if args.strict and not all(v["met"] for v in results["targets"].values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
