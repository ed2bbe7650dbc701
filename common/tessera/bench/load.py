"""When requests are sent, as `vllm bench serve` schedules them: all at once, or at a mean
request rate with gamma-distributed gaps (burstiness 1 = Poisson arrivals, < 1 burstier, > 1 more
even, inf = evenly spaced); at most max_concurrency in flight; for a number of prompts or until a
duration has passed."""
from __future__ import annotations

import asyncio
import itertools
import math
import time
from typing import Callable, Iterable, Iterator

import numpy as np

from tessera.bench.backends import RequestResult, Sender
from tessera.bench.datasets import SampleRequest


def gaps(request_rate: float, burstiness: float, rng: np.random.RandomState) -> Iterator[float]:
    """Seconds before each request (the first one's too): gamma with mean 1/rate, drawn as vLLM
    draws them (numpy's legacy generator, so one seed gives vLLM's gaps); 0 for an infinite rate,
    exactly 1/rate for an infinite burstiness."""
    while True:
        if math.isinf(request_rate):
            yield 0.0
        elif math.isinf(burstiness):
            yield 1.0 / request_rate
        else:
            yield float(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness)))


def arrival_times(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each of n requests is due: the gaps summed, then scaled so
    that the last falls at n / rate exactly (as vLLM does: the drawn gaps' sum misses it by a few
    percent, which would move the measured throughput with the seed)."""
    times = list(itertools.accumulate(itertools.islice(gaps(request_rate, burstiness, np.random.RandomState(seed)), n)))
    if times and times[-1] > 0:
        scale = (n / request_rate) / times[-1]
        times = [t * scale for t in times]
    return times


async def run_load(send: Sender, samples: list[SampleRequest], *, num_prompts: int | None,
                   duration: float | None, request_rate: float, burstiness: float,
                   max_concurrency: int | None, seed: int,
                   on_done: Callable[[RequestResult], None] = lambda r: None) -> tuple[list[RequestResult], float]:
    """Send the samples (cycled when a duration asks for more) and return every result (in the
    order sent) and the run's wall time: from the start of the schedule (the first request is due
    one gap after it, as in vLLM) to the last answer. A request waits for a free slot under
    max_concurrency before it is sent; the ones due meanwhile go as slots free."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(sample: SampleRequest) -> RequestResult:
        try:
            result = await send(sample)
        finally:
            if gate is not None:
                gate.release()
        on_done(result)
        return result

    order: Iterable[SampleRequest]
    due: Iterable[float]
    if duration:
        order = itertools.cycle(samples)
        due = itertools.accumulate(gaps(request_rate, burstiness, np.random.RandomState(seed)))
    else:
        order = samples[:num_prompts]
        due = arrival_times(len(order), request_rate, burstiness, seed)
    tasks: list[asyncio.Task] = []
    start = time.perf_counter()
    for sample, at in zip(order, due):
        if duration and at >= duration:
            break
        wait = start + at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        if gate is not None:
            await gate.acquire()  # a free slot first: at the cap no request queues up unsent
        if duration and time.perf_counter() - start >= duration:
            if gate is not None:
                gate.release()
            break
        tasks.append(asyncio.create_task(one(sample)))
    results = list(await asyncio.gather(*tasks))  # in the order sent, as vLLM's records
    return results, time.perf_counter() - start
