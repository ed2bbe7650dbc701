#!/usr/bin/env python
"""Stack overhead benchmark: the three-service stack, driven by a gRPC client, vs the in-process engine core.

A benchmark, not a test. Workload (the engine benchmark's batch64): the 64 chat
questions of benchmarks/common.py, greedy, max_tokens 128, ignore_eos, all
submitted at t0.

  inprocess  tessera_engine.core.EngineCore in this process (a fresh core, hence an
             empty prefix cache, per measurement), stepped in a loop; the prompts
             are the token ids the tokenizer service renders for the same chats.
  stack      tokenizer, engine and frontend as three processes on free loopback
             ports; this process is the client: 64 concurrent
             FrontendService/Generate streams (chat messages) over grpc.aio.
  engine     (a diagnostic, --no-engine-side skips it) the same engine process driven
             directly on its Session stream with the in-process side's token ids: the
             engine service alone, without frontend and tokenizer. It splits the
             stack's gap into the engine service's part (engine / inprocess) and the
             frontend + tokenizer part (stack / engine).

The stack runs with the services' defaults (every token streamed at once, uvloop) unless
--stream-interval / --event-loop say otherwise; the client uses the same event loop.

Both sides get the same engine flags (--dtype, --kv-cache-gib, --max-num-seqs,
--max-num-batched-tokens, --block-size, --threads, prefix caching) and alternate
repeat by repeat. Each repeat prefixes every chat with its own system message, so
the stack engine's prefix cache (it lives across repeats) never holds an earlier
repeat's blocks: both sides start each measurement cold.

Metrics (medians over --repeats are quoted):
  output tokens/s  all output tokens / wall time from the first submission to the last token
  TTFT             per request, submission -> its first token as the caller sees it
                   (stack: the client's gRPC call -> the first streamed token; in-process:
                   add_request -> the step that produced it); the median over requests

Isolated-request TTFT (--ttft-probes, default 16): the same questions one at a time
(max_tokens 1) on each side, so the median difference is the stack's own per-request
latency (tokenize, the gRPC hops, detokenize) without the batch-64 step quantization
that dominates the TTFT of the concurrent workload on CPU. The sides take turns prompt
by prompt, and the whole set runs once untimed first (under another system message), so
that neither side pays for its first single-request prompt shapes (torch's kernel
set-up) inside the timing; run side after side without that, whichever went first paid
for it in its TTFT.

CPU seconds per run of each process (stack and engine sides; the client is this process,
the services are read from /proc): where the CPU the engine shares its cores with goes.

Placement (--placement):
  split   the cores are divided as separate pods would have them: both engines
          (the in-process one and the engine service) get all cores but the last, with a
          torch thread per core; the client, the frontend and the tokenizer get the last core.
          The in-process side runs on the same cores as the stack's engine, so the ratio is
          the cost of the split itself. Needs at least 2 cores.
  shared  (default: as `make run` and compose run the stack on one machine) every process
          may run on every core: the engine's torch threads share the
          machine's cores with the client, the frontend and the tokenizer. On a small
          machine their CPU preempts one of the engine's
          OpenMP threads and the other one spins at the next barrier, so this measures
          co-location on too few cores as much as the split.

The last line printed is `stack_vs_inprocess=<stack tokens/s / in-process tokens/s>`.
Results go to results/stack_overhead.json (or --out).

  python benchmarks/stack_overhead.py                  # 3 repeats
  python benchmarks/stack_overhead.py --repeats 1 --output-tokens 32   # smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TQDM_DISABLE", "1")

import grpc  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (add_engine_flags, add_run_flags, engine_config, engine_session, environment, log,  # noqa: E402
                    measure_usage, questions, wait_for_quiet)

from tessera import launch  # noqa: E402
from tessera.bench.metrics import median  # noqa: E402
from tessera.common import aio  # noqa: E402
from tessera.common.grpc_service import CHANNEL_OPTIONS  # noqa: E402
from tessera.v1 import (common_pb2, engine_pb2, frontend_pb2, frontend_pb2_grpc,  # noqa: E402
                        tokenizer_pb2, tokenizer_pb2_grpc)
from tessera_engine.core import EngineCore  # noqa: E402
from tessera_engine.backend_plan import plan_backends  # noqa: E402
from tessera_engine.request import EngineCoreRequest  # noqa: E402
from tessera_engine.sampling_params import SamplingParams  # noqa: E402

HOST = launch.HOST
TARGETS = {"stack_vs_inprocess": 0.95, "ttft_added_ms": 10.0}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="measurements per side; medians are quoted")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="auto", help="engine dtype on both sides (auto: fp32 CPU, bf16 CUDA)")
    ap.add_argument("--device", default="auto")
    add_engine_flags(ap)
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the frontend's --stream-interval (tokens per streamed message after the first)")
    ap.add_argument("--event-loop", default="auto", choices=aio.EVENT_LOOPS,
                    help="event loop of the stack's services and of this gRPC client")
    ap.add_argument("--placement", default="shared", choices=("split", "shared"),
                    help="shared: every process on every core; split: the engines on all cores but the "
                         "last, the client, frontend and tokenizer on the last (see above)")
    ap.add_argument("--ttft-probes", type=int, default=16, help="isolated requests per side for TTFT (0: none)")
    ap.add_argument("--no-engine-side", action="store_true", help="skip the engine-service-alone diagnostic")
    add_run_flags(ap, "stack_overhead", startup_timeout_s=600)
    return ap.parse_args(argv)


# -- the stack ---------------------------------------------------------------------------------
class Placement:
    """Which cores the engines use and which the client, frontend and tokenizer use (None: any)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.engine: list[int] | None = None
        self.others: list[int] | None = None
        if mode == "split":
            if not hasattr(os, "sched_getaffinity") or shutil.which("taskset") is None:
                raise SystemExit("--placement split needs Linux CPU affinity and taskset (util-linux); "
                                 "use --placement shared")
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                raise SystemExit("--placement split needs at least 2 cores; use --placement shared")
            self.engine, self.others = cpus[:-1], cpus[-1:]

    def prefix(self, name: str) -> list[str]:
        """What a service's command runs under: taskset when this process is pinned, else nothing."""
        cpus = self.engine if name == "engine" else self.others
        return [] if cpus is None else ["taskset", "-c", ",".join(map(str, cpus))]

    def pin_self(self, role: str) -> None:
        """Move every thread of this process onto the engine's cores or the others' (role: 'engine' or 'client')."""
        cpus = self.engine if role == "engine" else self.others
        if cpus is None:
            return
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:  # a thread that just ended
                pass

    def describe(self) -> dict:
        return {"mode": self.mode, "engine_cpus": self.engine, "client_frontend_tokenizer_cpus": self.others}


