"""tessera.bench.load: vLLM's arrival schedule (gamma gaps from numpy's legacy generator, scaled
to end at n / rate), max concurrency, duration; with senders that only sleep."""
from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from tessera.bench import load
from tessera.bench.backends import RequestResult
from tessera.bench.datasets import SampleRequest

pytestmark = pytest.mark.unit


def vllm_schedule(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """vllm/benchmarks/serve.py's get_request delays (0.32.0), written out: np.random seeded with
    the seed, gamma(shape=burstiness, scale=1/(rate*burstiness)) per request, summed, scaled."""
    np.random.seed(seed)
    delays = [np.random.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)) for _ in range(n)]
    for i in range(1, n):
        delays[i] += delays[i - 1]
    factor = (n / rate) / delays[-1]
    return [d * factor for d in delays]


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 3.0])
def test_arrival_times_are_vllms_for_the_same_seed(burstiness):
    times = load.arrival_times(50, 4.0, burstiness, seed=11)
    assert times == pytest.approx(vllm_schedule(50, 4.0, burstiness, 11), rel=1e-12)
    assert times[-1] == pytest.approx(50 / 4.0) and times == sorted(times) and times[0] > 0


def test_infinite_burstiness_is_evenly_spaced_and_infinite_rate_all_at_once():
    assert load.arrival_times(4, 2.0, math.inf, 0) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert load.arrival_times(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


def test_other_seeds_other_gaps():
    assert load.arrival_times(10, 1.0, 1.0, 1) != load.arrival_times(10, 1.0, 1.0, 2)


SAMPLES = [SampleRequest(f"p{i}", 1, 1) for i in range(4)]


def sleeper(seconds: float, log: list):
    async def send(sample: SampleRequest) -> RequestResult:
        start = time.perf_counter()
        log.append((sample.prompt, start))
        await asyncio.sleep(seconds)
        return RequestResult(success=True, start=start, latency=seconds, output_tokens=1)
    return send


def test_requests_go_on_vllms_schedule_and_duration_covers_the_last_answer():
    log: list = []

    async def run():
        t0 = time.perf_counter()
        results, duration = await load.run_load(sleeper(0.05, log), SAMPLES, num_prompts=4, duration=None,
                                                request_rate=20.0, burstiness=math.inf, max_concurrency=None, seed=0)
        return t0, results, duration

    t0, results, duration = asyncio.run(run())
    assert [p for p, _ in log] == ["p0", "p1", "p2", "p3"] and len(results) == 4
    sent = [t - t0 for _, t in log]
    assert sent == pytest.approx([0.05, 0.10, 0.15, 0.20], abs=0.03)  # the first one gap after the start
    assert duration == pytest.approx(0.25, abs=0.05)


def test_max_concurrency_holds_requests_until_a_slot_frees():
    log: list = []
    results, duration = asyncio.run(load.run_load(
        sleeper(0.1, log), SAMPLES, num_prompts=4, duration=None, request_rate=math.inf, burstiness=1.0,
        max_concurrency=2, seed=0))
    starts = sorted(t for _, t in log)
    assert starts[1] - starts[0] < 0.03 and starts[2] - starts[0] >= 0.09
    assert duration == pytest.approx(0.2, abs=0.06) and len(results) == 4


def test_duration_cycles_the_prompts_and_sends_nothing_due_after_it():
    log: list = []
    results, duration = asyncio.run(load.run_load(
        sleeper(0.01, log), SAMPLES[:2], num_prompts=None, duration=0.5, request_rate=10.0, burstiness=math.inf,
        max_concurrency=None, seed=0))
    assert len(results) == 4  # due at 0.1, 0.2, 0.3, 0.4 (0.5 is not before the end)
    assert [p for p, _ in log] == ["p0", "p1", "p0", "p1"]
