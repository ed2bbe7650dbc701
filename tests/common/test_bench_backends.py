"""tessera.bench.backends in process: the OpenAI request (endpoint, headers, extra body) and the
per-request timeout."""
from __future__ import annotations

import asyncio

import pytest

from tessera.bench.backends import OpenAIBackend, RequestResult, default_endpoint, with_timeout
from tessera.bench.datasets import SampleRequest

pytestmark = pytest.mark.unit

SAMPLE = SampleRequest("hello", 1, 5)


def test_default_endpoints_and_an_explicit_one(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert OpenAIBackend(None, "http://h:1/", "m", True, False).url == "http://h:1/v1/chat/completions"
    assert OpenAIBackend(None, "http://h:1", "m", False, False).url == "http://h:1/v1/completions"
    assert default_endpoint(True) == "/v1/chat/completions"
    backend = OpenAIBackend(None, "http://h:1", "m", True, False, endpoint="/proxy/v1/chat/completions")
    assert backend.url == "http://h:1/proxy/v1/chat/completions"


def test_headers_replace_the_api_key_and_extra_body_goes_last(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "k1")
    backend = OpenAIBackend(None, "http://h", "m", True, True, headers={"X-Run": "7"})
    assert backend.headers == {"Authorization": "Bearer k1", "X-Run": "7"}
    backend = OpenAIBackend(None, "http://h", "m", True, True, headers={"Authorization": "Bearer k2"},
                            extra_body={"temperature": 0.7, "top_k": 5})
    assert backend.headers == {"Authorization": "Bearer k2"}
    body = backend.body(SAMPLE)
    assert body["temperature"] == 0.7 and body["top_k"] == 5 and body["ignore_eos"] is True
    assert body["messages"] == [{"role": "user", "content": "hello"}] and body["max_completion_tokens"] == 5


def test_a_request_past_the_timeout_is_cancelled_and_failed():
    cancelled = []

    async def slow(sample):
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.append(sample.prompt)
            raise
        return RequestResult(success=True)

    result = asyncio.run(with_timeout(slow, 0.05)(SAMPLE))
    assert not result.success and "timed out after 0.05 s" in result.error
    assert 0.04 < result.latency < 1 and cancelled == ["hello"] and result.prompt_len == 1


def test_a_request_within_the_timeout_is_untouched():
    async def quick(sample):
        return RequestResult(success=True, output_tokens=3)

    assert asyncio.run(with_timeout(quick, 1.0)(SAMPLE)).output_tokens == 3
    assert with_timeout(quick, None) is quick