class StackProcesses:
    """The three services (or `only` those named) as child processes through tessera.launch, on free
    loopback ports, without metrics servers or HTTP API, with the engine flags of both sides
    (logs in a temp directory)."""

    def __init__(self, args: argparse.Namespace, placement: Placement | None = None,
                 only: tuple[str, ...] | None = None) -> None:
        self.placement = placement or Placement("shared")  # unpinned unless told
        engine_flags = ["--dtype", args.dtype, "--device", args.device, "--kv-cache-gib", str(args.kv_cache_gib),
                        "--max-num-seqs", str(args.max_num_seqs),
                        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                        "--block-size", str(args.block_size),
                        "--enable-prefix-caching", "false" if args.no_prefix_caching else "true"]
        if args.threads:
            engine_flags += ["--num-threads", str(args.threads)]
        model = ["--model", args.model] if args.model else []
        self.stack = launch.Stack(
            pathlib.Path(tempfile.mkdtemp(prefix="tessera-bench-")), tokenizer_args=model,
            engine_args=[*model, *engine_flags], frontend_args=["--stream-interval", str(args.stream_interval)],
            http=False, prefix={name: self.placement.prefix(name) for name in launch.SERVICE_MODULES},
            host=HOST, metrics_port=0, env={"TESSERA_EVENT_LOOP": args.event_loop})
        self.log_dir = self.stack.log_dir
        self.services = [s for s in self.stack.services if only is None or s.name in only]

    def addr(self, name: str) -> str:
        return self.stack.addr(name)

    def start(self, timeout_s: float) -> None:
        launch.start_all(self.services, timeout_s)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each service process has used so far (Linux /proc; {} elsewhere)."""
        out = {}
        for service in self.services:
            try:
                fields = pathlib.Path(f"/proc/{service.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return {}
            out[service.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return out

    def stop(self) -> None:
        launch.stop_all(self.services)


def chats(repeat: int, n: int) -> list[tokenizer_pb2.ChatMessages]:
    """The workload's chats for one repeat: its own system message, then one question each."""
    system = f"You are a helpful assistant. (benchmark run {repeat})"
    return [tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="system", content=system),
                                                 tokenizer_pb2.ChatMessage(role="user", content=q)])
            for q in questions(n)]


