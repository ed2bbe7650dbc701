"""When requests are sent: all at once, or gamma-distributed gaps at a mean request rate
(burstiness 1 = Poisson arrivals, < 1 burstier, > 1 more even); at most max_concurrency in
flight; for a number of prompts or until a duration has passed."""
from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from typing import Callable, Iterator

from tessera.bench.backends import RequestResult, Sender
from tessera.bench.datasets import SampleRequest


def gaps(request_rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Seconds before each next request: gamma with mean 1/rate (0 for an infinite rate)."""
    while True:
        if math.isinf(request_rate):
            yield 0.0
        else:
            yield rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))


async def run_load(send: Sender, samples: list[SampleRequest], *, num_prompts: int | None,
                   duration: float | None, request_rate: float, burstiness: float,
                   max_concurrency: int | None, seed: int,
                   on_done: Callable[[RequestResult], None] = lambda r: None) -> tuple[list[RequestResult], float]:
    """Send the samples (cycled when a duration asks for more) and return every result and the
    run's wall time: from the first send to the last answer."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)
    results: list[RequestResult] = []

    async def one(sample: SampleRequest) -> None:
        try:
            result = await send(sample)
        finally:
            if gate is not None:
                gate.release()
        results.append(result)
        on_done(result)

    order = itertools.cycle(samples) if duration else iter(samples[:num_prompts])
    tasks: list[asyncio.Task] = []
    start = time.perf_counter()
    wait = gaps(request_rate, burstiness, rng)
    for sample in order:
        if gate is not None:
            await gate.acquire()  # a free slot first: at the cap no request queues up unsent
        if duration and time.perf_counter() - start >= duration:
            if gate is not None:
                gate.release()
            break
        tasks.append(asyncio.create_task(one(sample)))
        delay = next(wait)
        if duration:
            delay = min(delay, max(0.0, start + duration - time.perf_counter()))
        await asyncio.sleep(delay)
    await asyncio.gather(*tasks)
    return results, time.perf_counter() - start
