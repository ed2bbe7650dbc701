#!/usr/bin/env python
"""Per-prompt cost of tokenizing through the tokenizer service: the frontend's TokenizeStream
client against one unary Tokenize call per prompt.

A benchmark, not a test. The tokenizer service runs as its own process (python -m
tessera_tokenizer on a free loopback port). Each round sends the 64 chat prompts of
benchmarks/common.py concurrently (as 64 requests arriving together at a frontend would),
--rounds rounds per measurement, sides alternating:

  unary   one TokenizeService/Tokenize call per prompt (grpc.aio): the baseline.
  stream  tessera_frontend.tokenizer_client.TokenizerClient.tokenize(): every prompt an
          item on the one TokenizeStream call (prompts queued together go as one message).

Both sides must return the same token ids for every prompt. Per side: the tokenizer
process's CPU time per prompt, this (client) process's CPU time per prompt, and wall time
per prompt; medians over --repeats. On a 2-core machine the client and the service share
the cores, so CPU per prompt is the figure that holds up; it is what a burst of requests
costs the cores the engine also runs on.

  python benchmarks/tokenize_overhead.py                # 5 repeats x 20 rounds x 64 prompts
Prints a line per side, saves results/tokenize_overhead.json (--out), and ends with
`stream_vs_unary_cpu=<tokenizer CPU per prompt, stream / unary>`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stack_overhead  # noqa: E402
from common import environment, log, measure_usage, questions  # noqa: E402
from stack_overhead import HOST, StackProcesses  # noqa: E402

from tessera.bench.metrics import median  # noqa: E402
from tessera.common import aio  # noqa: E402
from tessera.v1 import tokenizer_pb2  # noqa: E402
from tessera_frontend.tokenizer_client import TokenizerClient  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=20, help="bursts of --prompts concurrent prompts per measurement")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--event-loop", default="auto", choices=aio.EVENT_LOOPS)
    ap.add_argument("--out", default=str(REPO / "results" / "tokenize_overhead.json"))
    return ap.parse_args(argv)


async def measure(args: argparse.Namespace, tokenizer_service: StackProcesses) -> dict:
    client = TokenizerClient(tokenizer_service.addr("tokenizer"))
    client.start()
    deadline = time.monotonic() + 60
    while not client.connected:
        if time.monotonic() > deadline:
            raise RuntimeError("the tokenize stream did not open")
        await asyncio.sleep(0.05)
    requests = [tokenizer_pb2.TokenizeRequest(chat=tokenizer_pb2.ChatMessages(messages=[
        tokenizer_pb2.ChatMessage(role="system", content="You are a helpful assistant."),
        tokenizer_pb2.ChatMessage(role="user", content=q)]), add_generation_prompt=True)
        for q in questions(args.prompts)]

    async def unary(i: int) -> list[int]:
        await asyncio.sleep(0)  # each request's own turn of the loop, as separate calls arrive
        return list((await client.stub.Tokenize(requests[i], timeout=30)).token_ids)

    async def stream(i: int) -> list[int]:
        await asyncio.sleep(0)
        return list((await client.tokenize(requests[i], f"bench-{i}")).token_ids)

    sides = {"unary": unary, "stream": stream}
    expected = await asyncio.gather(*(unary(i) for i in range(args.prompts)))
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    n = args.rounds * args.prompts
    try:
        for repeat in range(args.repeats):
            order = list(sides) if repeat % 2 == 0 else list(sides)[::-1]
            for side in order:
                fn = sides[side]
                await asyncio.gather(*(fn(i) for i in range(args.prompts)))  # warm
                server0 = tokenizer_service.cpu_seconds()["tokenizer"]
                with measure_usage(sample_rss=False) as usage:
                    for _ in range(args.rounds):
                        got = await asyncio.gather(*(fn(i) for i in range(args.prompts)))
                        if got != expected:
                            raise RuntimeError(f"{side}: token ids differ from the unary answer")
                run = {"tokenizer_cpu_ms_per_prompt": (tokenizer_service.cpu_seconds()["tokenizer"] - server0) / n * 1e3,
                       "client_cpu_ms_per_prompt": usage.cpu_s / n * 1e3,
                       "wall_ms_per_prompt": usage.wall_s / n * 1e3}
                runs[side].append(run)
                log(f"  repeat {repeat} {side:6s}: tokenizer {run['tokenizer_cpu_ms_per_prompt']:.3f} ms CPU, "
                    f"client {run['client_cpu_ms_per_prompt']:.3f} ms CPU, wall {run['wall_ms_per_prompt']:.3f} ms "
                    "per prompt")
    finally:
        await client.close()
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    service = StackProcesses(stack_overhead.parse_args(["--event-loop", args.event_loop]), only=("tokenizer",))
    service.start(120)
    try:
        runs = aio.run(measure(args, service), args.event_loop)
    finally:
        service.stop()
    summary = {side: {key: median(r[key] for r in side_runs) for key in side_runs[0]}
               for side, side_runs in runs.items()}
    for key in ("tokenizer_cpu_ms_per_prompt", "client_cpu_ms_per_prompt", "wall_ms_per_prompt"):
        summary[f"stream_vs_unary_{key.split('_ms')[0]}"] = summary["stream"][key] / summary["unary"][key]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workload": {"prompts": args.prompts, "rounds": args.rounds, "host": HOST},
                               "summary": summary, "runs": runs, "environment": environment()}, indent=2))
    for side in ("unary", "stream"):
        s = summary[side]
        print(f"{side:6s}: tokenizer {s['tokenizer_cpu_ms_per_prompt']:.3f} ms CPU, client "
              f"{s['client_cpu_ms_per_prompt']:.3f} ms CPU, wall {s['wall_ms_per_prompt']:.3f} ms per prompt")
    print(f"client CPU stream/unary: {summary['stream_vs_unary_client_cpu']:.3f}   "
          f"wall stream/unary: {summary['stream_vs_unary_wall']:.3f}")
    print(f"results: {out}")
    print(f"stream_vs_unary_cpu={summary['stream_vs_unary_tokenizer_cpu']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
