"""Several engine replicas behind one frontend: load spread, prefix affinity, failover, DNS discovery.

Two real engine processes: the shared stack's engine A (127.0.0.1:P) and a second
engine B started here on the same port of another loopback address (127.0.0.2:P),
so that one name resolving to both addresses stands for a Kubernetes headless
service. A dedicated frontend process is given both addresses; which replica served
a request is read from its "request submitted" log lines (field `engine`).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2

from helpers.metrics_util import json_lines
from helpers.stack import STARTUP_TIMEOUT_S, Service, all_serving, frontend_service, health_status, stack  # noqa: F401
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2
from tessera_frontend.async_llm import AsyncLLM
from tessera_frontend.engine_client import EngineCoreClient
from tessera_frontend.tokenizer_client import TokenizerClient

pytestmark = pytest.mark.integration

B_HOST = "127.0.0.2"
TOPICS = ["rivers", "volcanoes", "owls", "bridges", "tea", "comets", "glaciers", "violins",
          "deserts", "coral", "trains", "honey"]
LONG_CONTEXT = " ".join(f"Fact {i}: the archive keeps record number {i * 37} on shelf {i % 9}." for i in range(30))


@pytest.fixture(scope="module")
def replicas(stack):
    """(engine A, engine B, frontend over both, its stub); B is stopped at the end.

    B runs one compute thread. Each engine takes every core by default, and two of them on
    the machine's cores, both decoding, oversubscribe it: OpenMP threads spin at each parallel
    region's barrier for a partner the other engine has descheduled. In a full run this once
    took 30 s for 40 tokens, past B's drain timeout (two replicas on one host are given a share
    of the cores each, as a user running them so would do)."""
    engine_b = Service("engine-b", "tessera_engine", stack.engine.port,
                       list(stack.engine.args) + ["--num-threads", "1"], stack.log_dir / "engine-b.log", host=B_HOST)
    frontend = frontend_service("frontend-replicas", stack.tokenizer.addr,
                                f"{stack.engine.addr},{engine_b.addr}", stack.log_dir, "--engine-timeout-s", "3")
    with all_serving(engine_b, frontend), grpc.insecure_channel(frontend.addr) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        _wait_both_used(stub, frontend, stack.engine.addr, engine_b.addr)
        yield stack.engine, engine_b, frontend, stub


def _request(text: str, request_id: str, max_tokens: int = 6) -> frontend_pb2.GenerateRequest:
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=text)])
    return frontend_pb2.GenerateRequest(
        request_id=request_id, chat=chat,
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens))


def _served_by(frontend: Service, prefix: str) -> dict[str, str]:
    """request id -> engine address, for the frontend's requests whose id starts with `prefix`."""
    return {entry["request_id"]: entry["engine"] for entry in json_lines(frontend.log_path)
            if entry.get("msg") == "request submitted" and str(entry.get("request_id", "")).startswith(prefix)}


def _run_concurrently(stub, texts: list[str], prefix: str, max_tokens: int = 6) -> list[frontend_pb2.GenerateResult]:
    futures = [stub.Complete.future(_request(t, f"{prefix}{i}", max_tokens), timeout=120)
               for i, t in enumerate(texts)]
    return [f.result() for f in futures]


def _wait_both_used(stub, frontend: Service, addr_a: str, addr_b: str, seconds: float = 60) -> None:
    """Send concurrent batches until each replica has served one (both sessions are open)."""
    deadline = time.monotonic() + seconds
    while True:
        prefix = f"warm-{uuid.uuid4().hex[:6]}-"
        _run_concurrently(stub, [f"Say one word about {t}." for t in TOPICS[:4]], prefix, max_tokens=2)
        if {addr_a, addr_b} <= set(_served_by(frontend, prefix).values()):
            return
        assert time.monotonic() < deadline, f"a replica was never used:\n{frontend.log_tail()}"
        time.sleep(0.5)


def test_concurrent_requests_spread_across_replicas(replicas):
    engine_a, engine_b, frontend, stub = replicas
    results = _run_concurrently(stub, [f"Tell me one fact about {t}." for t in TOPICS[:8]], "spread-")
    assert all(r.usage.completion_tokens == 6 for r in results)
    served = _served_by(frontend, "spread-")
    assert len(served) == 8
    counts = {addr: list(served.values()).count(addr) for addr in (engine_a.addr, engine_b.addr)}
    assert min(counts.values()) >= 2, counts