async def run_stack(frontend_addr: str, prompts: list[tokenizer_pb2.ChatMessages], max_tokens: int) -> dict:
    """All prompts as concurrent Generate streams; per-request first-token and finish times."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(frontend_addr, options=CHANNEL_OPTIONS) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        await channel.channel_ready()

        async def one(i: int, chat: tokenizer_pb2.ChatMessages) -> dict:
            sent = time.perf_counter()
            first = last = None
            tokens: list[int] = []
            prompt_tokens = 0
            async for response in stub.Generate(frontend_pb2.GenerateRequest(
                    request_id=f"bench-{i}", chat=chat, sampling_params=params), timeout=3600):
                now = time.perf_counter()
                if response.token_ids:
                    first = first or now
                    last = now
                    tokens.extend(response.token_ids)
                if response.HasField("usage"):
                    prompt_tokens = response.usage.prompt_tokens
            return {"sent": sent, "first": first, "last": last, "tokens": tokens, "prompt_tokens": prompt_tokens}

        with measure_usage(sample_rss=False) as usage:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(i, c) for i, c in enumerate(prompts)))
            t_end = max(r["last"] for r in results)
    return _summary(t0, t_end, [r["sent"] for r in results], [r["first"] for r in results],
                    [r["tokens"] for r in results], usage) | {
        "prompt_tokens": [r["prompt_tokens"] for r in results]}


async def run_engine_direct(engine_addr: str, prompt_ids: list[list[int]], max_tokens: int, tag: str) -> dict:
    """All prompts on one Session stream straight to the engine service (no frontend, no tokenizer)."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    n = len(prompt_ids)
    first: list[float | None] = [None] * n
    tokens: list[list[int]] = [[] for _ in range(n)]
    requests = [engine_pb2.EngineRequest(request_id=f"{tag}-{i}", prompt_token_ids=ids, sampling_params=params)
                for i, ids in enumerate(prompt_ids)]
    index = {r.request_id: i for i, r in enumerate(requests)}
    sent: list[float] = []
    with measure_usage(sample_rss=False) as usage:
        t0 = time.perf_counter()
        async for now, step in engine_session(engine_addr, requests, sent, CHANNEL_OPTIONS):
            for o in step.outputs:
                i = index[o.request_id]
                if o.new_token_ids:
                    first[i] = first[i] or now
                    tokens[i].extend(o.new_token_ids)
        t_end = time.perf_counter()
    return _summary(t0, t_end, sent, first, tokens, usage)


