"""The engine's Prometheus metrics and 'request finished' log lines, scraped from a real
engine process after real requests on its Session stream: every counter and histogram
moves by exactly what the stream showed (tokens, prompts, cached tokens, steps,
finish reasons), the gauges follow the scheduler, and /health agrees with gRPC health."""
from __future__ import annotations

import json

import pytest
from grpc_health.v1 import health_pb2

from helpers.metrics_util import health_http, json_lines, scrape, wait_engine_gauges_idle, wait_for
from helpers.stack import EngineSession, engine_service, health_status, wait_engine_idle
from tessera.common.metrics import ITERATION_TOKENS_BUCKETS, REQUEST_LATENCY_BUCKETS
from tessera.v1 import common_pb2, engine_pb2

pytestmark = pytest.mark.integration

NUM_BLOCKS = 24   # 384 tokens: four long requests must preempt
BLOCK_SIZE = 16
MAX_LEN = 256
SUFFIX = "-0123456789ab"  # the frontend's "<client id>-<12 hex>" engine request ids

ENGINE_METRICS = [
    "tessera:num_requests_running", "tessera:num_requests_waiting", "tessera:kv_cache_usage_perc",
    "tessera:prefix_cache_queries_total", "tessera:prefix_cache_hits_total", "tessera:num_preemptions_total",
    "tessera:prompt_tokens_total", "tessera:generation_tokens_total", "tessera:iteration_tokens_total_bucket",
    "tessera:engine_step_duration_seconds_bucket", "tessera:request_queue_time_seconds_bucket",
    "tessera:request_prefill_time_seconds_bucket", "tessera:request_decode_time_seconds_bucket",
    "tessera:request_inference_time_seconds_bucket", "tessera:request_success_total",
    "tessera:request_prompt_tokens_bucket", "tessera:request_generation_tokens_bucket",
    "tessera:cache_config_info",
]


