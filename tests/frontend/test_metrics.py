"""Metrics and request-scoped logs through the real three-service stack.

The first test needs only the engine and tokenizer metrics: after real Generate calls
through the frontend, the engine's generation-token counter moved by exactly the tokens
the client received, the tokenizer's counters by the prompt and streamed tokens, and every
service logged the request under the client's request id.

The frontend's own metrics (tessera_frontend/metrics.py, on --metrics-port /
TESSERA_METRICS_PORT) are checked by the rest, for the gRPC API and the OpenAI HTTP API.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import grpc
import pytest

from helpers.metrics_util import health_http, json_lines, scrape, try_scrape, wait_engine_gauges_idle, wait_for
from helpers.stack import stack  # noqa: F401  (the session fixture)
from tessera.common.metrics import ITL_BUCKETS, TTFT_BUCKETS
from tessera.v1 import common_pb2, frontend_pb2, tokenizer_pb2

pytestmark = pytest.mark.integration

QUESTION = "Name three colors of the rainbow."


def _request(request_id: str = "", max_tokens: int = 10, **params) -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(
        request_id=request_id,
        chat=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=QUESTION)]),
        sampling_params=common_pb2.SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens,
                                                     "ignore_eos": True, **params}))


def _generate(stack, request) -> list[frontend_pb2.GenerateResponse]:
    return list(stack.frontend_stub.Generate(request, timeout=120))


def test_backend_counters_match_what_the_client_streamed(stack):
    wait_engine_gauges_idle(stack.engine.metrics_url)
    engine_before = scrape(stack.engine.metrics_url)
    tokenizer_before = scrape(stack.tokenizer.metrics_url)
    rid = f"obs-{uuid.uuid4().hex[:8]}"
    streamed = prompt_tokens = 0
    for i in range(3):
        responses = _generate(stack, _request(f"{rid}-{i}", max_tokens=6 + i))
        streamed += sum(len(r.token_ids) for r in responses)
        prompt_tokens += responses[-1].usage.prompt_tokens
        assert responses[-1].usage.completion_tokens == 6 + i
    assert streamed == 6 + 7 + 8
    engine = wait_engine_gauges_idle(stack.engine.metrics_url) - engine_before

    assert engine.get("tessera:generation_tokens_total") == streamed
    assert engine.get("tessera:prompt_tokens_total") == prompt_tokens
    assert engine.get("tessera:request_success_total", finished_reason="length") == 3
    assert engine.get("tessera:request_generation_tokens_sum") == streamed

    def tokenizer_settled():
        d = scrape(stack.tokenizer.metrics_url) - tokenizer_before
        return d if d.get("tessera:detokenize_requests_total", outcome="finished") == 3 else None
    tokenizer = wait_for(tokenizer_settled, 5, "the tokenizer to count the finished requests")
    assert tokenizer.get("tessera:tokenizer_tokens_total", op="tokenize") == prompt_tokens
    assert tokenizer.get("tessera:tokenizer_tokens_total", op="detokenize") == streamed
    assert tokenizer.get("tessera:tokenizer_requests_total", method="TokenizeStream", code="OK") == 3

    # one structured line per request in the engine and the tokenizer, under the client's id
    for i in range(3):
        client_id = f"{rid}-{i}"

        def lines_of(service, msg):
            return [x for x in json_lines(service.log_path) if x.get("request_id") == client_id
                    and x.get("msg") == msg]
        engine_lines = wait_for(lambda: lines_of(stack.engine, "request finished"), 5, "the engine's line")
        assert len(engine_lines) == 1 and engine_lines[0]["generation_tokens"] == 6 + i
        assert engine_lines[0]["engine_request_id"].startswith(client_id + "-")
        tok_lines = wait_for(lambda: lines_of(stack.tokenizer, "detokenize request ended"), 5, "the tokenizer's line")
        assert len(tok_lines) == 1 and tok_lines[0]["tokens"] == 6 + i
        assert any(x.get("request_id") == client_id for x in json_lines(stack.frontend.log_path)), \
            "the frontend logs the request id"


# --- the frontend's own metrics -----------------------------------------------------------------

@pytest.fixture
def frontend_metrics(stack):
    m = try_scrape(stack.frontend.metrics_url)
    assert m is not None, f"the frontend serves no /metrics at {stack.frontend.metrics_url}"
    return m


def test_frontend_metrics_endpoint_and_health(stack, frontend_metrics):
    m = frontend_metrics
    assert health_http(stack.frontend.metrics_url) == 200
    for name in ("tessera:time_to_first_token_seconds_bucket", "tessera:inter_token_latency_seconds_bucket",
                 "tessera:request_time_per_output_token_seconds_bucket", "tessera:e2e_request_latency_seconds_bucket",
                 "tessera:requests_total", "tessera:requests_in_flight"):
        assert m.has(name), name
    les = sorted(float(dict(ls)["le"]) for (n, ls) in m.samples
                 if n == "tessera:time_to_first_token_seconds_bucket" and ("api", "grpc") in ls)
    assert les == TTFT_BUCKETS + [float("inf")]
    les = sorted(float(dict(ls)["le"]) for (n, ls) in m.samples
                 if n == "tessera:inter_token_latency_seconds_bucket" and ("api", "grpc") in ls)
    assert les == ITL_BUCKETS + [float("inf")]


def test_frontend_latency_histograms_and_status_codes(stack, frontend_metrics):
    before = frontend_metrics
    rid = f"fm-{uuid.uuid4().hex[:8]}"
    itl_expected = 0
    for i in range(3):
        responses = _generate(stack, _request(f"{rid}-{i}", max_tokens=5 + i))
        with_tokens = [r for r in responses if r.token_ids]
        itl_expected += len(with_tokens) - 1
    stack.frontend_stub.Complete(_request(f"{rid}-c", max_tokens=4), timeout=120)
    with pytest.raises(grpc.RpcError) as bad:
        _generate(stack, _request(f"{rid}-bad", max_tokens=4, temperature=-1.0))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def settled():
        d = scrape(stack.frontend.metrics_url) - before
        return d if d.get("tessera:requests_total", api="grpc") >= 5 else None
    d = wait_for(settled, 5, "the frontend to count the requests")
    assert d.get("tessera:requests_total", api="grpc", code="OK") == 4
    assert d.get("tessera:requests_total", api="grpc", code="INVALID_ARGUMENT") == 1
    assert d.get("tessera:time_to_first_token_seconds_count", api="grpc") == 4
    assert d.get("tessera:e2e_request_latency_seconds_count", api="grpc") == 4
    assert d.get("tessera:request_time_per_output_token_seconds_count", api="grpc") == 4
    # Complete's outputs are counted the same way; Generate's are one per streamed message
    assert d.get("tessera:inter_token_latency_seconds_count", api="grpc") >= itl_expected
    assert 0 < d.get("tessera:e2e_request_latency_seconds_sum", api="grpc")
    assert d.get("tessera:time_to_first_token_seconds_sum", api="grpc") < \
        d.get("tessera:e2e_request_latency_seconds_sum", api="grpc")
    after = scrape(stack.frontend.metrics_url)
    assert after.get("tessera:requests_in_flight", api="grpc") == 0
    lines = [x for x in json_lines(stack.frontend.log_path)
             if x.get("msg") == "request finished" and x.get("request_id", "").startswith(rid)]
    assert len(lines) == 5, lines
    assert {x["code"] for x in lines} == {"OK", "INVALID_ARGUMENT"}


def _post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_frontend_http_metrics(stack, frontend_metrics):
    """The OpenAI API's requests are counted under api="http", by HTTP status."""
    before = frontend_metrics
    rid = f"fh-{uuid.uuid4().hex[:8]}"
    chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    status, body = _post(stack.http_url + "/v1/chat/completions", {**chat, "request_id": f"{rid}-whole"})
    assert status == 200, body
    status, body = _post(stack.http_url + "/v1/chat/completions", {**chat, "stream": True, "request_id": f"{rid}-s"})
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]"), body
    streamed_chunks = body.count(b'"delta"')
    status, body = _post(stack.http_url + "/v1/chat/completions", {**chat, "temperature": -1})
    assert status == 400 and b"temperature" in body, body

    def settled():
        d = scrape(stack.frontend.metrics_url) - before
        return d if d.get("tessera:requests_total", api="http") >= 3 else None
    d = wait_for(settled, 5, "the frontend to count the HTTP requests")
    assert d.get("tessera:requests_total", api="http", code="200") == 2
    assert d.get("tessera:requests_total", api="http", code="400") == 1
    assert d.get("tessera:requests_total", api="grpc") == 0
    assert d.get("tessera:time_to_first_token_seconds_count", api="http") == 2
    assert d.get("tessera:e2e_request_latency_seconds_count", api="http") == 2
    assert d.get("tessera:inter_token_latency_seconds_count", api="http") >= 4  # 5 tokens: >= 4 gaps per request
    assert streamed_chunks >= 5
    after = scrape(stack.frontend.metrics_url)
    assert after.get("tessera:requests_in_flight", api="http") == 0
    lines = [x for x in json_lines(stack.frontend.log_path)
             if x.get("msg") == "request finished" and x.get("request_id", "").startswith(rid)]
    assert sorted(x["code"] for x in lines) == ["200", "200"], lines