def test_same_prefix_goes_to_the_same_replica(replicas):
    _, _, frontend, stub = replicas
    results = []
    for i in range(4):  # one after another: no load to balance, only the prefix
        results.append(stub.Complete(_request(f"{LONG_CONTEXT}\nWhich shelf holds record {37 * (i + 3)}?",
                                              f"affinity-{i}"), timeout=120))
    served = _served_by(frontend, "affinity-")
    assert len(set(served.values())) == 1, served
    # The repeats hit that replica's prefix cache.
    assert all(r.usage.cached_prompt_tokens > 0 for r in results[1:]), [r.usage for r in results]

    # A follow-up turn (the conversation so far + a new message) follows it too.
    chat = tokenizer_pb2.ChatMessages(messages=[
        tokenizer_pb2.ChatMessage(role="user", content=f"{LONG_CONTEXT}\nWhich shelf holds record 111?"),
        tokenizer_pb2.ChatMessage(role="assistant", content=results[0].choices[0].text),
        tokenizer_pb2.ChatMessage(role="user", content="And record 148?")])
    stub.Complete(frontend_pb2.GenerateRequest(request_id="affinity-turn2", chat=chat,
                                               sampling_params=common_pb2.SamplingParams(max_tokens=4)),
                  timeout=120)
    assert _served_by(frontend, "affinity-turn2")["affinity-turn2"] == next(iter(served.values()))


def test_one_name_resolving_to_both_engines(replicas, stack):
    """The frontend's engine client given one DNS name that resolves to both engines' addresses
    (the resolver is the only stand-in: the engines and the tokenizer are the real processes)."""
    engine_a, engine_b, _, _ = replicas
    port = engine_a.port
    answer = [f"127.0.0.1:{port}", f"{B_HOST}:{port}"]

    async def resolver(host: str, p: int) -> list[str]:
        assert (host, p) == ("engines.headless.test", port)
        return list(answer)

    async def scenario() -> None:
        engine = EngineCoreClient(f"engines.headless.test:{port}", resolver=resolver, resolve_interval_s=3600)
        llm = AsyncLLM(TokenizerClient(stack.tokenizer.addr), engine)
        llm.start()
        try:
            await llm.tokenizer.fetch_model_info()
            deadline = time.monotonic() + 60
            while not all(r.connected for r in engine.replicas) or len(engine.replicas) < 2:
                assert time.monotonic() < deadline, [(r.addr, r.connected) for r in engine.replicas]
                await asyncio.sleep(0.1)
            assert sorted(r.addr for r in engine.replicas) == sorted(answer)

            async def one(i: int) -> int:
                prompt = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(
                    role="user", content=f"Name a color of {TOPICS[i]}.")])
                params = common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
                return sum([len(o.token_ids) async for o in llm.generate(f"dns-{i}", prompt, params)])

            tasks = [asyncio.create_task(one(i)) for i in range(4)]
            await asyncio.sleep(0)  # let them submit
            while not all(r.outstanding for r in engine.replicas):
                assert not all(t.done() for t in tasks), "the requests did not use both replicas"
                await asyncio.sleep(0.01)
            assert await asyncio.gather(*tasks) == [8, 8, 8, 8]

            answer.remove(f"{B_HOST}:{port}")  # the pod left the headless service
            await engine.refresh()
            assert [r.addr for r in engine.replicas] == [f"127.0.0.1:{port}"]
            answer.append(f"{B_HOST}:{port}")  # and came back
            await engine.refresh()
            assert len(engine.replicas) == 2
        finally:
            await llm.close()

    asyncio.run(scenario())


