"""The client's retries against real frontends (integration): a call made before its frontend
is up is retried until it answers; a call refused RESOURCE_EXHAUSTED (the in-flight cap) is
retried until a slot frees; a stream that fails after its first token is never retried."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from helpers.stack import all_serving, frontend_service, stack  # noqa: F401  (the session fixture)
from tessera.client import (AsyncClient, Client, ResourceExhaustedError, RetryPolicy, UnavailableError)

pytestmark = pytest.mark.integration

LONG = [{"role": "user", "content": "Write a very long story about a dragon."}]


def test_a_call_before_the_frontend_is_up_is_retried(stack):  # noqa: F811
    late = frontend_service("frontend-client-late", stack.tokenizer.addr, stack.engine.addr, stack.log_dir)
    with Client(late.addr, max_retries=0, timeout=30) as client, pytest.raises(UnavailableError):
        client.complete(prompt="Hi", max_tokens=2)
    # the first attempts find nothing listening (then a frontend without its backends yet)
    patient = RetryPolicy(max_retries=200, initial_backoff=0.2, max_backoff=0.5)
    result = {}

    async def ask():
        async with AsyncClient(late.addr, retry_policy=patient, timeout=240) as client:
            result["text"] = "".join([d.text async for d in client.generate(prompt="The capital of France is",
                                                                            max_tokens=4, temperature=0)])
    caller = threading.Thread(target=lambda: asyncio.run(ask()))
    caller.start()
    time.sleep(1.0)
    try:
        with all_serving(late):
            caller.join(timeout=240)
    finally:
        caller.join(timeout=5)
    assert result.get("text"), "the call did not succeed once the frontend was up"


def test_resource_exhausted_is_retried_until_a_slot_frees(stack):  # noqa: F811
    capped = frontend_service("frontend-client-capped", stack.tokenizer.addr, stack.engine.addr, stack.log_dir,
                              "--max-inflight-requests", "1")
    with all_serving(capped), Client(capped.addr, timeout=120) as client:
        with client.generate(messages=LONG, max_tokens=40, ignore_eos=True, temperature=0) as busy:
            next(busy)  # admitted: the one slot is taken
            with Client(capped.addr, max_retries=0) as impatient, pytest.raises(ResourceExhaustedError) as caught:
                impatient.complete(prompt="Hi", max_tokens=2)
            assert "limit" in caught.value.message
            waiting = Client(capped.addr, retry_policy=RetryPolicy(max_retries=100, initial_backoff=0.2,
                                                                   max_backoff=0.5), timeout=120)
            answer = {}
            caller = threading.Thread(target=lambda: answer.update(r=waiting.complete(prompt="Hi", max_tokens=2)))
            caller.start()
            time.sleep(0.5)
            assert sum(len(d.token_ids) for d in busy) > 0  # the first request runs to its end
        caller.join(timeout=120)
        waiting.close()
        assert answer["r"].choices[0].token_ids


def test_a_stream_that_fails_after_its_first_token_is_not_retried(stack):  # noqa: F811
    doomed = frontend_service("frontend-client-doomed", stack.tokenizer.addr, stack.engine.addr, stack.log_dir)
    slow_retries = RetryPolicy(max_retries=5, initial_backoff=3.0, jitter=0.0)
    with all_serving(doomed), Client(doomed.addr, retry_policy=slow_retries, timeout=120) as client:
        stream = client.generate(messages=LONG, max_tokens=300, ignore_eos=True, temperature=0)
        first = next(stream)
        assert first.token_ids
        doomed.kill()  # the frontend dies mid-answer
        start = time.monotonic()
        with pytest.raises(UnavailableError):
            for _ in stream:
                pass
        assert time.monotonic() - start < 2.5, "a failure after the first token must not wait for a retry"
