"""OpenTelemetry tracing through the three services, against an in-process OTLP/gRPC receiver.

The stack runs with OTEL_EXPORTER_OTLP_TRACES_ENDPOINT pointing at a grpc server implementing
opentelemetry's TraceService/Export in this process; a streamed request sent with the client's
own W3C traceparent (an HTTP header, then gRPC metadata) must come back as one trace:
client span > frontend handler > admission, generate > queueing, tokenize (client) >
tokenizer tokenize (> chat_template) ; generate > engine > queued, prefill, decode.
A second frontend with OTEL_SDK_DISABLED=true in front of the same backends sends nothing.
"""
from __future__ import annotations

import secrets
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from helpers.stack import Service, all_serving, frontend_service
from tessera import launch
from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SPAN_WAIT_S = 20.0  # the exporters' batches arrive within OTEL_BSP_SCHEDULE_DELAY (100 ms) of a span's end


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector in this process: every span exported to it, flattened."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(_flat(span, attrs.get("service.name", "")))
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, trace_id: str, wanted: set[tuple[str, str]]) -> list[dict]:
        """The trace's spans once every (service, name) of `wanted` is among them."""
        deadline = time.monotonic() + SPAN_WAIT_S
        while True:
            spans = self.of_trace(trace_id)
            missing = wanted - {(s["service"], s["name"]) for s in spans}
            if not missing:
                return spans
            assert time.monotonic() < deadline, f"spans never arrived: {sorted(missing)}; got {_names(spans)}"
            time.sleep(0.1)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _flat(span, service: str) -> dict:
    return {"service": service, "name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
            "parent": span.parent_span_id.hex(), "kind": span.kind, "start": span.start_time_unix_nano,
            "end": span.end_time_unix_nano, "status": span.status.code,
            "attrs": {a.key: _value(a.value) for a in span.attributes}}


def _names(spans: list[dict]) -> list[str]:
    return sorted(f"{s['service']}:{s['name']}" for s in spans)


@pytest.fixture(scope="module")
def receiver():
    collector = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port(f"{launch.HOST}:0")
    server.start()
    collector.endpoint = f"http://{launch.HOST}:{port}"
    yield collector
    server.stop(0)


@pytest.fixture(scope="module")
def traced(receiver):
    """A stack whose three services export to `receiver`, and a frontend with tracing off
    (OTEL_SDK_DISABLED=true, the same endpoint set) in front of the same backends."""
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_SERVICE_NAME": ""}
    stack = launch.Stack(service_class=Service, env=env)
    untraced = frontend_service("frontend-untraced", stack.tokenizer.addr, stack.engine.addr, stack.log_dir)
    untraced.env.update(env, OTEL_SDK_DISABLED="true")
    with all_serving(*stack.services, untraced):
        stack.untraced = untraced
        yield stack


