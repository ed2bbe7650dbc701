"""A frontend holding two tokenizer replicas (`--tokenizer-addr A,B`): the active one going
away (a crash, then a drain) fails no request in flight, whose text continues on the other
with no repeated or missing character; new requests are served by the survivor. Both
tokenizers and the frontend are processes of their own, in front of the shared stack's engine."""
from __future__ import annotations

import signal
import time

import grpc
import pytest

from helpers.metrics_util import json_lines
from helpers.stack import STARTUP_TIMEOUT_S, Service, all_serving, free_port, frontend_service, stack  # noqa: F401
from helpers.tokenizer_restart import MAX_TOKENS, _texts
from tessera.v1 import frontend_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture()
def two_tokenizers_and_frontend(stack):
    a, b = (Service(f"tokenizer-{name}", "tessera_tokenizer", free_port(), [], stack.log_dir / f"tokenizer-{name}.log")
            for name in ("rep-a", "rep-b"))
    frontend = frontend_service("frontend-reps", f"{a.addr},{b.addr}", stack.engine.addr, stack.log_dir)
    with all_serving(a, b, frontend):
        yield a, b, frontend


def _active_changes(frontend) -> list[str]:
    return [e["tokenizer"] for e in json_lines(frontend.log_path) if e.get("msg") == "tokenizer replica active"]


def test_requests_move_to_the_other_tokenizer_replica(two_tokenizers_and_frontend):
    a, b, frontend = two_tokenizers_and_frontend
    with grpc.insecure_channel(frontend.addr) as channel:
        stub = frontend_pb2_grpc.FrontendServiceStub(channel)
        undisturbed = _texts(stub)
        assert all(tokens == MAX_TOKENS and text for text, tokens in undisturbed)
        # the first replica listed carries the streams, unless the other was SERVING first
        before = _active_changes(frontend)
        first, second = (b, a) if before and before[-1] == b.addr else (a, b)

        # the active replica crashes mid-run: the requests finish on the other, text intact
        assert _texts(stub, first.kill) == undisturbed
        assert _active_changes(frontend)[len(before):] == [second.addr]
        resumed = [e for e in json_lines(frontend.log_path) if e.get("msg") == "request resumed on a new detokenize stream"]
        assert resumed, "no request was resumed: the crash did not happen mid-run"
        assert _texts(stub) == undisturbed  # new requests: the survivor alone

        # the crashed one back, the survivor drained (SIGTERM): the requests move back
        first.start()
        first.wait_serving(time.monotonic() + STARTUP_TIMEOUT_S)

        def drain_second() -> None:
            second.process.send_signal(signal.SIGTERM)
            assert second.process.wait(15) == 0, second.log_tail()

        assert _texts(stub, drain_second) == undisturbed
        assert _active_changes(frontend)[len(before):] == [second.addr, first.addr]


def test_a_malformed_tokenizer_address_is_a_usage_error_naming_the_flag():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "tessera_frontend", "--tokenizer-addr", "127.0.0.1:50052,tok:port"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-500:]
    assert "--tokenizer-addr: tokenizer address 'tok:port': port 'port' is not a number" in done.stderr
