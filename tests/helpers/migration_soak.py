#!/usr/bin/env python
"""Migration soak: engine replicas killed (or drained) under streaming load; every stream ends
as it would have without them.

The same set of requests runs twice through one frontend over several engine replicas: once
undisturbed (the reference), once while a disturber either SIGKILLs an engine and restarts it
every ~`every_s` seconds (`kill`) or drains the engines one after another with SIGTERM and
restarts each (`rolling`, as a rolling update does). Requests are greedy and seeded sampled,
mixed; some are constrained by a JSON schema; in the disturbed run 10% are cancelled by the
client mid-stream. What must hold, and is reported:

- no client error, no request past its deadline (a hang);
- every completed request's text, token count and finish reason equal to the reference's
  (the engines are batch-invariant and draw from (seed, sample, position), so a migrated
  request continues exactly);
- afterwards every engine idle with every KV block free.

    .venv/bin/python tests/helpers/migration_soak.py                   # the full soak (issue 34's figures)
    .venv/bin/python tests/helpers/migration_soak.py --requests 200 --concurrency 32 --modes kill

tests/stack/test_migration_soak.py runs a short version in `make test`.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import json
import pathlib
import random
import signal
import sys
import tempfile
import time

import grpc

from tessera import launch
from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

TOPICS = ["rain", "salt", "maps", "bees", "iron", "jazz", "moss", "kites", "tides", "clay", "owls", "wheat"]
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"]})
STARTUP_S = 180.0


@dataclasses.dataclass
class Spec:
    i: int
    text: str
    max_tokens: int
    sampled: bool
    schema: bool
    cancel_after: int | None  # messages after which the client cancels (disturbed run only)

    def request(self, tag: str) -> frontend_pb2.GenerateRequest:
        params = common_pb2.SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=not self.schema)
        if self.sampled:
            params.temperature, params.top_p, params.seed = 0.8, 0.95, 7000 + self.i
        if self.schema:
            params.structured_output.json_schema = SCHEMA
        chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=self.text)])
        return frontend_pb2.GenerateRequest(request_id=f"{tag}-{self.i}", chat=chat, sampling_params=params)


@dataclasses.dataclass
class Outcome:
    status: str                 # complete, cancelled, or a gRPC status name (DEADLINE_EXCEEDED: hung)
    text: str = ""
    tokens: int = 0
    finish_reason: int = 0
    details: str = ""


def make_specs(n: int, seed: int, max_tokens: tuple[int, int], cancel_fraction: float = 0.1,
               schema_every: int = 10) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        text = (f"In about {rng.randint(10, 30)} words, tell me how {rng.choice(TOPICS)} and "
                f"{rng.choice(TOPICS)} are alike. ({i})")
        schema = i % schema_every == 3
        if schema:
            text = f"Invent a person who likes {rng.choice(TOPICS)}; answer as JSON with name and age. ({i})"
        cancel = rng.randint(1, 4) if rng.random() < cancel_fraction else None
        specs.append(Spec(i, text, rng.randint(*max_tokens), sampled=i % 2 == 1, schema=schema, cancel_after=cancel))
    return specs


async def _one(stub, spec: Spec, tag: str, cancels: bool, deadline_s: float, gate: asyncio.Semaphore) -> Outcome:
    async with gate:
        call = stub.Generate(spec.request(tag), timeout=deadline_s)
        out = Outcome("incomplete")
        messages = 0
        try:
            async for response in call:
                messages += 1
                out.text += response.text
                out.tokens += len(response.token_ids)
                if response.finish_reason:
                    out.finish_reason = response.finish_reason
                if cancels and spec.cancel_after is not None and messages >= spec.cancel_after:
                    call.cancel()
            out.status = "complete" if out.finish_reason else "incomplete"
        except asyncio.CancelledError:
            out.status = "cancelled"
        except grpc.aio.AioRpcError as exc:
            out.status, out.details = exc.code().name, exc.details() or ""
        return out


async def run_load(frontend_addr: str, specs: list[Spec], tag: str, concurrency: int, cancels: bool,
                   deadline_s: float = 300.0) -> dict[int, Outcome]:
    async with grpc.aio.insecure_channel(frontend_addr, options=CHANNEL_OPTIONS) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        gate = asyncio.Semaphore(concurrency)
        outs = await asyncio.gather(*(_one(stub, s, tag, cancels, deadline_s, gate) for s in specs))
    return {s.i: o for s, o in zip(specs, outs)}


async def _restart(engine: launch.Service) -> float:
    """Start a stopped engine again and wait until it serves; the seconds it took."""
    loop = asyncio.get_running_loop()
    t = time.monotonic()
    await loop.run_in_executor(None, engine.start)
    await loop.run_in_executor(None, engine.wait_serving, time.monotonic() + STARTUP_S, STARTUP_S)
    return time.monotonic() - t


async def disturb(engines: list[launch.Service], mode: str, every_s: float, done: asyncio.Event,
                  events: list[dict]) -> None:
    """Until `done`: kill: every ~every_s seconds SIGKILL the next engine that is up and restart
    it in the background (never the last one serving); rolling: SIGTERM each engine in turn,
    wait for its exit (its drain), restart it and wait until it serves, then every_s more."""
    rng = random.Random(99)
    restarting: dict[str, asyncio.Task] = {}

    async def restart(engine, event) -> None:
        event["restart_s"] = round(await _restart(engine), 2)

    for engine in itertools.cycle(engines):
        try:
            await asyncio.wait_for(done.wait(), every_s * (rng.uniform(0.75, 1.25) if mode == "kill" else 1.0))
            break
        except asyncio.TimeoutError:
            pass
        t = time.monotonic()
        if mode == "kill":
            up = [e for e in engines if e.name not in restarting or restarting[e.name].done()]
            if engine not in up or len(up) < 2:
                continue
            engine.kill()
            events.append({"event": "SIGKILL", "engine": engine.name, "at": round(t, 2)})
            restarting[engine.name] = asyncio.create_task(restart(engine, events[-1]))
        else:
            engine.process.send_signal(signal.SIGTERM)
            code = await asyncio.get_running_loop().run_in_executor(None, engine.process.wait, 120)
            events.append({"event": "SIGTERM", "engine": engine.name, "at": round(t, 2), "exit": code,
                           "drain_s": round(time.monotonic() - t, 2)})
            await restart(engine, events[-1])
    await asyncio.gather(*restarting.values())


def engine_states(engines: list[launch.Service], seconds: float = 60.0) -> dict[str, dict]:
    """Each engine's running / waiting / free blocks once idle (or after `seconds`)."""
    states = {}
    for engine in engines:
        with grpc.insecure_channel(engine.addr) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            deadline = time.monotonic() + seconds
            while True:
                s = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10)
                idle = s.num_running == 0 and s.num_waiting == 0 and s.num_blocks_free == s.num_blocks_total
                if idle or time.monotonic() > deadline:
                    states[engine.name] = {"idle": idle, "running": s.num_running, "waiting": s.num_waiting,
                                           "blocks_free": s.num_blocks_free, "blocks": s.num_blocks_total}
                    break
                time.sleep(0.2)
    return states


