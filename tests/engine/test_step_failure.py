"""An unexpected exception inside an engine step fails the requests of that step, not the
engine (issue 18 item 2): they end with finish reason ERROR and INTERNAL naming the failure,
the blocks published for the step are not reused, and the engine keeps serving. Test-only
fault injection (TESSERA_ENGINE_STEP_ERROR_AFTER_STEPS) makes one step's model run raise.
The unit half runs an in-process core; the process half a real engine service."""
from __future__ import annotations

import pathlib
import tempfile

import pytest

from helpers.engine_fixtures import tiny_hf_llama, tiny_loaded
from helpers.metrics_util import json_lines
from helpers.stack import EngineSession, Service, engine_idle, free_port, health_status, serving, wait_engine_idle
from tessera.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tessera_engine import core as core_module
from tessera_engine import fault_injection

SERVING = 1


def _request(request_id: str, max_tokens: int, prompt=(1, 2, 3, 4, 5)) -> engine_pb2.EngineRequest:
    return engine_pb2.EngineRequest(
        request_id=request_id, prompt_token_ids=list(prompt),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.integration
def test_a_failing_step_fails_its_requests_and_the_engine_serves_on():
    log = pathlib.Path(tempfile.mkdtemp(prefix="tessera-engine-step-failure-")) / "engine.log"
    svc = Service("engine", "tessera_engine", free_port(), ["--num-kv-blocks", "64", "--max-model-len", "512"], log,
                  env={fault_injection.STEP_ERROR_ENV: "0"})
    with serving(svc) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        session = EngineSession(stub)
        try:
            prompt = list(range(100, 140))  # 2 full blocks, published when its (failing) prefill step is scheduled
            session.add(_request("doomed", 20, prompt))
            failed = None
            for message in session.call:
                out = next((o for o in message.outputs if o.request_id == "doomed"), None)
                if out is not None and out.finish_reason:
                    failed = out
                    break
            assert failed.finish_reason == common_pb2.FINISH_REASON_ERROR
            assert failed.error.code == "INTERNAL"
            assert "engine step" in failed.error.message and "injected step error" in failed.error.message
            assert health_status(channel) == SERVING

            # the same prompt again: served in full, with none of the failed step's blocks reused
            session.add(_request("again", 20, prompt), _request("other", 20))
            got = session.run({"again", "other"})
            assert got["again"]["reason"] == common_pb2.FINISH_REASON_LENGTH and len(got["again"]["tokens"]) == 20
            assert got["other"]["reason"] == common_pb2.FINISH_REASON_LENGTH and len(got["other"]["tokens"]) == 20
            assert got["again"]["cached"] < 32, "blocks published for the failed step were reused"
        finally:
            session.close()
        assert engine_idle(wait_engine_idle(stub, require=True))
    assert svc.process.returncode == 0, svc.log_tail()
    logged = [e for e in json_lines(log) if e.get("msg") == "engine step failed; its requests fail"]
    assert len(logged) == 1


@pytest.mark.unit
def test_a_fault_that_repeats_ends_the_loop(monkeypatch):
    """Three failed steps in a row: the exception leaves run_step (the service then exits
    non-zero, see test_health_engine) instead of failing requests forever."""
    from tessera_engine.config import EngineConfig
    from tessera_engine.core import EngineCore
    from tessera_engine.request import EngineCoreRequest
    from tessera_engine.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=32, block_size=16),
                      tiny_loaded(*tiny_hf_llama()))

    def broken(sched):
        raise RuntimeError("broken model")

    monkeypatch.setattr(core.executor, "execute_model", broken)
    for step in range(core_module.MAX_FAILED_STEPS_IN_A_ROW - 1):
        core.add_request(EngineCoreRequest(f"r{step}", [1, 2, 3], SamplingParams(max_tokens=4)))
        outs = core.step()
        assert [(o.request_id, o.finish_reason, o.error.code) for o in outs] == [(f"r{step}", "error", "INTERNAL")]
        assert core.kv_cache.stats().num_free_blocks == core.kv_cache.num_blocks
    core.add_request(EngineCoreRequest("last", [1, 2, 3], SamplingParams(max_tokens=4)))
    with pytest.raises(RuntimeError, match="broken model"):
        core.step()
