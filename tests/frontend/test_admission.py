"""Admission control and readiness of the frontend, each on a dedicated frontend process.

* A frontend capped at 2 requests in flight (set through TESSERA_MAX_INFLIGHT_REQUESTS)
  in front of the shared stack's tokenizer and engine: a third request is refused at
  once (gRPC RESOURCE_EXHAUSTED, HTTP 429) while the two admitted ones finish whole.
* A frontend whose backends do not exist: health NOT_SERVING, requests UNAVAILABLE / 503.
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.parse

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2

from helpers.stack import free_port, frontend_service, health_status, serving, stack  # noqa: F401
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

pytestmark = pytest.mark.integration

QUESTION = "Why is the sky blue?"
MAX_TOKENS = 48


def _chat(text: str) -> tokenizer_pb2.ChatMessages:
    return tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=text)])


def _request(**params) -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(chat=_chat(QUESTION), sampling_params=common_pb2.SamplingParams(**params))


@pytest.fixture(scope="module")
def limited(stack):
    """A frontend allowing 2 requests in flight, in front of the shared backends."""
    service = frontend_service("frontend-limited", stack.tokenizer.addr, stack.engine.addr, stack.log_dir)
    service.env = {"TESSERA_MAX_INFLIGHT_REQUESTS": "2"}
    with serving(service) as channel:
        yield service, frontend_pb2_grpc.FrontendServiceStub(channel)


def _http_client(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=service.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_over_the_cap_is_refused_and_admitted_requests_finish(stack, limited):
    service, stub = limited
    reference = stack.frontend_stub.Complete(_request(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                             timeout=120)
    client = _http_client(service)

    # Two requests take the two slots: a gRPC stream and an HTTP stream, each past its first token.
    grpc_stream = stub.Generate(_request(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=120)
    grpc_responses = [next(grpc_stream)]
    http_stream = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    http_chunks = [next(iter(http_stream))]

    # A third is refused at once, whichever API and call it uses.
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request(max_tokens=4), timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "in flight" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(_request(max_tokens=4), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(openai.RateLimitError) as too_many:
        client.completions.create(model="", prompt="Hello", max_tokens=4)
    assert too_many.value.status_code == 429
    assert too_many.value.response.headers["retry-after"] == "1"
    assert too_many.value.body["code"] == "rate_limit_exceeded"
    assert set(too_many.value.body) == {"message", "type", "param", "code"}

    # The admitted two are unharmed: whole, and the same as on the uncapped frontend.
    grpc_responses += list(grpc_stream)
    text = "".join(r.text for r in grpc_responses)
    assert text == reference.choices[0].text
    assert grpc_responses[-1].usage.completion_tokens == MAX_TOKENS
    http_chunks += list(http_stream)
    assert "".join(c.choices[0].delta.content or "" for c in http_chunks if c.choices) == text
    assert http_chunks[-1].usage.completion_tokens == MAX_TOKENS

    # Their slots are free again.
    assert stub.Complete(_request(temperature=0.0, max_tokens=4), timeout=60).usage.completion_tokens == 4
    assert client.completions.create(model="", prompt=["a", "b"], max_tokens=2).usage.completion_tokens == 4


def test_batch_larger_than_the_cap_is_refused(limited):
    service, _ = limited
    with pytest.raises(openai.RateLimitError):
        _http_client(service).completions.create(model="", prompt=["a", "b", "c"], max_tokens=2)


def test_cancelled_requests_give_their_slots_back(limited):
    service, stub = limited
    for _ in range(3):  # more cancellations than slots: a leak would show as RESOURCE_EXHAUSTED
        call = stub.Generate(_request(max_tokens=200, ignore_eos=True), timeout=60)
        next(call)
        call.cancel()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert stub.Complete(_request(max_tokens=2), timeout=60).usage.completion_tokens == 2
            break
        except grpc.RpcError as exc:  # the cancellations are processed asynchronously
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.1)


@pytest.fixture(scope="module")
def orphan(stack):
    """A frontend whose tokenizer and engine addresses have nothing behind them."""
    service = frontend_service("frontend-orphan", f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}",
                               stack.log_dir)
    service.start()
    url = urllib.parse.urlsplit(service.http_url)
    deadline = time.monotonic() + 60
    while True:  # wait until both servers listen (health stays NOT_SERVING)
        try:
            with grpc.insecure_channel(service.addr) as channel:
                health_status(channel)
            http.client.HTTPConnection(url.hostname, url.port, timeout=2).request("GET", "/health")
            break
        except (grpc.RpcError, OSError):
            assert service.process.poll() is None, service.log_tail()
            assert time.monotonic() < deadline, service.log_tail()
            time.sleep(0.2)
    try:
        yield service
    finally:
        service.stop()


def test_not_ready_is_unavailable(orphan):
    with grpc.insecure_channel(orphan.addr) as channel:
        assert health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            list(frontend_pb2_grpc.FrontendServiceStub(channel).Generate(_request(max_tokens=2), timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    url = urllib.parse.urlsplit(orphan.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("GET", "/health")
    response = conn.getresponse()
    assert response.status == 503 and "error" in json.loads(response.read())
    with pytest.raises(openai.InternalServerError) as info:  # the openai package's class for 5xx
        _http_client(orphan).chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 503
    assert info.value.body["type"] == "service_unavailable_error"
    # A bad request is still a 400, not a 503: validation needs no backend.
    with pytest.raises(openai.BadRequestError):
        _http_client(orphan).completions.create(model="", prompt="hi", max_tokens=0)
