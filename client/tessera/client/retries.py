"""When a failed call is tried again, and after how long (pure: no I/O).

Only a call that failed before its first token is retried, and only on UNAVAILABLE (no
frontend yet, or one without backends) or RESOURCE_EXHAUSTED (the frontend's in-flight cap):
a call that already streamed output is never retried (its tokens were delivered, a retry
would repeat them). The wait doubles from `initial_backoff` up to `max_backoff`, with jitter
so that many clients do not return at once; a server's retry hint (trailing metadata
`retry-after`, seconds, as HTTP's header, or gRPC's `grpc-retry-pushback-ms`) replaces it.
No retry starts that could not finish before the call's deadline.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Iterable

import grpc

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 2            # retries after the first attempt (0: none)
    initial_backoff: float = 0.5    # seconds before the first retry
    max_backoff: float = 8.0
    multiplier: float = 2.0
    jitter: float = 0.25            # the wait varies by up to this fraction either way

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {self.max_retries}")
        if self.initial_backoff < 0 or self.max_backoff < 0:
            raise ValueError("initial_backoff and max_backoff: must be >= 0")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter: must be in [0, 1), got {self.jitter}")

    def should_retry(self, code: grpc.StatusCode, retries_done: int, received_output: bool) -> bool:
        """Whether a call that failed with `code` after `retries_done` retries is tried again."""
        return not received_output and code in RETRYABLE and retries_done < self.max_retries

    def backoff(self, retries_done: int, hint: float | None = None, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `retries_done + 1`: the server's hint when it gave
        one, else exponential backoff with jitter."""
        if hint is not None:
            return max(0.0, hint)
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** retries_done)
        spread = (rng or random).uniform(-self.jitter, self.jitter)
        return max(0.0, base * (1 + spread))

    def fits(self, wait: float, remaining: float | None) -> bool:
        """Whether a retry after `wait` seconds still starts before the deadline (`remaining` s left)."""
        return math.isfinite(wait) and (remaining is None or wait < remaining)


def retry_hint(metadata: Iterable[tuple[str, str | bytes]] | None) -> float | None:
    """The server's retry hint in seconds, from a call's trailing metadata; None if it sent none
    (or an unreadable one); math.inf when it says not to retry (a negative pushback, as gRPC's
    retry design says). `grpc-retry-pushback-ms` wins over `retry-after`."""
    found: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        found[key.lower()] = value
    try:
        if "grpc-retry-pushback-ms" in found:
            ms = int(found["grpc-retry-pushback-ms"])
            return ms / 1000 if ms >= 0 else math.inf  # negative: the server says do not retry
        if "retry-after" in found:
            seconds = float(found["retry-after"])
            return seconds if seconds >= 0 else None
    except ValueError:
        return None
    return None
