#!/usr/bin/env python
"""What the three-service stack adds to one request's decode time (issue 33: <= 10%), measured
pair by pair.

Two sides, both at their defaults and both resident the whole run:
  served      the three services (`servers.TesseraServer`, as serve_vs_vllm.py starts them),
              one streamed chat request over the OpenAI HTTP API with tessera bench's client;
              TPOT = (last content chunk - first) / (tokens - 1)
  inprocess   an EngineCore in a worker process of its own (this file with --worker, tcmalloc
              preloaded as the engine service preloads it), stepped alone; TPOT from the
              times the steps return the first and the last token
Each pair is one request of --tokens (greedy, ignore_eos) on the same chat prompt on each side,
the order switching pair by pair, so the machine's drift (10-30% from one minute to the next
on the development machines) hits both sides of a pair alike: serve_vs_vllm.py's figure for
the same thing compares runs minutes apart. Also the CPU each stack process and this client
spend per served token (psutil), which says where the added time goes: on 2 cores, every
other process's work of a token preempts one of the engine's two OpenMP threads.

--engine-side adds a third side to each pair, between the two: the same request (the prompt's
token ids) on a Session stream straight to the stack's engine service, which splits the added time
into the engine service's part (engine / in-process) and the frontend, tokenizer and HTTP part
(served / engine).

--peer llama.cpp measures llama.cpp's own stack the same way, as the reference for what a server
adds on the machine: `llama-server` (as serve_vs_vllm.py starts it) on the default model's GGUF
against a resident llama-cpp-python worker on the same file (peers/llama_cpp_python.py; TPOT from
its generate loop's first and last token, and also one llama_decode alone, no sampling).

Last line: `single_tpot_added=<median over pairs of served TPOT / in-process TPOT - 1>`.

    python benchmarks/single_overhead.py                 # 2 x 4 pairs, ~3 min
    python benchmarks/single_overhead.py --pairs 2 --rounds 1 --tokens 32 --wait-quiet 0   # smoke
    python benchmarks/single_overhead.py --engine-side     # + the engine service alone, ~4 min
    python benchmarks/single_overhead.py --peer llama.cpp   # llama-server against llama.cpp in-process
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import time

BENCHMARKS = pathlib.Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from common import add_run_flags  # noqa: E402


def worker(prompt_json: str, tokens: int) -> None:
    """The in-process side: one EngineCore at its defaults; a request per line read on stdin,
    its TPOT printed."""
    from tessera_engine.backend_plan import plan_backends
    from tessera_engine.config import EngineConfig
    from tessera_engine.core import EngineCore
    from tessera_engine.request import EngineCoreRequest
    from tessera_engine.sampling_params import SamplingParams

    config = EngineConfig()
    _, loaded = plan_backends(config)
    core = EngineCore(config, loaded)
    ids = json.loads(prompt_json)
    print("READY", flush=True)
    for k, _ in enumerate(sys.stdin):
        core.add_request(EngineCoreRequest(f"r{k}", ids, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                        ignore_eos=True)))
        times: list[float] = []
        while core.has_unfinished():
            for o in core.step():
                times += [time.perf_counter()] * len(o.new_token_ids)
        print(f"TPOT {(times[-1] - times[0]) / (len(times) - 1)} {len(times)}", flush=True)


async def engine_direct_tpot(addr: str, prompt_ids: list[int], tokens: int) -> tuple[float, int]:
    """One greedy request on a Session stream straight to the engine service (no frontend, no
    tokenizer, no HTTP): TPOT from the arrival of its first and last token, and the tokens."""
    from common import engine_session

    from tessera.v1 import common_pb2, engine_pb2

    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    request = engine_pb2.EngineRequest(request_id="single-overhead", prompt_token_ids=prompt_ids,
                                       sampling_params=params)
    stamps: list[float] = []
    async for now, step in engine_session(addr, [request]):
        for o in step.outputs:
            stamps += [now] * len(o.new_token_ids)
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), len(stamps)


class InProcess:
    """A resident worker process and its request / TPOT lines: `TPOT <seconds> [<seconds alone>] <tokens>`."""

    def __init__(self, command: list[str], env: dict, tcmalloc: str | None = None) -> None:
        self.tcmalloc = tcmalloc
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)
        self._until("READY")

    @classmethod
    def tessera(cls, prompt_ids: list[int], tokens: int) -> "InProcess":
        from tessera_engine import allocator, openmp_env

        env = openmp_env.apply({k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")})
        lib = allocator.find_tcmalloc()
        if lib:  # as the engine service runs (it re-executes itself with tcmalloc preloaded)
            env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else lib
        return cls([sys.executable, __file__, "--worker", json.dumps(prompt_ids), str(tokens)], env, lib)

    def _until(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line
        raise RuntimeError(f"the in-process worker exited ({self.proc.wait()}) before {prefix}")

    def tpot(self) -> tuple[float, float | None, int]:
        """TPOT, the decode alone where the worker times it (llama.cpp), tokens."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        fields = self._until("TPOT").split()[1:]
        return float(fields[0]), float(fields[1]) if len(fields) == 3 else None, int(fields[-1])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="stack + worker starts (default 2)")
    ap.add_argument("--pairs", type=int, default=4, help="pairs of requests a round (default 4)")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens a request (default 256)")
    ap.add_argument("--peer", choices=("tessera", "llama.cpp"), default="tessera",
                    help="whose stack: tessera's three services, or llama-server against llama.cpp in-process")
    ap.add_argument("--engine-side", action="store_true",
                    help="tessera: a third side, the same request on a Session stream straight to the stack's "
                         "engine service, which splits the added time into the engine service's part and the "
                         "frontend, tokenizer and HTTP part")
    add_run_flags(ap, "single_overhead", startup_timeout_s=300)
    ap.add_argument("--worker", nargs=2, metavar=("PROMPT_IDS", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer != "tessera" and args.out == ap.get_default("out"):  # beside tessera's, not over it
        args.out = args.out.replace("single_overhead.json", "single_overhead_llama_cpp.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return 0

    import psutil
    from transformers import AutoTokenizer

    from common import chat_prompts, environment, log, questions, wait_for_quiet
    from measure import sequential, single_summary
    from servers import TesseraServer
    from tessera.bench.metrics import median
    from tessera.common.model_source import resolve_model

    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    question = questions(3)[2]
    prompt_ids = chat_prompts(tok, 3)[2]
    del tok

    def start_peer():  # a fresh server and in-process worker of the peer
        if args.peer == "tessera":
            return TesseraServer(args.startup_timeout), lambda: InProcess.tessera(prompt_ids, args.tokens)
        from peers import llama_cpp_python, llama_server
        from servers import LlamaServer

        gguf = str(src.path)
        py = llama_cpp_python.ensure_llama_cpp(llama_cpp_python.default_venv())
        return (LlamaServer(args.startup_timeout, llama_server.ensure_llama_server(), gguf),
                lambda: InProcess(llama_cpp_python.resident_command(py, gguf, prompt_ids, args.tokens), dict(os.environ)))

    me = psutil.Process()
    pairs: list[dict] = []
    cpu_per_token: dict[str, list[float]] = {}
    for r in range(args.rounds):
        wait_for_quiet(args.wait_quiet, log=log)
        server, start_inprocess = start_peer()
        server.start()
        inproc = start_inprocess()
        try:
            procs = {role: psutil.Process(p.pid) for role, p in server.procs.items()}

            def served() -> float:
                # measure.py's single-request figures (its check that every token streamed, too)
                res = asyncio.run(sequential(server.root_url, server.model_id, [question], args.tokens))
                return 1.0 / single_summary(res, args.tokens)["decode_tokens_per_s"]

            served(), inproc.tpot()  # warm-up: first shapes, the client's connection
            time.sleep(1.0)
            wait_for_quiet(args.wait_quiet, log=log)
            engine_addr = server.stack.addr("engine") if args.engine_side and args.peer == "tessera" else None
            for i in range(args.pairs):
                sides = ("served", "inprocess") if (i + r) % 2 == 0 else ("inprocess", "served")
                if engine_addr:  # between the two, where the drift moves it least from either
                    sides = (sides[0], "engine", sides[1])
                got = {}
                for side in sides:
                    if side == "served":
                        c0 = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
                        m0 = sum(me.cpu_times()[:2])
                        got["served"] = served()
                        for k, p in procs.items():
                            cpu_per_token.setdefault(k, []).append((sum(p.cpu_times()[:2]) - c0[k]) / args.tokens)
                        cpu_per_token.setdefault("client", []).append((sum(me.cpu_times()[:2]) - m0) / args.tokens)
                    elif side == "engine":
                        got["engine"], n = asyncio.run(engine_direct_tpot(engine_addr, prompt_ids, args.tokens))
                        if n != args.tokens:
                            raise RuntimeError(f"engine-direct request: {n} tokens")
                    else:
                        got["inprocess"], alone, n = inproc.tpot()
                        if alone is not None:
                            got["inprocess_decode_alone"] = alone
                        if n != args.tokens:
                            raise RuntimeError(f"in-process request: {n} tokens")
                pairs.append({"round": r, "first": sides[0], **got, "ratio": got["served"] / got["inprocess"]})
                engine_note = f", engine service {got['engine'] * 1e3:.2f} ms" if "engine" in got else ""
                log(f"round {r} pair {i}: served {got['served'] * 1e3:.2f} ms, in-process "
                    f"{got['inprocess'] * 1e3:.2f} ms, {got['served'] / got['inprocess']:.3f}{engine_note}")
        finally:
            inproc.close()
            server.stop()

    ratio = median(p["ratio"] for p in pairs)
    cpu = {k: median(v) * 1e3 for k, v in cpu_per_token.items()}
    inside = "EngineCore" if args.peer == "tessera" else "llama-cpp-python"
    print(f"\n{args.peer}: one request of {args.tokens} tokens, {len(pairs)} pairs (served over HTTP, in-process {inside})")
    print(f"  TPOT served     median {median(p['served'] for p in pairs) * 1e3:7.2f} ms")
    print(f"  TPOT in-process median {median(p['inprocess'] for p in pairs) * 1e3:7.2f} ms")
    print(f"  served / in-process, median over pairs: {ratio:.3f} (target <= 1.10)")
    if all("engine" in p for p in pairs):
        print(f"  TPOT engine service alone median {median(p['engine'] for p in pairs) * 1e3:7.2f} ms: "
              f"engine / in-process {median(p['engine'] / p['inprocess'] for p in pairs):.3f}, "
              f"served / engine {median(p['served'] / p['engine'] for p in pairs):.3f}")
    if all("inprocess_decode_alone" in p for p in pairs):
        print(f"  one llama_decode alone median {median(p['inprocess_decode_alone'] for p in pairs) * 1e3:7.2f} ms; "
              f"served / that: {median(p['served'] / p['inprocess_decode_alone'] for p in pairs):.3f}")
    print("  CPU ms per served token: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "worker"},
                               "environment": environment(), "tcmalloc_inprocess": inproc.tcmalloc,
                               "pairs": pairs, "cpu_ms_per_served_token": cpu, "ratio_median": ratio}, indent=1))
    print(f"results: {out}")
    print(f"single_tpot_added={ratio - 1:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
