"""The tokenizer's Prometheus metrics and per-request log lines, scraped from a real
tokenizer process after real calls: tokenize / detokenize latency counts, tokens
processed, calls by status code, open streams and requests, how stream requests ended."""
from __future__ import annotations

import pathlib
import queue
import tempfile
import time

import grpc
import pytest

from helpers.metrics_util import health_http, json_lines, scrape, wait_for
from helpers.stack import Service, free_port
from tessera.v1 import tokenizer_pb2 as pb
from tessera.v1 import tokenizer_pb2_grpc

pytestmark = pytest.mark.integration

SUFFIX = "-00112233aabb"  # the frontend's "<client id>-<12 hex>" stream request ids

TOKENIZER_METRICS = [
    "tessera:tokenize_duration_seconds_bucket", "tessera:detokenize_duration_seconds_bucket",
    "tessera:tokenizer_tokens_total", "tessera:tokenizer_requests_total", "tessera:detokenize_streams_active",
    "tessera:detokenize_requests_active", "tessera:detokenize_requests_total",
]


@pytest.fixture(scope="module")
def tokenizer():
    log = pathlib.Path(tempfile.mkdtemp(prefix="tessera-tokenizer-metrics-")) / "tokenizer.log"
    svc = Service("tokenizer", "tessera_tokenizer", free_port(), [], log)
    svc.start()
    channel = grpc.insecure_channel(svc.addr)

    svc.wait_serving(time.monotonic() + 120)
    svc.stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
    yield svc
    channel.close()
    svc.stop()


def test_metrics_endpoint_and_health(tokenizer):
    assert health_http(tokenizer.metrics_url) == 200
    m = scrape(tokenizer.metrics_url)
    missing = [n for n in TOKENIZER_METRICS if not m.has(n)]
    assert not missing, f"missing from /metrics: {missing}"


def test_unary_calls(tokenizer):
    stub = tokenizer.stub
    before = scrape(tokenizer.metrics_url)
    texts = ["Hello there, world!", "Prometheus counts tokens.", "数据 🚀 naïve"]
    counts = [len(stub.Tokenize(pb.TokenizeRequest(text=t)).token_ids) for t in texts]
    chat = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])))
    with pytest.raises(grpc.RpcError) as bad:
        stub.Tokenize(pb.TokenizeRequest())
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ids = list(chat.token_ids)
    stub.Detokenize(pb.DetokenizeRequest(token_ids=ids))
    d = scrape(tokenizer.metrics_url) - before

    assert d.get("tessera:tokenizer_tokens_total", op="tokenize") == sum(counts) + len(ids)
    assert d.get("tessera:tokenize_duration_seconds_count", input="text") == 3
    assert d.get("tessera:tokenize_duration_seconds_count", input="chat") == 1
    assert d.get("tessera:tokenize_duration_seconds_sum") > 0
    assert d.get("tessera:tokenizer_requests_total", method="Tokenize", code="OK") == 4
    assert d.get("tessera:tokenizer_requests_total", method="Tokenize", code="INVALID_ARGUMENT") == 1
    assert d.get("tessera:tokenizer_requests_total", method="Detokenize", code="OK") == 1
    assert d.get("tessera:detokenize_duration_seconds_count", method="unary") == 1
    assert d.get("tessera:tokenizer_tokens_total", op="detokenize") == len(ids)


def test_tokenize_stream_items(tokenizer):
    """Each TokenizeStream item counts as a Tokenize call does: by status, timed, its tokens counted."""
    before = scrape(tokenizer.metrics_url)
    requests = [pb.TokenizeRequest(text="Hello there, world!"), pb.TokenizeRequest(),
                pb.TokenizeRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]))]
    message = pb.TokenizeStreamRequest(items=[pb.TokenizeItem(id=i, request=r) for i, r in enumerate(requests)])
    results = [r for reply in tokenizer.stub.TokenizeStream(iter([message]), timeout=30) for r in reply.results]
    d = scrape(tokenizer.metrics_url) - before

    assert d.get("tessera:tokenizer_requests_total", method="TokenizeStream", code="OK") == 2
    assert d.get("tessera:tokenizer_requests_total", method="TokenizeStream", code="INVALID_ARGUMENT") == 1
    assert d.get("tessera:tokenize_duration_seconds_count", input="text") == 1
    assert d.get("tessera:tokenize_duration_seconds_count", input="chat") == 1
    assert d.get("tessera:tokenizer_tokens_total", op="tokenize") == sum(len(r.response.token_ids) for r in results) > 0


