"""tessera.client.retries: which failures are retried, the waits, the server's hint (unit)."""
from __future__ import annotations

import math
import random

import grpc
import pytest

from tessera.client.connection import Deadline
from tessera.client.retries import RetryPolicy, retry_hint
from tessera.client import attempts

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_retries_unavailable_and_exhausted_before_output_only(code):
    policy = RetryPolicy(max_retries=2)
    assert policy.should_retry(code, 0, received_output=False)
    assert policy.should_retry(code, 1, received_output=False)
    assert not policy.should_retry(code, 2, received_output=False)   # out of retries
    assert not policy.should_retry(code, 0, received_output=True)    # never after the first token


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.NOT_FOUND])
def test_other_codes_are_not_retried(code):
    assert not RetryPolicy(max_retries=5).should_retry(code, 0, received_output=False)


def test_backoff_doubles_up_to_the_cap_with_jitter():
    policy = RetryPolicy(initial_backoff=0.5, max_backoff=3.0, multiplier=2.0, jitter=0.0)
    assert [policy.backoff(i) for i in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    jittery = RetryPolicy(initial_backoff=1.0, jitter=0.25)
    waits = [jittery.backoff(0, rng=random.Random(i)) for i in range(200)]
    assert all(0.75 <= w <= 1.25 for w in waits) and len(set(waits)) > 100


def test_the_servers_hint_replaces_the_backoff():
    policy = RetryPolicy(initial_backoff=0.5, jitter=0.0)
    assert policy.backoff(0, hint=2.5) == 2.5
    assert policy.backoff(3, hint=0.0) == 0.0


def test_a_retry_must_start_before_the_deadline():
    policy = RetryPolicy()
    assert policy.fits(1.0, None) and policy.fits(1.0, 1.5)
    assert not policy.fits(2.0, 1.5)
    assert not policy.fits(math.inf, None)   # the server said: do not retry


def test_retry_hint_from_trailing_metadata():
    assert retry_hint(None) is None and retry_hint([("x-other", "1")]) is None
    assert retry_hint([("retry-after", "2")]) == 2.0
    assert retry_hint([("Retry-After", b"0.5")]) == 0.5
    assert retry_hint([("grpc-retry-pushback-ms", "1500"), ("retry-after", "9")]) == 1.5
    assert retry_hint([("grpc-retry-pushback-ms", "-1")]) == math.inf
    assert retry_hint([("retry-after", "soon")]) is None


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError, match="jitter"):
        RetryPolicy(jitter=1.5)


class _Failed(grpc.RpcError):
    """A failed call as grpc raises it (code, details, trailing metadata)."""

    def __init__(self, code, details="", trailers=()):
        self._code, self._details, self._trailers = code, details, trailers

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers


def test_retry_wait_honours_hint_deadline_and_output():
    policy = RetryPolicy(max_retries=3, jitter=0.0, initial_backoff=0.25)
    busy = _Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "at its limit", [("retry-after", "0.75")])
    assert attempts.retry_wait(policy, busy, 0, False, Deadline(None)) == 0.75
    assert attempts.retry_wait(policy, busy, 0, False, Deadline(0.5)) is None  # would pass the deadline
    assert attempts.retry_wait(policy, busy, 0, True, Deadline(None)) is None   # after output: never
    down = _Failed(grpc.StatusCode.UNAVAILABLE, "no engine")
    assert attempts.retry_wait(policy, down, 1, False, Deadline(None)) == 0.5
    error = attempts.to_error(busy, "req-1")
    assert error.retry_after == 0.75 and error.request_id == "req-1" and error.message == "at its limit"