async def probe_both(frontend_addr: str, new_core, placement: "Placement",
                     stack_prompts: list[tokenizer_pb2.ChatMessages],
                     inprocess_ids: list[list[int]]) -> tuple[list[float], list[float]]:
    """TTFT of each prompt sent alone (max_tokens 1), one after another, the two sides
    interleaved prompt by prompt (who goes first alternates), so that the machine's drift
    hits both alike. Returns (in-process times, stack times)."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=1)
    core = new_core()
    inprocess: list[float] = []
    stack: list[float] = []

    def one_inprocess(i: int) -> float:
        t0 = time.perf_counter()
        core.add_request(EngineCoreRequest(f"p{i}", inprocess_ids[i], SamplingParams(temperature=0.0, max_tokens=1)))
        while not any(o.new_token_ids for o in core.step()):
            pass
        elapsed = time.perf_counter() - t0
        while core.has_unfinished():
            core.step()
        return elapsed

    async with grpc.aio.insecure_channel(frontend_addr, options=CHANNEL_OPTIONS) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        await channel.channel_ready()

        async def one_stack(i: int) -> float:
            t0 = time.perf_counter()
            async for response in stub.Generate(frontend_pb2.GenerateRequest(chat=stack_prompts[i],
                                                                               sampling_params=params)):
                if response.token_ids:
                    return time.perf_counter() - t0
            raise RuntimeError("the stack answered a probe without a token")

        for i in range(len(inprocess_ids)):
            for side in (("inprocess", "stack") if i % 2 == 0 else ("stack", "inprocess")):
                if side == "inprocess":
                    placement.pin_self("engine")
                    inprocess.append(one_inprocess(i))
                else:
                    placement.pin_self("client")
                    stack.append(await one_stack(i))
    return inprocess, stack


def run_inprocess(new_core, prompt_ids: list[list[int]], max_tokens: int) -> dict:
    """All prompts added to a fresh core at t0, stepped to completion (as engine_throughput does)."""
    gc.collect()
    core = new_core()
    n = len(prompt_ids)
    index = {f"r{i}": i for i in range(n)}
    added = [0.0] * n
    first: list[float | None] = [None] * n
    tokens: list[list[int]] = [[] for _ in range(n)]
    with measure_usage(sample_rss=False) as usage:
        t0 = time.perf_counter()
        for i, ids in enumerate(prompt_ids):
            core.add_request(EngineCoreRequest(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                            ignore_eos=True)))
            added[i] = time.perf_counter()
        while core.has_unfinished():
            outs = core.step()
            now = time.perf_counter()
            for o in outs:
                i = index[o.request_id]
                if o.new_token_ids:
                    first[i] = first[i] or now
                    tokens[i].extend(o.new_token_ids)
        t_end = time.perf_counter()
    del core
    gc.collect()
    return _summary(t0, t_end, added, first, tokens, usage)


def _summary(t0: float, t_end: float, sent: list[float], first: list[float | None], tokens: list[list[int]],
             usage) -> dict:
    ttft = [f - s for s, f in zip(sent, first) if f is not None]
    total = sum(len(t) for t in tokens)
    return {"output_tokens": total, "wall_s": t_end - t0, "tokens_per_s": total / (t_end - t0),
            "ttft_median_s": median(ttft), "ttft_max_s": max(ttft) if ttft else None,
            "foreign_cores": usage.foreign_cores, "own_cpu_s": usage.cpu_s, "_tokens": tokens}


class Sides:
    """The three sides over one running stack: measure each, warm them up, run the repeats and the
    isolated-request probes. `new_core` makes a fresh in-process EngineCore."""

    def __init__(self, args: argparse.Namespace, placement: Placement, stack: StackProcesses, new_core) -> None:
        self.args, self.placement, self.stack, self.new_core = args, placement, stack, new_core
        self.names = ["inprocess", "stack"] + ([] if args.no_engine_side else ["engine"])
        self.tokenizer = tokenizer_pb2_grpc.TokenizerServiceStub(grpc.insecure_channel(stack.addr("tokenizer")))

    def token_ids(self, prompts: list[tokenizer_pb2.ChatMessages]) -> list[list[int]]:
        """The tokenizer service's token ids of these chats (what the in-process and engine sides are given)."""
        return [list(self.tokenizer.Tokenize(tokenizer_pb2.TokenizeRequest(chat=c), timeout=30).token_ids)
                for c in prompts]

    def measure(self, side: str, repeat: int, prompts, ids) -> dict:
        args, stack = self.args, self.stack
        self.placement.pin_self("engine" if side == "inprocess" else "client")
        if side == "inprocess":
            return run_inprocess(self.new_core, ids, args.output_tokens)
        before = stack.cpu_seconds()
        if side == "engine":
            result = aio.run(run_engine_direct(stack.addr("engine"), ids, args.output_tokens, f"e{repeat}"),
                             args.event_loop)
        else:
            result = aio.run(run_stack(stack.addr("frontend"), prompts, args.output_tokens), args.event_loop)
            if result["prompt_tokens"] != [len(p) for p in ids]:
                raise RuntimeError("the stack saw different prompt lengths than the in-process side")
        after = stack.cpu_seconds()
        result["cpu_s"] = {"client": result["own_cpu_s"]} | {
            name: after[name] - before[name] for name in after if name in before}
        return result

    def warm_up(self) -> None:
        log("warm-up (every side) ...")
        warm = chats(-1, 8)
        self.placement.pin_self("engine")
        run_inprocess(self.new_core, self.token_ids(warm), 8)
        self.placement.pin_self("client")
        aio.run(run_stack(self.stack.addr("frontend"), warm, 8), self.args.event_loop)

    def run_repeats(self) -> tuple[dict[str, list[dict]], list[float]]:
        """--repeats rounds of every side (who goes first rotates): (runs per side, per round the
        fraction of requests whose greedy output is the same on the in-process and stack sides)."""
        args, sides = self.args, self.names
        results: dict = {side: [] for side in sides}
        matches = []
        for repeat in range(args.repeats):
            order = sides[repeat % len(sides):] + sides[:repeat % len(sides)]  # rotate who goes first
            for side in order:
                # A fresh system message for each side on the stack's engine (its prefix cache never
                # helps); the in-process side (a fresh core each time) takes the stack side's chats, so
                # that their greedy outputs compare.
                prompts = chats(repeat * 10 + (1 if side == "engine" else 0), args.num_prompts)
                ids = self.token_ids(prompts)
                wait_for_quiet(args.wait_quiet, log=log)
                result = self.measure(side, repeat, prompts, ids)
                wrong = [i for i, t in enumerate(result["_tokens"]) if len(t) != args.output_tokens]
                if wrong:
                    raise RuntimeError(f"{side}: wrong number of tokens for requests {wrong[:5]}")
                results[side].append(result)
                cpu = "".join(f" {name} {s:.2f}" for name, s in result.get("cpu_s", {}).items()
                              if side == "stack" or name in ("client", "engine"))
                log(f"  repeat {repeat} {side:9s}: {result['tokens_per_s']:8.1f} tok/s  "
                    f"TTFT median {result['ttft_median_s'] * 1000:8.1f} ms  "
                    f"(other processes: {result['foreign_cores'] or 0:.2f} cores)" + (f"  CPU s:{cpu}" if cpu else ""))
            # Greedy on the same chats: the outputs should agree, token for token (the engine's rows do
            # not depend on their batch, and the stack changes nothing of a request).
            same = sum(len(set(map(tuple, pair))) == 1 for pair in zip(
                results["inprocess"][-1]["_tokens"], results["stack"][-1]["_tokens"]))
            matches.append(same / args.num_prompts)
        return results, matches

    def probe_isolated(self) -> dict:
        """Median TTFT of --ttft-probes isolated requests per side ({} with none), after an untimed pass."""
        args = self.args
        if not args.ttft_probes:
            return {}
        wait_for_quiet(args.wait_quiet, log=log)
        for warm_up in (True, False):
            base = 900 if warm_up else 1000
            inprocess_ids = self.token_ids(chats(base, args.ttft_probes))
            times = aio.run(probe_both(self.stack.addr("frontend"), self.new_core, self.placement,
                                       chats(base + 1, args.ttft_probes), inprocess_ids), args.event_loop)
        probes = {"inprocess": median(times[0]), "stack": median(times[1])}
        for side in ("inprocess", "stack"):
            log(f"  isolated requests {side:9s}: TTFT median {probes[side] * 1000:8.1f} ms")
        return probes