def test_stream_gauges_tokens_and_outcomes(tokenizer):
    stub = tokenizer.stub
    ids = list(stub.Tokenize(pb.TokenizeRequest(text="The quick brown fox jumps over the lazy dog")).token_ids)
    before = scrape(tokenizer.metrics_url)
    inbox: queue.Queue = queue.Queue()
    call = stub.DetokenizeStream(iter(inbox.get, None), timeout=60)

    def send(*items: pb.DetokenizeItem) -> pb.DetokenizeStreamResponse:
        inbox.put(pb.DetokenizeStreamRequest(items=list(items)))
        return next(call)

    def item(rid, tokens=(), **kw):
        return pb.DetokenizeItem(request_id=rid + SUFFIX, new_token_ids=list(tokens), **kw)

    sent = 0
    send(item("sA", ids[:3], open=pb.DetokenizeOpen()), item("sB", ids[:2], open=pb.DetokenizeOpen()),
         item("sS", ids[:2], open=pb.DetokenizeOpen(stop=["fox"])))
    sent += 7
    during = scrape(tokenizer.metrics_url)
    assert during.get("tessera:detokenize_streams_active") == before.get("tessera:detokenize_streams_active") + 1
    assert during.get("tessera:detokenize_requests_active") - before.get("tessera:detokenize_requests_active") == 3
    reply = send(item("sA", ids[3:], finished=True), item("sB", ids[2:4], cancel=True), item("sS", ids[2:6]))
    sent += len(ids[3:]) + 2 + 4
    assert reply.results[2].stop_matched == "fox"
    send(item("sOpen", ids[:1], open=pb.DetokenizeOpen()))
    sent += 1
    inbox.put(None)  # the stream ends with sOpen still open
    assert list(call) == []

    def settled():
        m = scrape(tokenizer.metrics_url)
        return m if m.get("tessera:detokenize_streams_active") == before.get("tessera:detokenize_streams_active") \
            else None
    d = wait_for(settled, 5, "the stream to close") - before
    assert d.get("tessera:detokenize_requests_active") == 0
    assert d.get("tessera:detokenize_duration_seconds_count", method="stream") == 3
    assert d.get("tessera:tokenizer_tokens_total", op="detokenize") == sent
    for outcome in ("finished", "cancel", "stop", "stream_closed"):
        assert d.get("tessera:detokenize_requests_total", outcome=outcome) == 1, outcome
    assert d.get("tessera:detokenize_requests_total", outcome="error") == 0

    # one structured line per request, under the client's request id
    def ended():
        lines = [x for x in json_lines(tokenizer.log_path) if x.get("msg") == "detokenize request ended"]
        got = {x["request_id"]: x for x in lines if x["request_id"] in ("sA", "sB", "sS", "sOpen")}
        return got if len(got) == 4 else None
    lines = wait_for(ended, 5, "the per-request log lines")
    assert lines["sA"]["outcome"] == "finished" and lines["sA"]["tokens"] == len(ids)
    assert lines["sA"]["engine_request_id"] == "sA" + SUFFIX and lines["sA"]["service"] == "tokenizer"
    assert lines["sA"]["text_chars"] == len("The quick brown fox jumps over the lazy dog")
    assert lines["sB"]["outcome"] == "cancel"
    assert lines["sS"]["outcome"] == "stop" and lines["sS"]["stop_matched"] == "fox"
    assert lines["sOpen"]["outcome"] == "stream_closed"