def _long_request(text: str, request_id: str, max_tokens: int) -> frontend_pb2.GenerateRequest:
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=text)])
    return frontend_pb2.GenerateRequest(request_id=request_id, chat=chat, sampling_params=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def test_sigterm_drains_a_replica_without_failing_a_request(replicas):
    """SIGTERM on engine B under load: B turns NOT_SERVING and hands its requests off (the default
    --drain-mode handoff): they move to A and continue there, B exits 0 at once instead of
    running them out; not one request fails, and requests sent during B's drain are served by A."""
    engine_a, engine_b, frontend, stub = replicas
    # long enough that B is still draining when the health check looks (one-thread B decodes
    # 40 tokens in under a second: it had exited before the check could see NOT_SERVING)
    n = 200
    running = [stub.Generate(_long_request(f"Write a long story about {t}.", f"drain-{i}", n), timeout=180)
               for i, t in enumerate(TOPICS[:8])]
    tokens = {i: 0 for i in range(len(running))}
    for i, call in enumerate(running):  # every request has started (a first token came back)
        tokens[i] += len(next(call).token_ids)
    on_b = [rid for rid, addr in _served_by(frontend, "drain-").items() if addr == engine_b.addr]
    assert on_b, "no request ran on the replica to be drained"

    engine_b.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    with grpc.insecure_channel(engine_b.addr) as channel:  # NOT_SERVING at once
        deadline = time.monotonic() + 5
        while health_status(channel) == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "the draining engine still says SERVING"
            time.sleep(0.05)
    during = _run_concurrently(stub, [f"Name a color of {t}." for t in TOPICS[8:12]], "during-drain-", max_tokens=6)
    for i, call in enumerate(running):
        for response in call:
            tokens[i] += len(response.token_ids)
    assert tokens == {i: n for i in range(len(running))}, tokens
    assert all(r.usage.completion_tokens == 6 for r in during)
    # every request sent during the drain ended on A (one refused by B was retried there)
    final = {}
    for entry in json_lines(frontend.log_path):
        if entry.get("msg") == "request submitted" and str(entry.get("request_id", "")).startswith("during-drain-"):
            final[entry["request_id"]] = entry["engine"]
    assert set(final.values()) == {engine_a.addr}, final
    assert engine_b.process.wait(60) == 0, engine_b.log_tail()
    assert time.monotonic() - signalled < 20  # handed off, not run out (B alone needs ~n/20 s a request)
    drained = [e for e in json_lines(engine_b.log_path) if e.get("msg") in ("drained", "drain timed out; aborting the requests still running")]
    assert drained and drained[-1]["msg"] == "drained", engine_b.log_tail()
    moved = {e["request_id"]: e for e in json_lines(frontend.log_path) if e.get("msg") == "request migrated"
             and str(e.get("request_id", "")).startswith("drain-")}
    assert set(moved) == set(on_b) and all(e["why"] == "handoff" and e["to"] == engine_a.addr
                                           for e in moved.values()), moved

    engine_b.start()
    engine_b.wait_serving(time.monotonic() + STARTUP_TIMEOUT_S)
    _wait_both_used(stub, frontend, engine_a.addr, engine_b.addr, seconds=60)


def test_a_replica_that_stops_answering_is_broken_off(replicas):
    """SIGSTOP on engine B (hung: its connection stays open) with requests running there: with
    --engine-timeout-s 3 its session is broken off within seconds and those requests continue on
    A instead of hanging; the frontend stays SERVING and sends new requests to A; after SIGCONT,
    B is used again."""
    engine_a, engine_b, frontend, stub = replicas
    calls = {}
    for i, t in enumerate(TOPICS[:4]):
        calls[f"stall-{i}"] = stub.Generate(_long_request(f"Write a long story about {t}.", f"stall-{i}", 400),
                                            timeout=180)
    tokens = {rid: len(next(call).token_ids) for rid, call in calls.items()}
    on_b = [rid for rid, addr in _served_by(frontend, "stall-").items() if addr == engine_b.addr]
    assert on_b, "no request ran on the replica to be stopped"

    os.kill(engine_b.process.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        while not any(e.get("msg") == "request migrated" for e in json_lines(frontend.log_path)
                      if e.get("request_id") == on_b[0]):
            assert time.monotonic() - stopped < 20, frontend.log_tail()
            time.sleep(0.1)
        results = _run_concurrently(stub, [f"Name a color of {t}." for t in TOPICS[4:8]], "stall-after-")
        assert all(r.usage.completion_tokens == 6 for r in results)
        assert set(_served_by(frontend, "stall-after-").values()) == {engine_a.addr}
        with grpc.insecure_channel(frontend.addr) as channel:
            assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        for rid, call in calls.items():  # every request runs to its end, B's on A
            tokens[rid] += sum(len(r.token_ids) for r in call)
        assert tokens == {rid: 400 for rid in calls}, tokens
    finally:
        os.kill(engine_b.process.pid, signal.SIGCONT)
    moved = [e for e in json_lines(frontend.log_path) if e.get("msg") == "request migrated"
             and str(e.get("request_id", "")).startswith("stall-")]
    assert sorted(e["request_id"] for e in moved) == sorted(on_b)
    assert all(e["from"] == engine_b.addr and e["to"] == engine_a.addr and "stopped answering" in e["reason"]
               for e in moved), moved
    _wait_both_used(stub, frontend, engine_a.addr, engine_b.addr, seconds=60)


def _mixed_request(i: int, text: str, request_id: str, max_tokens: int) -> frontend_pb2.GenerateRequest:
    """Greedy for even i, seeded sampling for odd i."""
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=text)])
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if i % 2:
        params.temperature, params.top_p, params.seed = 0.9, 0.95, 1000 + i
    return frontend_pb2.GenerateRequest(request_id=request_id, chat=chat, sampling_params=params)


