"""Soak: 1,000 short requests at concurrency 64 through the shared stack's frontend (gRPC),
10% cancelled by the client at random points, the tokenizer killed and restarted once
mid-run. Every request ends, within its deadline, with its full output or a clear status
(UNAVAILABLE while the tokenizer is down, CANCELLED where the client cancelled); afterwards
the engine has nothing running or waiting and every KV block free, and the stack serves."""
from __future__ import annotations

import asyncio
import collections
import random
import time

import grpc
import pytest

from helpers.stack import STARTUP_TIMEOUT_S, health_status, stack, wait_engine_idle  # noqa: F401
from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_REQUESTS = 1000
CONCURRENCY = 64
CANCEL_FRACTION = 0.1
RESTART_AFTER = 300       # requests ended before the tokenizer is killed and restarted
REQUEST_DEADLINE_S = 180  # no request may take longer: a hang fails the test
TOPICS = ["rain", "salt", "maps", "bees", "iron", "jazz", "moss", "kites", "tides", "clay", "owls", "wheat"]


def _request(i: int, rng: random.Random) -> tuple[frontend_pb2.GenerateRequest, int]:
    max_tokens = rng.randint(1, 12)
    params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if rng.random() < 0.5:
        params.temperature = 0.0
    else:
        params.temperature, params.seed = 0.8, i
    text = f"In {rng.randint(3, 9)} words, what do {rng.choice(TOPICS)} and {rng.choice(TOPICS)} share? ({i})"
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=text)])
    return frontend_pb2.GenerateRequest(request_id=f"soak-{i}", chat=chat, sampling_params=params), max_tokens


async def _one(stub, i: int, rng: random.Random, gate: asyncio.Semaphore, outcomes: dict, ended: list) -> None:
    request, max_tokens = _request(i, rng)
    cancel_after = rng.randint(0, 3) if rng.random() < CANCEL_FRACTION else None
    async with gate:
        call = stub.Generate(request, timeout=REQUEST_DEADLINE_S)
        tokens = messages = 0
        finished = usage = None
        try:
            async for response in call:
                messages += 1
                tokens += len(response.token_ids)
                if response.finish_reason:
                    finished = response.finish_reason
                if response.HasField("usage"):
                    usage = response.usage.completion_tokens
                if cancel_after is not None and messages > cancel_after:
                    call.cancel()
            if finished is None:
                outcomes[i] = ("incomplete", f"{tokens} tokens, no finish reason")
            elif tokens == max_tokens == usage:
                outcomes[i] = ("complete", None)
            else:
                outcomes[i] = ("wrong", f"{tokens} tokens, usage {usage}, wanted {max_tokens}")
        except asyncio.CancelledError:  # grpc.aio's way of ending a call this client cancelled
            outcomes[i] = ("cancelled", None)
        except grpc.aio.AioRpcError as exc:
            outcomes[i] = (exc.code().name, exc.details())
        ended.append(i)


async def _restart_tokenizer_when(stack, ended: list, restarted: list) -> None:
    while len(ended) < RESTART_AFTER:
        await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    stack.tokenizer.kill()
    restarted.append(time.monotonic())
    await loop.run_in_executor(None, stack.tokenizer.start)
    await loop.run_in_executor(None, stack.tokenizer.wait_serving, time.monotonic() + STARTUP_TIMEOUT_S)
    restarted.append(time.monotonic())


def test_soak_with_cancels_and_a_tokenizer_restart(stack):
    rng = random.Random(1234)
    outcomes: dict[int, tuple[str, str | None]] = {}
    ended: list[int] = []
    restarted: list[float] = []

    async def run() -> float:
        started = time.monotonic()
        async with grpc.aio.insecure_channel(stack.frontend.addr, options=CHANNEL_OPTIONS) as channel:
            stub = frontend_pb2_grpc.FrontendServiceStub(channel)
            gate = asyncio.Semaphore(CONCURRENCY)
            restart = asyncio.create_task(_restart_tokenizer_when(stack, ended, restarted))
            await asyncio.wait_for(asyncio.gather(*(_one(stub, i, rng, gate, outcomes, ended)
                                                    for i in range(NUM_REQUESTS))), REQUEST_DEADLINE_S * 3)
            await restart
        return time.monotonic() - started

    seconds = asyncio.run(run())
    counts = collections.Counter(kind for kind, _ in outcomes.values())
    print(f"\nsoak: {NUM_REQUESTS} requests in {seconds:.1f} s: {dict(counts)}; tokenizer down "
          f"{restarted[1] - restarted[0]:.1f} s")
    assert len(outcomes) == NUM_REQUESTS
    bad = {i: o for i, o in outcomes.items() if o[0] not in ("complete", "cancelled", "UNAVAILABLE")}
    assert not bad, f"{len(bad)} requests ended badly, e.g. {list(bad.items())[:5]}"
    assert counts["complete"] >= NUM_REQUESTS // 2, counts
    assert 0 < counts["cancelled"] <= NUM_REQUESTS * CANCEL_FRACTION * 2, counts
    for i, (kind, details) in outcomes.items():
        if kind == "UNAVAILABLE":
            assert "tokenizer" in details or "not ready" in details, (i, details)

    stats = wait_engine_idle(stack.engine_stub, seconds=30, require=True)
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks_free == stats.num_blocks_total
    deadline = time.monotonic() + 60
    while health_status(stack.frontend_channel) != 1:  # SERVING again after the restart
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.2)
    result = stack.frontend_stub.Complete(_request(NUM_REQUESTS, rng)[0], timeout=60)
    assert result.usage.completion_tokens >= 1