def summarize_runs(sides: list[str], results: dict[str, list[dict]], probes: dict, matches: list[float]) -> dict:
    """The summary block of the results: medians per side, the ratios, TTFT added, CPU per process, targets."""
    def med(side: str, key: str) -> float:
        return median(r[key] for r in results[side])

    summary = {f"{side}_tokens_per_s": med(side, "tokens_per_s") for side in sides}
    summary |= {f"{side}_ttft_median_ms": med(side, "ttft_median_s") * 1000 for side in sides}
    summary["stack_vs_inprocess"] = summary["stack_tokens_per_s"] / summary["inprocess_tokens_per_s"]
    summary["ttft_added_ms"] = summary["stack_ttft_median_ms"] - summary["inprocess_ttft_median_ms"]
    if "engine" in sides:
        summary["engine_service_vs_inprocess"] = summary["engine_tokens_per_s"] / summary["inprocess_tokens_per_s"]
        summary["stack_vs_engine_service"] = summary["stack_tokens_per_s"] / summary["engine_tokens_per_s"]
    if probes:
        summary["isolated_ttft_inprocess_ms"] = probes["inprocess"] * 1000
        summary["isolated_ttft_stack_ms"] = probes["stack"] * 1000
        summary["isolated_ttft_added_ms"] = (probes["stack"] - probes["inprocess"]) * 1000
    for side in ("stack", "engine"):  # where the CPU went, per process (the client is this process)
        if side in sides and results[side][0].get("cpu_s"):
            summary[f"{side}_cpu_s"] = {name: median(r["cpu_s"][name] for r in results[side])
                                        for name in results[side][0]["cpu_s"]}
    summary["greedy_outputs_identical_fraction"] = median(matches)
    summary["targets"] = {k: {"target": v, "met": (summary[k] >= v if k == "stack_vs_inprocess" else summary[k] <= v)}
                          for k, v in TARGETS.items()}
    return summary