def test_requests_of_a_killed_replica_continue_exactly_on_the_other(replicas):
    """SIGKILL on engine B mid-answer: B's streams, greedy and seeded alike, carry on from A with no
    error, no token repeated or missing, and the text an undisturbed run gives."""
    engine_a, engine_b, frontend, stub = replicas
    texts = [f"Write a long story about {t}." for t in TOPICS[:8]]
    n = 60
    reference = [stub.Complete.future(_mixed_request(i, t, f"undisturbed-{i}", n), timeout=180)
                 for i, t in enumerate(texts)]
    reference = [f.result().choices[0].text for f in reference]

    calls = [stub.Generate(_mixed_request(i, t, f"killed-{i}", n), timeout=180) for i, t in enumerate(texts)]
    got = [[] for _ in calls]
    for i, call in enumerate(calls):  # every stream has begun
        got[i].append(next(call))
    on_b = [rid for rid, addr in _served_by(frontend, "killed-").items() if addr == engine_b.addr]
    assert on_b, "no request ran on the replica to be killed"
    engine_b.kill()
    for i, call in enumerate(calls):
        got[i] += list(call)
    for i, responses in enumerate(got):
        assert sum(len(r.token_ids) for r in responses) == n
        assert responses[-1].usage.completion_tokens == n
        assert "".join(r.text for r in responses) == reference[i], (i, f"killed-{i}" in on_b)
    moved = {e["request_id"] for e in json_lines(frontend.log_path) if e.get("msg") == "request migrated"
             and str(e.get("request_id", "")).startswith("killed-")}
    assert moved == set(on_b)

    engine_b.start()
    engine_b.wait_serving(time.monotonic() + STARTUP_TIMEOUT_S)
    _wait_both_used(stub, frontend, engine_a.addr, engine_b.addr, seconds=60)


def test_requests_not_started_on_a_replica_that_dies_complete_on_the_other(replicas):
    """B is frozen (SIGSTOP) so that what is sent to it cannot start, requests are sent, then B
    dies (SIGKILL): every request completes, those B had migrate to A."""
    engine_a, engine_b, frontend, stub = replicas
    os.kill(engine_b.process.pid, signal.SIGSTOP)
    futures = [stub.Complete.future(_long_request(f"Name a color of {t}.", f"unstarted-{i}", 8), timeout=120)
               for i, t in enumerate(TOPICS[:8])]
    deadline = time.monotonic() + 10
    while len(_served_by(frontend, "unstarted-")) < 8:
        assert time.monotonic() < deadline, frontend.log_tail()
        time.sleep(0.05)
    first_tries = [e for e in json_lines(frontend.log_path)
                   if e.get("msg") == "request submitted" and str(e.get("request_id", "")).startswith("unstarted-")]
    on_b = {e["request_id"] for e in first_tries if e["engine"] == engine_b.addr}
    assert on_b, "no request went to the frozen replica"
    engine_b.kill()
    results = [f.result() for f in futures]
    assert all(r.usage.completion_tokens == 8 for r in results)
    moved = {e["request_id"]: e["to"] for e in json_lines(frontend.log_path) if e.get("msg") == "request migrated"
             and str(e.get("request_id", "")).startswith("unstarted-")}
    assert moved == {rid: engine_a.addr for rid in on_b}, moved

    engine_b.start()
    engine_b.wait_serving(time.monotonic() + STARTUP_TIMEOUT_S)
    _wait_both_used(stub, frontend, engine_a.addr, engine_b.addr, seconds=60)


def test_killed_replica_is_skipped_and_used_again_after_restart(replicas):
    engine_a, engine_b, frontend, stub = replicas
    engine_b.kill()
    time.sleep(1.0)  # the frontend sees B's session break at once; leave it a moment
    results = _run_concurrently(stub, [f"Tell me one fact about {t}." for t in TOPICS[:6]], "after-kill-")
    assert all(r.usage.completion_tokens == 6 for r in results)
    assert set(_served_by(frontend, "after-kill-").values()) == {engine_a.addr}
    with grpc.insecure_channel(frontend.addr) as channel:
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING

    engine_b.start()
    engine_b.wait_serving(time.monotonic() + STARTUP_TIMEOUT_S)
    _wait_both_used(stub, frontend, engine_a.addr, engine_b.addr, seconds=60)
