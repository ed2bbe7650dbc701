"""tessera.common.tracing: when tracing is on, nothing when off, the context carried in
headers, metadata and proto fields, the spans it builds (the engine's from timestamps)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import types

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tessera.common import tracing

pytestmark = pytest.mark.unit

ENDPOINT = "http://127.0.0.1:4317"


# --- when it is on ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, env, expected", [
    (None, {}, None),                                                           # the default: off
    (ENDPOINT, {}, ("otlp", ENDPOINT)),                                         # --otlp-traces-endpoint
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT}, ("otlp", ENDPOINT)),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ("otlp", ENDPOINT)),
    (None, {"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp", None)),                   # the SDK's default endpoint
    (None, {"OTEL_TRACES_EXPORTER": "console"}, ("console", None)),
    (ENDPOINT, {"OTEL_TRACES_EXPORTER": "none"}, None),
    (ENDPOINT, {"OTEL_SDK_DISABLED": "true"}, None),
    (None, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"}, None),
    (ENDPOINT, {"OTEL_SDK_DISABLED": "false"}, ("otlp", ENDPOINT)),
    (ENDPOINT, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ("otlp", ENDPOINT)),
])
def test_resolve(flag, env, expected):
    assert tracing.resolve(flag, env) == expected


@pytest.mark.parametrize("env, named", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
])
def test_resolve_names_a_bad_variable(env, named):
    with pytest.raises(tracing.TracingConfigError, match=named):
        tracing.resolve(None, env)


def test_flag_falls_back_to_the_otel_variable(monkeypatch):
    import argparse
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ENDPOINT)
    parser = argparse.ArgumentParser()
    tracing.add_tracing_flags(parser)
    assert parser.parse_args([]).otlp_traces_endpoint == ENDPOINT
    assert parser.parse_args(["--otlp-traces-endpoint", "http://h:1"]).otlp_traces_endpoint == "http://h:1"


def test_off_imports_no_sdk_and_builds_nothing():
    """A process without OTEL configuration: setup says no, the SDK is never imported, and every
    helper is a no-op."""
    code = """
import sys
from tessera.common import tracing
assert tracing.setup("frontend") is False and not tracing.ENABLED
assert tracing.current_traceparent() == ""
assert tracing.start_span("x") is None and tracing.record_span("x", 0.0, 1.0) is None
assert tracing.grpc_server_interceptors() == []
with tracing.remote_span("x", "00-" + "1" * 32 + "-" + "2" * 16 + "-01") as s, tracing.child_span("y") as c:
    assert s is None and c is None
assert tracing.inject_metadata([("a", "b")]) == [("a", "b")]
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk") or m.startswith("opentelemetry.exporter"))
assert not loaded, loaded
print("ok")
"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# --- on: spans into memory ------------------------------------------------------------------------

@pytest.fixture
def spans(monkeypatch):
    """Tracing on for this test, exporting into memory; `spans()` flushes and lists them."""
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    exporter = InMemorySpanExporter()
    assert tracing.setup("engine", exporter=exporter)

    def finished():
        tracing.flush()
        return list(exporter.get_finished_spans())

    yield finished
    tracing.shutdown()
    assert not tracing.ENABLED


def _hex(span) -> tuple[str, str]:
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def _parent_id(span) -> str:
    return f"{span.parent.span_id:016x}" if span.parent is not None else ""


TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"


def test_remote_span_continues_a_proto_fields_traceparent(spans):
    with tracing.remote_span("tokenize", TRACEPARENT, {"gen_ai.request.id": "r1"}) as span:
        assert tracing.current_traceparent() == f"00-{TRACE_ID}-{_hex(span)[1]}-01"
        with tracing.child_span("chat_template"):
            pass
    child, parent = spans()
    assert (child.name, parent.name) == ("chat_template", "tokenize")
    assert _hex(parent)[0] == TRACE_ID and _parent_id(parent) == SPAN_ID and parent.kind == SpanKind.SERVER
    assert _hex(child)[0] == TRACE_ID and _parent_id(child) == _hex(parent)[1]
    assert parent.attributes["gen_ai.request.id"] == "r1"
    assert parent.resource.attributes["service.name"] == "tessera-engine"


def test_child_span_needs_a_recording_parent(spans):
    with tracing.child_span("chat_template") as span:
        assert span is None
    assert spans() == []


def test_a_malformed_traceparent_starts_a_new_trace(spans):
    with tracing.remote_span("tokenize", "00-not-a-trace-01"):
        pass
    (span,) = spans()
    assert span.parent is None