def write_results(out: pathlib.Path, args: argparse.Namespace, placement: Placement, summary: dict,
                  results: dict[str, list[dict]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("_") and k != "prompt_tokens"}  # noqa: E731
    out.write_text(json.dumps({
        "workload": {"prompts": args.num_prompts, "output_tokens": args.output_tokens, "greedy": True,
                     "ignore_eos": True, "prompt_source": "benchmarks/common.py questions, as chats with a "
                                                          "per-measurement system message"},
        "engine_flags": {k: getattr(args, k) for k in ("dtype", "device", "kv_cache_gib", "max_num_seqs",
                                                       "max_num_batched_tokens", "block_size", "threads")}
                        | {"prefix_caching": not args.no_prefix_caching},
        "stack_flags": {"stream_interval": args.stream_interval, "event_loop": args.event_loop},
        "placement": placement.describe(),
        "summary": summary,
        "runs": {side: [strip(r) for r in runs] for side, runs in results.items()},
        "environment": environment(),
    }, indent=2))


def print_report(args: argparse.Namespace, sides: list[str], summary: dict, out: pathlib.Path) -> None:
    labels = {"inprocess": "in-process engine core", "engine": "engine service alone", "stack": "three-service stack"}
    for side in sides:
        print(f"{labels[side]:23s}: {summary[side + '_tokens_per_s']:8.1f} output tok/s   "
              f"TTFT median {summary[side + '_ttft_median_ms']:8.1f} ms")
    if "engine" in sides:
        print(f"engine service / in-process: {summary['engine_service_vs_inprocess']:.3f}   "
              f"stack / engine service: {summary['stack_vs_engine_service']:.3f}")
    print(f"TTFT added by the stack ({args.num_prompts} concurrent): {summary['ttft_added_ms']:.1f} ms "
          f"(target <= {TARGETS['ttft_added_ms']:g})")
    if "isolated_ttft_added_ms" in summary:
        print(f"TTFT added by the stack (isolated requests): {summary['isolated_ttft_added_ms']:.1f} ms "
              f"({summary['isolated_ttft_inprocess_ms']:.1f} -> {summary['isolated_ttft_stack_ms']:.1f})")
    if "stack_cpu_s" in summary:
        print("CPU seconds per stack run (median): " + ", ".join(f"{name} {s:.2f}"
                                                             for name, s in summary["stack_cpu_s"].items()))
    print(f"greedy outputs identical on both sides: {summary['greedy_outputs_identical_fraction']:.0%}")
    print(f"results: {out}")
    print(f"stack_vs_inprocess={summary['stack_vs_inprocess']:.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    placement = Placement(args.placement)
    if placement.engine is not None and not args.threads:
        args.threads = len(placement.engine)  # one torch thread per engine core, on both sides
    if args.threads:
        torch.set_num_threads(args.threads)
    config = engine_config(args, device=args.device)
    log("loading the model in-process ...")
    plan, loaded = plan_backends(config)  # every engine below reuses the plan's weights
    log(f"loaded ({plan.dtype}, {plan.device})")

    def new_core() -> EngineCore:
        return EngineCore(config, loaded)

    stack = StackProcesses(args, placement)
    if placement.engine is not None:
        log(f"placement split: engines on cores {placement.engine} ({args.threads} torch threads), "
            f"client, frontend and tokenizer on {placement.others}")
    log(f"starting the stack (logs in {stack.log_dir}) ...")
    stack.start(args.startup_timeout)
    try:
        sides = Sides(args, placement, stack, new_core)
        sides.warm_up()
        results, matches = sides.run_repeats()
        probes = sides.probe_isolated()
    finally:
        stack.stop()
    summary = summarize_runs(sides.names, results, probes, matches)
    out = pathlib.Path(args.out)
    write_results(out, args, placement, summary, results)
    print_report(args, sides.names, summary, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
