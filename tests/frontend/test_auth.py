"""API keys on the frontend's public ports: a frontend process with `--api-key key-one,key-two`
in front of the shared stack's tokenizer and engine, asked over HTTP (the real `openai`
client, and http.client for the raw 401) and over gRPC."""
from __future__ import annotations

import http.client
import json
import time
import urllib.parse

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2

from helpers.stack import STARTUP_TIMEOUT_S, frontend_service, health_status, stack  # noqa: F401
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2
from tessera_frontend.auth import MISSING, WRONG, ApiKeys, parse_api_keys

KEYS = "key-one, key-two"


@pytest.mark.unit
def test_api_keys_unit():
    assert parse_api_keys(" a, ,b ") == ["a", "b"] and parse_api_keys(None) == [] and parse_api_keys("") == []
    keys = ApiKeys(["a1", "b2"])
    assert keys.enabled and not ApiKeys([]).enabled
    assert keys.check("Bearer a1") is None and keys.check("bearer  b2 ") is None and keys.check(b"Bearer a1") is None
    assert keys.check(None) == MISSING and keys.check("a1") == MISSING and keys.check("Basic a1") == MISSING
    assert keys.check("Bearer ") == MISSING and keys.check("Bearer a") == WRONG and keys.check("Bearer a1x") == WRONG
    assert ApiKeys([]).check(None) is None


@pytest.fixture(scope="module")
def guarded(stack):
    frontend = frontend_service("frontend-auth", stack.tokenizer.addr, stack.engine.addr, stack.log_dir,
                                "--api-key", KEYS)
    frontend.start()
    try:
        frontend.wait_serving(time.monotonic() + STARTUP_TIMEOUT_S)
        yield frontend
    finally:
        frontend.stop()


def _raw(frontend, method: str, path: str, headers: dict | None = None, body: bytes | None = None):
    url = urllib.parse.urlsplit(frontend.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


@pytest.mark.integration
def test_http_needs_a_key_except_for_health(guarded):
    chat = json.dumps({"model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    status, headers, body = _raw(guarded, "POST", "/v1/chat/completions", {"content-type": "application/json"}, chat)
    assert status == 401 and headers.get("www-authenticate") == "Bearer"
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
    status, _, body = _raw(guarded, "GET", "/v1/models", {"authorization": "Bearer key-three"})
    assert status == 401 and json.loads(body)["error"]["message"] == WRONG
    assert _raw(guarded, "GET", "/health")[0] == 200

    for key in ("key-one", "key-two"):
        client = openai.OpenAI(base_url=guarded.http_url + "/v1", api_key=key, max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                               max_tokens=3, temperature=0.0)
        assert reply.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.http_url + "/v1", api_key="nope", max_retries=0).models.list()


@pytest.mark.integration
def test_grpc_needs_a_key_except_for_health(guarded):
    request = frontend_pb2.GenerateRequest(
        chat=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content="Say hi.")]),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    with grpc.insecure_channel(guarded.addr) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING  # no key needed
        for metadata in (None, [("authorization", "Bearer wrong")]):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Complete(request, timeout=60, metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request, timeout=60, metadata=metadata))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "Bearer" in refused.value.details() or refused.value.details() == WRONG
        result = stub.Complete(request, timeout=60, metadata=[("authorization", "Bearer key-two")])
        assert result.usage.completion_tokens == 3
        streamed = list(stub.Generate(request, timeout=60, metadata=[("authorization", "Bearer key-one")]))
        assert sum(len(r.token_ids) for r in streamed) == 3