def test_span_records_an_error(spans):
    with pytest.raises(ValueError):
        with tracing.span("work"):
            raise ValueError("bad")
    (span,) = spans()
    assert span.status.status_code == StatusCode.ERROR and "bad" in span.status.description


def test_metadata_and_headers_carry_the_context(spans):
    with tracing.span("client") as client:
        metadata = tracing.inject_metadata([("x-request-id", "r")])
    assert metadata[0] == ("x-request-id", "r") and metadata[1][0] == "traceparent"
    for context in (tracing.extract_metadata(metadata),
                    tracing.extract_headers([(b"traceparent", metadata[1][1].encode()), (b"host", b"h")])):
        server = tracing.start_span("server", context, "server")
        tracing.end(server)
        assert _parent_id(server) == _hex(client)[1] and _hex(server)[0] == _hex(client)[0]


def test_record_span_uses_the_timestamps(spans):
    tracing.record_span("queueing", 100.0, 100.25, TRACEPARENT, {"a": 1})
    (span,) = spans()
    assert (span.start_time, span.end_time) == (100_000_000_000, 100_250_000_000)
    assert _parent_id(span) == SPAN_ID


def test_traced_stream_is_current_in_every_step_and_ends_with_the_consumer(spans):
    seen = []

    @tracing.traced_stream("generate", attributes=lambda rid: {"gen_ai.request.id": rid},
                           on_item=lambda span, item: span.set_attribute("last", item))
    async def generate(rid):
        for i in range(3):
            seen.append(tracing.current_traceparent())
            await asyncio.sleep(0)
            yield i

    async def consume():
        outer = tracing.current_traceparent()
        items = [item async for item in generate("r1")]
        assert tracing.current_traceparent() == outer == ""  # nothing leaks into the consumer
        gen = generate("r2")  # closed early, from another task
        assert await gen.__anext__() == 0
        await asyncio.create_task(gen.aclose())
        return items

    assert asyncio.run(consume()) == [0, 1, 2]
    first, second = spans()
    assert first.attributes == {"gen_ai.request.id": "r1", "last": 2}
    assert len(set(seen[:3])) == 1 and _hex(first)[1] in seen[0]
    assert second.attributes["tessera.cancelled"] is True and second.status.status_code == StatusCode.UNSET


def test_traced_stream_records_the_generators_error(spans):
    @tracing.traced_stream("generate")
    async def generate():
        yield 1
        raise RuntimeError("engine lost")

    async def consume():
        with pytest.raises(RuntimeError):
            async for _ in generate():
                pass

    asyncio.run(consume())
    (span,) = spans()
    assert span.status.status_code == StatusCode.ERROR


def test_traced_coroutine_is_the_current_span(spans):
    @tracing.traced("tokenize", kind="client")
    async def tokenize():
        return tracing.current_traceparent()

    traceparent = asyncio.run(tokenize())
    (span,) = spans()
    assert span.kind == SpanKind.CLIENT and traceparent.startswith(f"00-{_hex(span)[0]}-{_hex(span)[1]}-")


def test_asgi_middleware_spans_a_request_and_its_status(spans):
    async def app(scope, receive, send):
        traced = scope["path"] != "/health"
        assert tracing.current_traceparent().startswith(f"00-{TRACE_ID}-") == traced
        await send({"type": "http.response.start", "status": 503})
        await send({"type": "http.response.body", "body": b""})

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"traceparent", TRACEPARENT.encode())]}
    asyncio.run(tracing.AsgiTracingMiddleware(app)(scope, None, send))
    asyncio.run(tracing.AsgiTracingMiddleware(app)({**scope, "path": "/health"}, None, send))  # not traced
    (span,) = spans()
    assert span.name == "POST /v1/completions" and span.kind == SpanKind.SERVER and _parent_id(span) == SPAN_ID
    assert span.attributes["http.response.status_code"] == 503 and span.status.status_code == StatusCode.ERROR
    assert len(sent) == 4


def _finished_output(request_id: str, index: int, timing, reason: str = "length", error=None):
    return types.SimpleNamespace(request_id=request_id, index=index, finish_reason=reason, num_prompt_tokens=10,
                                 num_cached_tokens=4, error=error, timing=timing)


