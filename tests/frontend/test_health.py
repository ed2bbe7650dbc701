"""The frontend's health tells the truth about its backends, on a stack of its own:

1. the tokenizer process is killed: the frontend goes NOT_SERVING and requests fail
   with UNAVAILABLE; the tokenizer is restarted: the frontend is SERVING again and
   requests work;
2. the engine's core loop dies (test-only fault injection): the engine and the frontend go
   NOT_SERVING; the request in flight waits for a replica to migrate to, up to the frontend's
   --engine-timeout-s (5 s here), then fails with UNAVAILABLE instead of hanging.

The frontend's HTTP /health answers are checked to agree: the one on its metrics port and
its OpenAI HTTP API's /health.
"""
from __future__ import annotations

import concurrent.futures
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from helpers.metrics_util import health_http, wait_for
from helpers.stack import Stack, health_status
from tessera.v1 import common_pb2, frontend_pb2, tokenizer_pb2

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
FAULT_AFTER = 60  # engine steps before its loop dies; the first part uses far fewer
ENGINE_TIMEOUT_S = 5  # the frontend's --engine-timeout-s: how long a request waits for a replica


@pytest.fixture(scope="module")
def own_stack():
    stack = Stack()
    stack.engine.env["TESSERA_ENGINE_FAULT_AFTER_STEPS"] = str(FAULT_AFTER)
    stack.frontend.env["TESSERA_ENGINE_TIMEOUT_S"] = str(ENGINE_TIMEOUT_S)
    stack.start()
    yield stack
    stack.stop()


def _status(channel) -> int | None:
    try:
        return health_status(channel)
    except grpc.RpcError:
        return None


def _generate(stack, max_tokens: int = 4, timeout: float = 60) -> list[frontend_pb2.GenerateResponse]:
    request = frontend_pb2.GenerateRequest(
        chat=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content="Say hi.")]),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return list(stack.frontend_stub.Generate(request, timeout=timeout))


def _http_agrees(stack, expected: int) -> None:
    """The frontend's HTTP /health endpoints say the same: the one on its metrics port and the
    one of its OpenAI HTTP API."""
    for url in (stack.frontend.metrics_url, stack.frontend.http_url):
        wait_for(lambda: health_http(url) == expected, 5, f"{url}/health to answer {expected}")


def test_frontend_follows_the_tokenizer_down_and_up(own_stack):
    stack = own_stack
    channel = stack.frontend_channel
    assert _status(channel) == SERVING
    assert sum(len(r.token_ids) for r in _generate(stack)) == 4
    _http_agrees(stack, 200)

    stack.tokenizer.process.send_signal(signal.SIGKILL)
    stack.tokenizer.process.wait(10)
    wait_for(lambda: _status(channel) == NOT_SERVING, 15, "the frontend to go NOT_SERVING", interval=0.1)
    _http_agrees(stack, 503)
    with pytest.raises(grpc.RpcError) as failed:
        _generate(stack, timeout=30)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE

    stack.tokenizer.start()  # same port
    stack.tokenizer.wait_serving(time.monotonic() + 120)
    wait_for(lambda: _status(channel) == SERVING, 30, "the frontend to be SERVING again", interval=0.1)
    _http_agrees(stack, 200)
    assert sum(len(r.token_ids) for r in _generate(stack)) == 4


def test_engine_loop_death_fails_the_request_and_the_health(own_stack):
    stack = own_stack
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        request = pool.submit(_generate, stack, 2 * FAULT_AFTER, 120)
        with grpc.insecure_channel(stack.engine.addr) as engine_channel:
            wait_for(lambda: _status(engine_channel) == NOT_SERVING, 60, "the engine to go NOT_SERVING")
        assert health_http(stack.engine.metrics_url) == 503
        wait_for(lambda: _status(stack.frontend_channel) == NOT_SERVING, 10, "the frontend to go NOT_SERVING")
        _http_agrees(stack, 503)
        with pytest.raises(grpc.RpcError) as failed:
            request.result()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    assert "no engine replica could take the request" in failed.value.details()
    assert time.monotonic() - started < 60