@pytest.fixture(scope="module")
def engine():
    with engine_service("--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                        "--max-model-len", str(MAX_LEN), log_prefix="tessera-engine-metrics-") as service:
        yield service


def request(rid: str, prompt: list[int], max_tokens: int) -> engine_pb2.EngineRequest:
    return engine_pb2.EngineRequest(
        request_id=rid + SUFFIX, prompt_token_ids=prompt,
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def finished_lines(engine) -> dict[str, list[dict]]:
    lines: dict[str, list[dict]] = {}
    for line in json_lines(engine.log_path):
        if line.get("msg") == "request finished":
            lines.setdefault(line["engine_request_id"], []).append(line)
    return lines


def test_metrics_endpoint_and_health_agree(engine):
    assert health_http(engine.metrics_url) == 200
    assert health_status(engine.channel) == health_pb2.HealthCheckResponse.SERVING
    m = scrape(engine.metrics_url)
    missing = [name for name in ENGINE_METRICS if not m.has(name)]
    assert not missing, f"missing from /metrics: {missing}"
    info = engine.stub.GetInfo(engine_pb2.EngineInfoRequest())
    assert m.get("tessera:num_requests_running", model_name=info.model_name) == 0
    assert m.get("tessera:cache_config_info", num_gpu_blocks=str(NUM_BLOCKS), block_size=str(BLOCK_SIZE)) == 1
    for reason in ("stop", "length", "abort", "error"):
        assert m.has("tessera:request_success_total"), reason
        assert ("tessera:request_success_total",
                frozenset({("model_name", info.model_name), ("finished_reason", reason)})) in m.samples
    # vLLM's buckets
    les = sorted(float(dict(ls)["le"]) for (n, ls) in m.samples if n == "tessera:iteration_tokens_total_bucket")
    assert les == [float(b) for b in ITERATION_TOKENS_BUCKETS] + [float("inf")]
    les = sorted(float(dict(ls)["le"]) for (n, ls) in m.samples if n == "tessera:request_queue_time_seconds_bucket")
    assert les == REQUEST_LATENCY_BUCKETS + [float("inf")]


def test_counters_and_histograms_move_by_what_was_streamed(engine):
    wait_engine_idle(engine.stub, seconds=30, require=True)
    before = scrape(engine.metrics_url)
    shared = list(range(100, 140))  # 40 tokens: two full blocks reusable by the prefix cache
    s = EngineSession(engine.stub)
    s.add(request("mA", shared, 8), request("mB", list(range(300, 320)), 8))
    got = s.run({"mA" + SUFFIX, "mB" + SUFFIX})
    s.add(request("mC", shared, 8))  # after mA finished: its prompt blocks are cached
    got.update(s.run({"mC" + SUFFIX}))
    s.close()
    wait_engine_idle(engine.stub, seconds=30, require=True)
    after = wait_engine_gauges_idle(engine.metrics_url)
    d = after - before

    tokens = sum(len(g["tokens"]) for g in got.values())
    prompts = sum(g["prompt"] for g in got.values())
    cached = sum(g["cached"] for g in got.values())
    assert tokens == 24 and prompts == 100
    assert got["mC" + SUFFIX]["cached"] == 32, got  # 39 lookable tokens -> two full blocks
    assert all(g["reason"] == common_pb2.FINISH_REASON_LENGTH for g in got.values())

    assert d.get("tessera:generation_tokens_total") == tokens
    assert d.get("tessera:prompt_tokens_total") == prompts
    assert d.get("tessera:prefix_cache_queries_total") == prompts
    assert d.get("tessera:prefix_cache_hits_total") == cached
    assert d.get("tessera:request_success_total", finished_reason="length") == 3
    assert d.get("tessera:request_success_total", finished_reason="stop") == 0
    assert d.get("tessera:num_preemptions_total") == 0
    for phase in ("queue", "prefill", "decode", "inference"):
        assert d.get(f"tessera:request_{phase}_time_seconds_count") == 3, phase
    assert d.get("tessera:request_decode_time_seconds_sum") > 0
    assert d.get("tessera:request_prompt_tokens_sum") == prompts
    assert d.get("tessera:request_generation_tokens_sum") == tokens
    # every token the model computed: uncached prompt tokens, then one per later decode step
    computed = sum(g["prompt"] - g["cached"] + len(g["tokens"]) - 1 for g in got.values())
    assert d.get("tessera:iteration_tokens_total_sum") == computed
    steps = d.get("tessera:iteration_tokens_total_count")
    assert 8 <= steps <= 24  # mA and mB share steps; mC runs after them
    assert d.get("tessera:engine_step_duration_seconds_count") == steps
    assert d.get("tessera:engine_step_duration_seconds_sum") > 0


def test_gauges_follow_a_running_request_and_abort_is_counted(engine):
    wait_engine_idle(engine.stub, seconds=30, require=True)
    before = scrape(engine.metrics_url)
    s = EngineSession(engine.stub)
    s.add(request("mLong", list(range(500, 520)), 200))
    seen = 0
    during = None
    for msg in s.call:
        seen += sum(len(o.new_token_ids) for o in msg.outputs)
        if seen >= 3 and during is None:
            during = scrape(engine.metrics_url)
            s.abort("mLong" + SUFFIX)
        if any(o.finish_reason == common_pb2.FINISH_REASON_ABORT for o in msg.outputs):
            break
    s.close()
    assert during.get("tessera:num_requests_running") == 1
    assert during.get("tessera:num_requests_waiting") == 0
    assert 0 < during.get("tessera:kv_cache_usage_perc") <= 1
    after = wait_engine_gauges_idle(engine.metrics_url)
    d = after - before
    assert d.get("tessera:request_success_total", finished_reason="abort") == 1
    assert d.get("tessera:generation_tokens_total") == seen


def test_preemptions_are_counted(engine):
    wait_engine_idle(engine.stub, seconds=30, require=True)
    before_stats = engine.stub.GetStats(engine_pb2.GetStatsRequest())
    before = scrape(engine.metrics_url)
    s = EngineSession(engine.stub)
    # 4 x (30 + 120) tokens need 40 blocks of 16; the pool has 24
    ids = {f"mP{i}" + SUFFIX for i in range(4)}
    s.add(*(request(f"mP{i}", list(range(1000 + 40 * i, 1030 + 40 * i)), 120) for i in range(4)))
    got = s.run(ids)
    s.close()
    wait_engine_idle(engine.stub, seconds=30, require=True)
    after = wait_engine_gauges_idle(engine.metrics_url)
    stats = engine.stub.GetStats(engine_pb2.GetStatsRequest())
    d = after - before
    preempted = stats.num_preemptions - before_stats.num_preemptions
    assert preempted > 0
    assert d.get("tessera:num_preemptions_total") == preempted
    assert d.get("tessera:generation_tokens_total") == sum(len(g["tokens"]) for g in got.values()) == 480
    assert d.get("tessera:request_success_total", finished_reason="length") == 4


def test_rejected_requests_count_as_error(engine):
    before = scrape(engine.metrics_url)
    s = EngineSession(engine.stub)
    s.add(engine_pb2.EngineRequest(request_id="mBad" + SUFFIX, prompt_token_ids=[1, 10 ** 7],
                                   sampling_params=common_pb2.SamplingParams(max_tokens=4)))
    got = s.run({"mBad" + SUFFIX})
    s.close()
    assert got["mBad" + SUFFIX]["reason"] == common_pb2.FINISH_REASON_ERROR
    d = wait_for(lambda: (lambda x: x if x.get("tessera:request_success_total", finished_reason="error") else None)(
        scrape(engine.metrics_url) - before), 5, "the error to be counted")
    assert d.get("tessera:request_success_total", finished_reason="error") == 1


def test_one_structured_finished_line_per_request(engine):
    # the requests of the tests above have been logged by now
    lines = wait_for(lambda: (lambda ls: ls if "mBad" + SUFFIX in ls else None)(finished_lines(engine)),
                     5, "the log lines")
    for rid in ("mA", "mB", "mC", "mLong", "mP0", "mBad"):
        assert len(lines[rid + SUFFIX]) == 1, (rid, lines.get(rid + SUFFIX))
    a = lines["mA" + SUFFIX][0]
    assert a["request_id"] == "mA" and a["service"] == "engine" and a["level"] == "INFO"
    assert a["finish_reason"] == "length" and a["prompt_tokens"] == 40 and a["generation_tokens"] == 8
    assert a["cached_tokens"] == 0
    for key in ("queue_s", "prefill_s", "decode_s", "inference_s"):
        assert a[key] >= 0, key
    assert a["decode_s"] > 0
    assert lines["mC" + SUFFIX][0]["cached_tokens"] == 32
    assert lines["mLong" + SUFFIX][0]["finish_reason"] == "abort"
    bad = lines["mBad" + SUFFIX][0]
    assert bad["finish_reason"] == "error" and bad["error_code"] == "INVALID_ARGUMENT"
    # nothing else logs per request at INFO
    per_request = [json.dumps(x) for x in json_lines(engine.log_path)
                   if x.get("level") == "INFO" and "mA" in json.dumps(x)]
    assert len(per_request) == 1, per_request
