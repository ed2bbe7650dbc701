"""The engine service as its own OS process: health goes NOT_SERVING -> SERVING,
reflection, the Session stream (batched per-step outputs, per-request errors
that leave other requests alone, abort, closing the stream frees the blocks)."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tessera.v1 import common_pb2, engine_pb2

from helpers.metrics_util import json_lines
from helpers.stack import EngineSession, engine_service, health_status, wait_engine_idle

pytestmark = pytest.mark.integration

NUM_BLOCKS = 64
MAX_LEN = 512


@pytest.fixture(scope="module")
def engine():
    # at the default quantized row limit: timed at start (or read from the timing cache)
    with engine_service("--num-kv-blocks", str(NUM_BLOCKS), "--max-model-len", str(MAX_LEN), timed_rows=True) as service:
        yield service


def test_the_backend_plan_is_logged_once_with_each_decision_and_why(engine):
    plans = [line for line in json_lines(engine.log_path) if line.get("msg") == "backend plan"]
    assert len(plans) == 1
    plan = plans[0]
    assert plan["device"] == "cpu" and plan["dtype"] == "float32" and plan["token_budget"] == 512
    assert set(plan["why"]) == {"device", "dtype", "kernels", "dense_matmul", "keep_quantized",
                                "quantized_matmul", "quantized_max_rows", "batch_invariant", "prompt_matmul",
                                "token_budget", "decoder_stack"}
    if plan["keep_quantized"]:  # the fused kernels built here: the row limit was timed, not set
        assert "timed" in plan["why"]["quantized_max_rows"], plan["why"]
        assert plan["decoder_stack"] is True, plan["why"]["decoder_stack"]
        assert plan["quantized_max_rows"] >= 1  # fp32: the quantized matmul is ahead at one row
        assert plan["quantized_matmul"] == "exact"  # float32 is the reference dtype
        # a timed crossover splits batch sizes between two paths already: prompts take no third
        assert plan["prompt_dense"] is False and "batch-invariant" in plan["why"]["prompt_matmul"], plan["why"]


def greedy(max_tokens: int, **kw):
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_health_went_from_not_serving_to_serving(engine):
    assert health_pb2.HealthCheckResponse.NOT_SERVING in engine.health_seen
    with grpc.insecure_channel(engine.addr) as ch:
        assert health_status(ch, "tessera.v1.EngineService") == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_services(engine):
    stub = reflection_pb2_grpc.ServerReflectionStub(engine.channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"tessera.v1.EngineService", "grpc.health.v1.Health"} <= names


def test_info(engine):
    info = engine.stub.GetInfo(engine_pb2.EngineInfoRequest())
    assert info.max_model_len == MAX_LEN and info.num_blocks == NUM_BLOCKS and info.vocab_size == 49152


def test_session_batches_steps_and_isolates_bad_requests(engine):
    s = EngineSession(engine.stub, timeout=None)
    good = [engine_pb2.EngineRequest(request_id=f"g{i}", prompt_token_ids=[1, 2, 3 + i], sampling_params=greedy(6),
                                     eos_token_ids=[2]) for i in range(3)]
    bad = [
        engine_pb2.EngineRequest(request_id="too-long", prompt_token_ids=[1] * 500, sampling_params=greedy(20)),
        engine_pb2.EngineRequest(request_id="bad-id", prompt_token_ids=[1, 10 ** 7], sampling_params=greedy(4)),
        engine_pb2.EngineRequest(request_id="bad-temp", prompt_token_ids=[1, 2],
                                 sampling_params=common_pb2.SamplingParams(temperature=-1)),
        engine_pb2.EngineRequest(request_id="", prompt_token_ids=[1, 2], sampling_params=greedy(4)),
    ]
    s.add(*good[:1], *bad, *good[1:])
    errors, tokens, finished, multi = {}, {}, set(), 0
    for msg in s.call:
        if sum(1 for o in msg.outputs if o.new_token_ids) > 1:
            multi += 1
        for o in msg.outputs:
            if o.error.code:
                assert o.finish_reason == common_pb2.FINISH_REASON_ERROR
                errors[o.request_id] = (o.error.code, o.error.message)
                continue
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                finished.add(o.request_id)
        if finished == {"g0", "g1", "g2"}:
            break
    s.close()
    assert errors["too-long"][0] == "INVALID_ARGUMENT" and "max_model_len" in errors["too-long"][1]
    assert errors["bad-id"][0] == "INVALID_ARGUMENT" and "vocabulary" in errors["bad-id"][1]
    assert errors["bad-temp"][0] == "INVALID_ARGUMENT" and "temperature" in errors["bad-temp"][1]
    assert errors[""][0] == "INVALID_ARGUMENT" and "request_id" in errors[""][1]
    assert all(1 <= len(tokens[f"g{i}"]) <= 6 for i in range(3))
    assert multi > 0, "one step message should carry several requests"
    wait_engine_idle(engine.stub, seconds=10, require=True)


def test_abort_and_closing_the_session_free_blocks(engine):
    s = EngineSession(engine.stub, timeout=None)
    s.add(*(engine_pb2.EngineRequest(request_id=f"long{i}", prompt_token_ids=[1, 2, 3, 4, 5],
                                     sampling_params=common_pb2.SamplingParams(
                                         temperature=0.8, max_tokens=400, ignore_eos=True))
            for i in range(4)))
    got, aborted, sent = set(), set(), False
    for msg in s.call:
        got |= {o.request_id for o in msg.outputs if o.new_token_ids}
        aborted |= {o.request_id for o in msg.outputs if o.finish_reason == common_pb2.FINISH_REASON_ABORT}
        if not sent and got == {f"long{i}" for i in range(4)}:
            s.abort("long0", "long1")
            sent = True
        if aborted == {"long0", "long1"}:
            break
    stats = engine.stub.GetStats(engine_pb2.GetStatsRequest())
    assert stats.num_running == 2
    s.close()  # the client goes away: the other two are aborted too
    wait_engine_idle(engine.stub, seconds=10, require=True)
