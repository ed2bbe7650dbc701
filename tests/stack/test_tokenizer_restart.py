"""A tokenizer restart fails no request in flight: the frontend holds each request's output
ids and the length of the text it sent, reopens the request on the new tokenizer's stream
(DetokenizeOpen.resumed_token_ids / resumed_text_chars), and the text continues with no
repeated or missing character. Its own tokenizer and frontend processes in front of the
shared stack's engine: streaming requests are run once undisturbed, then again with the
tokenizer killed (SIGKILL, as a crash) and started again mid-run; the texts are equal."""
from __future__ import annotations

import signal
import time

import grpc
import pytest

from helpers.metrics_util import json_lines
from helpers.stack import STARTUP_TIMEOUT_S, stack, tokenizer_and_frontend  # noqa: F401
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

from helpers.tokenizer_restart import MAX_TOKENS, QUESTIONS, _request, _texts  # noqa: F401

pytestmark = pytest.mark.integration


@pytest.fixture()
def own_tokenizer_and_frontend(stack):
    with tokenizer_and_frontend(stack, "restart") as both:
        yield both


@pytest.mark.parametrize("how", ["crash", "sigterm"])
def test_a_tokenizer_restart_mid_run_fails_no_request_and_loses_no_text(own_tokenizer_and_frontend, how):
    """`crash`: SIGKILL. `sigterm`: the drain, which ends the open streams at once and exits 0
    (it does not hold them for the drain timeout)."""
    tokenizer, frontend = own_tokenizer_and_frontend
    with grpc.insecure_channel(frontend.addr) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        undisturbed = _texts(stub)
        assert all(tokens == MAX_TOKENS and text for text, tokens in undisturbed)

        def restart() -> None:
            if how == "crash":
                tokenizer.kill()
            else:
                started = time.monotonic()
                tokenizer.process.send_signal(signal.SIGTERM)
                assert tokenizer.process.wait(15) == 0, tokenizer.log_tail()
                assert time.monotonic() - started < 10  # not the 30 s drain timeout
            tokenizer.start()  # same port
            tokenizer.wait_serving(time.monotonic() + STARTUP_TIMEOUT_S)

        disturbed = _texts(stub, restart)
    assert disturbed == undisturbed
    resumed = [e for e in json_lines(frontend.log_path) if e.get("msg") == "request resumed on a new detokenize stream"]
    assert resumed, "no request was resumed: the restart did not happen mid-run"
