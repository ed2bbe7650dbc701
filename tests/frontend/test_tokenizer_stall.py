"""A tokenizer that stops answering (SIGSTOP: the process hangs, its connections stay open)
neither hangs the frontend's requests nor leaves its health SERVING: with
--tokenizer-timeout-s 2, a running request fails UNAVAILABLE within seconds (its stream is
broken off, and its outputs wait for a new one no longer than that either), health turns
NOT_SERVING, new requests fail fast, and all is well again once the tokenizer resumes.

Its own tokenizer and frontend processes in front of the shared stack's engine."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from helpers.metrics_util import wait_for
from helpers.stack import health_status, stack, tokenizer_and_frontend  # noqa: F401
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _request(request_id: str, max_tokens: int) -> frontend_pb2.GenerateRequest:
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content="Tell me a story.")])
    return frontend_pb2.GenerateRequest(request_id=request_id, chat=chat, sampling_params=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


@pytest.fixture()
def own_tokenizer_and_frontend(stack):
    with tokenizer_and_frontend(stack, "stall", "--tokenizer-timeout-s", "2") as both:
        yield both


def test_a_tokenizer_that_stops_answering_fails_requests_fast_and_turns_health_off(own_tokenizer_and_frontend):
    tokenizer, frontend = own_tokenizer_and_frontend
    with grpc.insecure_channel(frontend.addr) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        running = stub.Generate(_request("stalled", 2000), timeout=120)
        assert next(running).token_ids  # it runs

        os.kill(tokenizer.process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            for _ in running:
                pass
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        # its stream broken off after 2 s without an answer, its waiting outputs given up 2 s later
        assert "tokenizer" in failed.value.details() and "2 s" in failed.value.details(), failed.value.details()
        assert time.monotonic() - stopped < 15
        wait_for(lambda: health_status(channel) == NOT_SERVING, 15, "the frontend to go NOT_SERVING", interval=0.1)

        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(_request("while-stopped", 4), timeout=60))
        assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert time.monotonic() - started < 15

        os.kill(tokenizer.process.pid, signal.SIGCONT)
        wait_for(lambda: health_status(channel) == SERVING, 30, "the frontend to be SERVING again", interval=0.1)
        assert sum(len(r.token_ids) for r in stub.Generate(_request("after", 4), timeout=60)) == 4
