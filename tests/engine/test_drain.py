"""SIGTERM drains the engine: NOT_SERVING at once, new requests on an open Session refused
with UNAVAILABLE (so the frontend retries them elsewhere), requests in flight run to their
end, then the Session ends cleanly and the process exits 0. Past --drain-timeout-s what
still runs is cut off, and the process still exits 0."""
from __future__ import annotations

import pathlib
import signal
import tempfile
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from helpers.metrics_util import json_lines, wait_for
from helpers.stack import EngineSession, Service, free_port, health_status
from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import common_pb2, engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
FLAGS = ["--num-kv-blocks", "64", "--max-model-len", "512"]


def _request(request_id: str, max_tokens: int) -> engine_pb2.EngineRequest:
    return engine_pb2.EngineRequest(
        request_id=request_id, prompt_token_ids=[1, 2, 3, 4, 5],
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def _engine(*flags: str) -> tuple[Service, grpc.Channel]:
    log = pathlib.Path(tempfile.mkdtemp(prefix="tessera-engine-drain-")) / "engine.log"
    svc = Service("engine", "tessera_engine", free_port(), [*FLAGS, *flags], log)
    svc.start()
    channel = grpc.insecure_channel(svc.addr, options=CHANNEL_OPTIONS)

    def serving() -> bool:
        assert svc.process.poll() is None, svc.log_tail()
        try:
            return health_status(channel) == SERVING
        except grpc.RpcError:
            return False

    wait_for(serving, 300, "SERVING", interval=0.2)
    return svc, channel


def test_sigterm_finishes_running_requests_refuses_new_ones_and_exits_0():
    svc, channel = _engine()
    try:
        session = EngineSession(engine_pb2_grpc.EngineServiceStub(channel))
        session.add(_request("running", 60))
        stream = iter(session.call)
        tokens = sum(len(o.new_token_ids) for o in next(stream).outputs)
        assert tokens >= 1

        svc.process.send_signal(signal.SIGTERM)
        wait_for(lambda: health_status(channel) == NOT_SERVING, 5, "NOT_SERVING", interval=0.02)
        session.add(_request("late", 10))
        late = finish = None
        for message in stream:  # ends cleanly (OK) once the drain is over
            for o in message.outputs:
                if o.request_id == "running":
                    tokens += len(o.new_token_ids)
                    if o.finish_reason:
                        finish = o.finish_reason
                elif o.request_id == "late":
                    late = o
        assert tokens == 60 and finish == common_pb2.FINISH_REASON_LENGTH
        assert late is not None and late.finish_reason == common_pb2.FINISH_REASON_ERROR
        assert late.error.code == "UNAVAILABLE" and "draining" in late.error.message
        assert not late.new_token_ids
        assert svc.process.wait(30) == 0, svc.log_tail()
        assert any(e.get("msg") == "drained" for e in json_lines(svc.log_path)), svc.log_tail()
    finally:
        channel.close()
        svc.stop()


def test_the_drain_timeout_cuts_off_what_still_runs_and_exits_0():
    svc, channel = _engine("--drain-timeout-s", "1")
    try:
        session = EngineSession(engine_pb2_grpc.EngineServiceStub(channel))
        session.add(_request("endless", 400))
        stream = iter(session.call)
        next(stream)
        started = time.monotonic()
        svc.process.send_signal(signal.SIGTERM)
        tokens = sum(len(o.new_token_ids) for m in stream for o in m.outputs)  # ends, unfinished
        assert tokens < 399
        assert svc.process.wait(30) == 0, svc.log_tail()
        assert time.monotonic() - started < 15
        assert any(e.get("msg") == "drain timed out; aborting the requests still running"
                   for e in json_lines(svc.log_path)), svc.log_tail()
    finally:
        channel.close()
        svc.stop()