def _client_span() -> tuple[str, str, str]:
    """A client's own span: (trace id, span id, its traceparent)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _by_name(spans: list[dict], service: str, name: str) -> list[dict]:
    return [s for s in spans if s["service"] == service and s["name"] == name]


def _one(spans: list[dict], service: str, name: str) -> dict:
    found = _by_name(spans, service, name)
    assert len(found) == 1, f"{service}:{name}: {len(found)} spans in {_names(spans)}"
    return found[0]


def _child(spans: list[dict], parent: dict, service: str, name: str) -> dict:
    span = _one(spans, service, name)
    assert span["parent"] == parent["span_id"], f"{service}:{name} is not a child of {parent['name']}"
    assert parent["start"] <= span["start"] + 1_000_000 and span["end"] <= parent["end"] + 1_000_000, \
        f"{service}:{name} [{span['start']}, {span['end']}] outside {parent['name']} [{parent['start']}, {parent['end']}]"
    return span


def _check_request_tree(spans: list[dict], handler: dict, request_id: str, completion_tokens: int,
                        chat: bool) -> None:
    """The tree under the frontend's handler span, and the engine's phases."""
    generate = _child(spans, handler, "tessera-frontend", "generate")
    admission = _child(spans, handler, "tessera-frontend", "admission")
    assert admission["attrs"]["tessera.admission.admitted"] is True
    assert generate["attrs"]["gen_ai.request.id"] == request_id
    assert generate["attrs"]["gen_ai.usage.output_tokens"] == completion_tokens
    _child(spans, generate, "tessera-frontend", "queueing")
    tokenize_client = _child(spans, generate, "tessera-frontend", "tokenize")
    tokenize = _child(spans, tokenize_client, "tessera-tokenizer", "tokenize")
    assert tokenize["attrs"]["gen_ai.request.id"] == request_id
    if chat:
        _child(spans, tokenize, "tessera-tokenizer", "chat_template")
    else:
        assert not _by_name(spans, "tessera-tokenizer", "chat_template")

    engine = _child(spans, generate, "tessera-engine", "engine")
    assert engine["attrs"]["gen_ai.request.id"].startswith(request_id + "-")
    assert engine["attrs"]["gen_ai.usage.output_tokens"] == completion_tokens
    assert engine["attrs"]["gen_ai.usage.input_tokens"] > 0
    queued = _child(spans, engine, "tessera-engine", "queued")
    prefill = _child(spans, engine, "tessera-engine", "prefill")
    decode = _child(spans, engine, "tessera-engine", "decode")
    # the phases follow each other: received, first scheduled, first token, last token
    assert queued["start"] == engine["start"] and queued["end"] == prefill["start"]
    assert prefill["end"] == decode["start"] <= decode["end"] <= engine["end"]
    assert prefill["attrs"]["tessera.prefill.tokens"] + prefill["attrs"]["tessera.prefill.cached_tokens"] \
        == engine["attrs"]["gen_ai.usage.input_tokens"]
    assert decode["attrs"]["tessera.decode.tokens"] == completion_tokens - 1
    # one decode step a token (no speculation, nothing preempted): every step it took part in counted
    assert decode["attrs"]["tessera.decode.steps"] == completion_tokens - 1
    assert prefill["attrs"]["tessera.prefill.steps"] >= 1
    assert engine["attrs"]["tessera.steps"] == prefill["attrs"]["tessera.prefill.steps"] + completion_tokens - 1
    assert decode["end"] - prefill["start"] < 60e9  # plausible: a short request, not clock garbage
    # nothing of this request went to another trace
    assert all(s["parent"] for s in spans), "a span of the request started a trace of its own"


def test_http_stream_continues_the_clients_trace(traced, receiver):
    import openai

    trace_id, client_span_id, traceparent = _client_span()
    request_id = "trace-http-" + secrets.token_hex(4)
    client = openai.OpenAI(base_url=traced.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_headers={"traceparent": traceparent, "x-request-id": request_id})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens >= 1

    spans = receiver.wait_for(trace_id, {("tessera-frontend", "POST /v1/chat/completions"),
                                         ("tessera-engine", "decode"), ("tessera-tokenizer", "chat_template")})
    handler = _one(spans, "tessera-frontend", "POST /v1/chat/completions")
    assert handler["parent"] == client_span_id  # the client's span is its parent
    assert handler["attrs"]["http.response.status_code"] == 200
    _check_request_tree(spans, handler, request_id, usage.completion_tokens, chat=True)


def test_grpc_stream_continues_the_clients_trace(traced, receiver):
    trace_id, client_span_id, traceparent = _client_span()
    request_id = "trace-grpc-" + secrets.token_hex(4)
    with grpc.insecure_channel(traced.frontend.addr, options=CHANNEL_OPTIONS) as channel:
        responses = list(frontend_pb2_grpc.FrontendServiceStub(channel).Generate(
            frontend_pb2.GenerateRequest(request_id=request_id, text="The capital of France is",
                                         sampling_params=common_pb2.SamplingParams(max_tokens=6, temperature=0)),
            timeout=120, metadata=[("traceparent", traceparent)]))
    usage = responses[-1].usage
    assert usage.completion_tokens >= 1

    spans = receiver.wait_for(trace_id, {("tessera-frontend", "tessera.v1.FrontendService/Generate"),
                                         ("tessera-engine", "decode"), ("tessera-tokenizer", "tokenize")})
    handler = _one(spans, "tessera-frontend", "tessera.v1.FrontendService/Generate")
    assert handler["parent"] == client_span_id
    assert handler["attrs"]["rpc.system"] == "grpc"
    _check_request_tree(spans, handler, request_id, usage.completion_tokens, chat=False)


def test_no_span_when_tracing_is_off(traced, receiver):
    """Through the frontend with OTEL_SDK_DISABLED=true: no span of the request, from any
    service (the traced backends get no traceparent, so they record nothing either)."""
    trace_id, _, traceparent = _client_span()
    time.sleep(1.0)  # the earlier tests' last batches are in
    with receiver.lock:
        before = len(receiver.spans)
    with grpc.insecure_channel(traced.untraced.addr, options=CHANNEL_OPTIONS) as channel:
        responses = list(frontend_pb2_grpc.FrontendServiceStub(channel).Generate(
            frontend_pb2.GenerateRequest(text="Hello", sampling_params=common_pb2.SamplingParams(max_tokens=4)),
            timeout=120, metadata=[("traceparent", traceparent)]))
    assert responses[-1].usage.completion_tokens >= 1
    time.sleep(1.0)  # ten export intervals
    with receiver.lock:
        arrived = receiver.spans[before:]
    assert receiver.of_trace(trace_id) == []
    assert arrived == [], f"spans arrived with tracing off: {_names(arrived)}"