def test_engine_traces_build_the_phases_when_a_sample_finishes(spans):
    traces = tracing.EngineTraces()
    traces.add("r1-abc", TRACEPARENT, samples=2)
    traces.add("r2-abc", "", samples=1)  # not traced by its sender: nothing kept
    assert len(traces) == 1
    timing = types.SimpleNamespace(queued=10.0, scheduled=10.5, first_token=11.0, last_token=12.0, finished=12.1,
                                   num_generation_tokens=5, num_steps=6, num_prefill_steps=2, num_preemptions=0)
    traces.finished(_finished_output("r1-abc", 0, timing))
    assert len(traces) == 1  # one sample to go
    traces.finished(_finished_output("r1-abc", 1, timing))
    assert len(traces) == 0
    traces.finished(_finished_output("r1-abc", 1, timing))  # unknown now: nothing
    by_name: dict[str, list] = {}
    for span in spans():
        by_name.setdefault(span.name, []).append(span)
    assert {name: len(s) for name, s in by_name.items()} == {"engine": 2, "queued": 2, "prefill": 2, "decode": 2}
    engine = by_name["engine"][0]
    assert _parent_id(engine) == SPAN_ID and engine.kind == SpanKind.SERVER
    assert engine.attributes["gen_ai.usage.output_tokens"] == 5 and engine.attributes["gen_ai.usage.input_tokens"] == 10
    phases = {name: next(s for s in by_name[name] if _parent_id(s) == _hex(engine)[1])
              for name in ("queued", "prefill", "decode")}
    assert [(s.start_time, s.end_time) for s in phases.values()] == [
        (10_000_000_000, 10_500_000_000), (10_500_000_000, 11_000_000_000), (11_000_000_000, 12_000_000_000)]
    assert phases["prefill"].attributes["tessera.prefill.tokens"] == 6
    assert phases["decode"].attributes["tessera.decode.tokens"] == 4
    assert phases["prefill"].attributes["tessera.prefill.steps"] == 2  # a prompt in two chunks
    assert phases["decode"].attributes["tessera.decode.steps"] == 4
    assert engine.attributes["tessera.steps"] == 6 and engine.attributes["tessera.preemptions"] == 0


def test_engine_traces_of_a_request_that_never_ran(spans):
    traces = tracing.EngineTraces()
    traces.add("r1", TRACEPARENT, samples=2)
    timing = types.SimpleNamespace(queued=10.0, scheduled=None, first_token=None, last_token=None, finished=10.2,
                                   num_generation_tokens=0, num_steps=0, num_prefill_steps=0, num_preemptions=0)
    traces.finished(_finished_output("r1", 0, timing, reason="error", error=("NOT_FOUND", "no adapter x")))
    assert len(traces) == 0  # an error ends every sample
    names = sorted(s.name for s in spans())
    assert names == ["engine", "queued"]
    (engine,) = [s for s in spans() if s.name == "engine"]
    assert engine.status.status_code == StatusCode.ERROR and "NOT_FOUND" in engine.status.description


def test_grpc_interceptor_spans_each_call_under_the_callers_traceparent(spans):
    """A grpc.aio server with the interceptor: a unary call, a streaming one and a failing one,
    each a SERVER span (child of the caller's metadata), current in the handler."""
    import grpc

    async def unary(request: bytes, context) -> bytes:
        return tracing.current_traceparent().encode()

    async def stream(request: bytes, context):
        for _ in range(2):
            yield tracing.current_traceparent().encode()

    async def failing(request: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")

    async def run():
        server = grpc.aio.server(interceptors=tracing.grpc_server_interceptors())
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {
            "Call": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Fail": grpc.unary_unary_rpc_method_handler(failing)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        metadata = [("traceparent", TRACEPARENT)]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                one = await channel.unary_unary("/test.Echo/Call")(b"", metadata=metadata)
                many = [r async for r in channel.unary_stream("/test.Echo/Stream")(b"", metadata=metadata)]
                with pytest.raises(grpc.aio.AioRpcError):
                    await channel.unary_unary("/test.Echo/Fail")(b"", metadata=metadata)
        finally:
            await server.stop(0)
        return one, many

    one, many = asyncio.run(run())
    by_name = {s.name: s for s in spans()}
    assert set(by_name) == {"test.Echo/Call", "test.Echo/Stream", "test.Echo/Fail"}
    for name, seen in (("test.Echo/Call", [one]), ("test.Echo/Stream", many)):
        span = by_name[name]
        assert span.kind == SpanKind.SERVER and _parent_id(span) == SPAN_ID and _hex(span)[0] == TRACE_ID
        assert {s.decode() for s in seen} == {f"00-{TRACE_ID}-{_hex(span)[1]}-{int(span.context.trace_flags):02x}"}
    assert by_name["test.Echo/Stream"].attributes["rpc.method"] == "Stream"
    assert by_name["test.Echo/Fail"].status.status_code == StatusCode.ERROR