def migrations(frontend: launch.Service, tag: str) -> list[dict]:
    lines = []
    for line in frontend.log_path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("msg") == "request migrated" and str(entry.get("request_id", "")).startswith(tag + "-"):
            lines.append(entry)
    return lines


async def soak(frontend: launch.Service, engines: list[launch.Service], specs: list[Spec], mode: str,
               every_s: float, concurrency: int, reference: dict[int, Outcome]) -> dict:
    """One disturbed run against the reference; the report (see the module doc)."""
    tag = f"soak-{mode}-{int(time.time())}"
    done, events = asyncio.Event(), []
    t = time.monotonic()
    disturber = asyncio.create_task(disturb(engines, mode, every_s, done, events))
    outcomes = await run_load(frontend.addr, specs, tag, concurrency, cancels=True)
    seconds = time.monotonic() - t
    done.set()
    await disturber
    counts = collections.Counter(o.status for o in outcomes.values())
    errors = {i: (o.status, o.details) for i, o in outcomes.items() if o.status not in ("complete", "cancelled")}
    differ = {}
    for s in specs:
        got, ref = outcomes[s.i], reference[s.i]
        if got.status == "complete" and (got.text, got.tokens, got.finish_reason) != (ref.text, ref.tokens,
                                                                                        ref.finish_reason):
            differ[s.i] = {"sampled": s.sampled, "schema": s.schema, "tokens": (got.tokens, ref.tokens),
                           "got": got.text[:80], "want": ref.text[:80]}
    moved = migrations(frontend, tag)
    return {"mode": mode, "requests": len(specs), "seconds": round(seconds, 1), "outcomes": dict(counts),
            "errors": errors, "hung": sum(o.status == "DEADLINE_EXCEEDED" for o in outcomes.values()),
            "differ": differ, "compared": sum(o.status == "complete" for o in outcomes.values()),
            "events": events, "migrations": len(moved),
            "migrated_requests": len({m["request_id"] for m in moved}),
            "engines_after": engine_states(engines)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--every-s", type=float, default=20.0, help="kill: seconds between kills (jittered); "
                   "rolling: seconds between one engine serving again and the next SIGTERM")
    p.add_argument("--modes", default="kill,rolling")
    p.add_argument("--max-tokens", default="16,96", help="range of max_tokens, drawn per request")
    p.add_argument("--engine-threads", type=int, default=1,
                   help="compute threads per engine (several engines share the machine's cores)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    lo, hi = (int(x) for x in args.max_tokens.split(","))
    specs = make_specs(args.requests, args.seed, (lo, hi))
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="tessera-migration-soak-"))
    # no metrics ports (several engines on one host); engines outlive the thread that restarts them
    tokenizer = launch.Service("tokenizer", "tessera_tokenizer", launch.free_port(), [], log_dir / "tokenizer.log",
                               metrics_port=0)
    engines = [launch.Service(f"engine-{k}", "tessera_engine", launch.free_port(),
                              ["--num-threads", str(args.engine_threads)], log_dir / f"engine-{k}.log",
                              metrics_port=0, die_with_parent=False)
               for k in range(args.engines)]
    frontend = launch.frontend_service("frontend", tokenizer.addr, ",".join(e.addr for e in engines), log_dir,
                                       metrics_port=0)
    services = [tokenizer, *engines, frontend]
    print(f"logs in {log_dir}", file=sys.stderr)
    try:
        launch.start_all(services, STARTUP_S)
        t = time.monotonic()
        reference = asyncio.run(run_load(frontend.addr, specs, "reference", args.concurrency, cancels=False))
        report = {"reference_s": round(time.monotonic() - t, 1),
                  "reference_outcomes": dict(collections.Counter(o.status for o in reference.values())), "runs": []}
        print(json.dumps(report), flush=True)
        for mode in args.modes.split(","):
            run = asyncio.run(soak(frontend, engines, specs, mode, args.every_s, args.concurrency, reference))
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
    finally:
        launch.stop_all(services)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    ok = all(not r["errors"] and not r["hung"] and not r["differ"]
             and all(e["idle"] for e in r["engines_after"].values()) for r in report["runs"])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
