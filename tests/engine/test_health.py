"""The engine's health tells the truth: when its core loop dies (test-only fault injection,
TESSERA_ENGINE_FAULT_AFTER_STEPS) or a step hangs past --step-timeout-s
(TESSERA_ENGINE_HANG_AFTER_STEPS), grpc.health.v1 goes NOT_SERVING, the HTTP /health on the
metrics port answers 503, the open Session ends with UNAVAILABLE instead of hanging, new
sessions are refused, and the process then exits with code 1 (so it is restarted)."""
from __future__ import annotations

import pathlib
import queue
import tempfile
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from helpers.metrics_util import health_http, json_lines, wait_for
from helpers.stack import Service, free_port, health_status
from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import common_pb2, engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.integration

FAULT_AFTER = 6
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _session_until_it_fails(channel, request_id: str) -> tuple[int, str, float]:
    """One long request on a new Session, read until the session ends: it must end with
    UNAVAILABLE; returns the tokens streamed before, the status details and the seconds it took."""
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    inputs: queue.Queue = queue.Queue()
    call = stub.Session(iter(inputs.get, None), timeout=60)
    inputs.put(engine_pb2.SessionInput(add=[engine_pb2.EngineRequest(
        request_id=request_id, prompt_token_ids=[1, 2, 3, 4],
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))]))
    started = time.monotonic()
    tokens = 0
    try:
        for msg in call:
            tokens += sum(len(o.new_token_ids) for o in msg.outputs)
        raise AssertionError("the session ended without an error")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return tokens, exc.details(), time.monotonic() - started
    finally:
        inputs.put(None)


def test_engine_goes_not_serving_when_its_loop_dies():
    log = pathlib.Path(tempfile.mkdtemp(prefix="tessera-engine-health-")) / "engine.log"
    svc = Service("engine", "tessera_engine", free_port(), ["--num-kv-blocks", "32", "--max-model-len", "256"],
                  log, env={"TESSERA_ENGINE_FAULT_AFTER_STEPS": str(FAULT_AFTER)})
    svc.start()
    channel = grpc.insecure_channel(svc.addr, options=CHANNEL_OPTIONS)
    try:
        def status():
            assert svc.process.poll() is None, svc.log_tail()
            try:
                return health_status(channel)
            except grpc.RpcError:
                return None

        # loading: NOT_SERVING on both; then SERVING on both
        wait_for(lambda: status() is not None, 120, "the engine to answer health")
        if status() == NOT_SERVING:
            assert health_http(svc.metrics_url) == 503
        wait_for(lambda: status() == SERVING, 300, "SERVING", interval=0.2)
        assert health_http(svc.metrics_url) == 200
        assert health_status(channel, "tessera.v1.EngineService") == SERVING

        stub = engine_pb2_grpc.EngineServiceStub(channel)
        tokens, details, seconds = _session_until_it_fails(channel, "doomed")
        assert "core loop died" in details
        assert tokens == FAULT_AFTER  # one token per step until the loop died
        assert seconds < 30

        wait_for(lambda: status() == NOT_SERVING, 5, "NOT_SERVING")
        assert health_status(channel, "tessera.v1.EngineService") == NOT_SERVING
        assert health_http(svc.metrics_url) == 503
        # a new session is refused at once
        try:
            list(stub.Session(iter([]), timeout=10))
            raise AssertionError("a session was accepted by a dead engine")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
        assert any(x.get("msg") == "engine core loop is dead; health is NOT_SERVING" and x["level"] == "ERROR"
                   for x in json_lines(log))
        assert svc.process.wait(timeout=30) == 1, svc.log_tail()
        assert any(x.get("msg") == "exiting so that the engine is restarted" for x in json_lines(log))
    finally:
        channel.close()
        svc.stop()


def test_a_step_past_the_watchdog_limit_fails_its_requests_and_exits_the_engine():
    log = pathlib.Path(tempfile.mkdtemp(prefix="tessera-engine-watchdog-")) / "engine.log"
    svc = Service("engine", "tessera_engine", free_port(),
                  ["--num-kv-blocks", "32", "--max-model-len", "256", "--step-timeout-s", "2"],
                  log, env={"TESSERA_ENGINE_HANG_AFTER_STEPS": "3"})
    svc.start()
    channel = grpc.insecure_channel(svc.addr, options=CHANNEL_OPTIONS)
    try:
        def status():
            try:
                return health_status(channel)
            except grpc.RpcError:
                return None

        wait_for(lambda: status() == SERVING, 300, "SERVING", interval=0.2)
        tokens, details, seconds = _session_until_it_fails(channel, "stuck")
        assert "--step-timeout-s (2 s)" in details
        assert tokens == 3  # one token per step until the fourth hung
        assert seconds < 20
        assert status() == NOT_SERVING
        assert svc.process.wait(timeout=30) == 1, svc.log_tail()
        assert any(x.get("msg") == "engine core loop is dead; health is NOT_SERVING"
                   and "step-timeout-s" in x.get("error", "") for x in json_lines(log))
    finally:
        channel.close()
        svc.stop()
