"""OpenTelemetry tracing of requests across the three services; nothing at all when off.

When it is on (the standard OTEL_* variables, or vLLM's flag):
  - OTEL_SDK_DISABLED=true: off, whatever else is set;
  - else on when an endpoint is given (`--otlp-traces-endpoint`, whose environment fallback is
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or OTEL_EXPORTER_OTLP_ENDPOINT) and OTEL_TRACES_EXPORTER
    is not "none";
  - or when OTEL_TRACES_EXPORTER names an exporter: "otlp" (OTLP over gRPC, the SDK's default
    endpoint localhost:4317 when none is given) or "console" (spans printed to stdout);
  - else off (the default): the SDK is never imported, no span is built, and each hot path
    tests one module boolean, `ENABLED`.
Only OTLP over gRPC is exported (OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL must be grpc if set); a
bad setting stops the service at start with a message naming the variable. The SDK reads the
other OTEL_* variables itself: OTEL_BSP_* (the BatchSpanProcessor, which exports on a thread of
its own, off the request path), OTEL_TRACES_SAMPLER (default: the parent's sampled flag, else
record), OTEL_EXPORTER_OTLP_[TRACES_]HEADERS / _INSECURE / _CERTIFICATE, OTEL_RESOURCE_ATTRIBUTES.
An endpoint "http://host:port" is plaintext, "https://..." TLS. Service names: tessera-frontend,
tessera-tokenizer, tessera-engine; OTEL_SERVICE_NAME overrides.

The spans of one request, one trace (a client's own trace continues through it when it sends a
W3C `traceparent` HTTP header or gRPC metadata entry: the handler span is its child):

    frontend   POST /v1/chat/completions | tessera.v1.FrontendService/Generate  (the handler, SERVER)
               ├ admission          a slot taken (or refused: an error), the load then
               └ generate           AsyncLLM.generate to its last output; usage (gen_ai.usage.*)
                 ├ queueing         arrival to the engine's submission (backends, tokenize, checks)
                 ├ tokenize         CLIENT: the TokenizeStream round trip
    tokenizer    │ └ tokenize       SERVER: the item's work
                 │   └ chat_template  a chat prompt's template (and the encoding of its text)
    engine       └ engine           SERVER, one per sample: received to finished, gen_ai.* usage
                   ├ queued         received to first scheduled
                   ├ prefill        to the first token (tokens computed, tokens from the prefix cache, steps)
                   └ decode         to the last token (the steps it took part in and their tokens)

The frontend carries the context to the tokenizer and the engine in the per-request messages
(TokenizeItem.traceparent, EngineRequest.traceparent), since their streams carry many requests.
The engine keeps one dict entry per traced request and builds its spans when a sample finishes,
from the timestamps it keeps anyway (RequestTiming): nothing is done per step.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import time
from typing import Any, AsyncIterator, Callable

log = logging.getLogger(__name__)

# True once `setup` turned tracing on; every hot path tests this before anything else.
ENABLED = False

_SERVICE_NAMES = {"frontend": "tessera-frontend", "tokenizer": "tessera-tokenizer", "engine": "tessera-engine"}
EXPORTERS = ("otlp", "console", "none")
TRACEPARENT = "traceparent"  # the W3C header / metadata key

_tracer = None        # opentelemetry.trace.Tracer, once enabled
_provider = None      # the SDK's TracerProvider (flushed and shut down by `shutdown`)
_propagator = None    # W3C TraceContextTextMapPropagator
_otel_context = None  # the opentelemetry.context module
_trace = None         # the opentelemetry.trace module
_SpanKind = None
_Status = None
_StatusCode = None


class TracingConfigError(ValueError):
    """The OTEL_* variables or the flag ask for something this build cannot do."""


def add_tracing_flags(parser: argparse.ArgumentParser) -> None:
    """`--otlp-traces-endpoint` (vLLM's name; env OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)."""
    from tessera.common.flags import add_flag  # (flags imports this module's function lazily too)
    add_flag(parser, "--otlp-traces-endpoint", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None,
             help="OTLP/gRPC endpoint (http://host:4317 plaintext, https:// TLS) to export request traces "
                  "to; tracing is off unless this, OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER is "
                  "set (OTEL_SDK_DISABLED=true turns it off). See tessera.common.tracing")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def resolve(endpoint: str | None, env: os._Environ | dict | None = None) -> tuple[str, str | None] | None:
    """What the configuration asks for: None (off), or (exporter, endpoint or None for the
    SDK's default). `endpoint`: the flag's value (which already fell back to
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). Raises TracingConfigError naming the bad variable."""
    env = os.environ if env is None else env
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return None
    endpoint = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    exporter = (env.get("OTEL_TRACES_EXPORTER") or "").strip().lower()
    if exporter and exporter not in EXPORTERS:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={exporter!r}: tessera exports traces with "
                                 f"{', '.join(EXPORTERS)} only")
    if exporter == "none" or (not exporter and not endpoint):
        return None
    exporter = exporter or "otlp"
    if exporter == "otlp":
        for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = (env.get(var) or "").strip().lower()
            if protocol and protocol != "grpc":
                raise TracingConfigError(f"{var}={protocol!r}: tessera exports OTLP over grpc only")
            if protocol:
                break
    return exporter, endpoint


def service_name(service: str) -> str:
    return os.environ.get("OTEL_SERVICE_NAME") or _SERVICE_NAMES.get(service, f"tessera-{service}")


def setup(service: str, endpoint: str | None = None, *, exporter=None) -> bool:
    """Turn tracing on for this process if configured (see the module docstring); whether it is.
    `exporter`: a SpanExporter to use instead (tests, benchmarks), which turns tracing on.

    Raises TracingConfigError for a bad configuration or a missing opentelemetry package."""
    global ENABLED, _tracer, _provider, _propagator, _otel_context, _trace, _SpanKind, _Status, _StatusCode
    if ENABLED:
        return True
    wanted = resolve(endpoint) if exporter is None else ("given", None)
    if wanted is None:
        return False
    exporter_name, endpoint = wanted
    try:
        from opentelemetry import context as otel_context
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        if exporter_name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise TracingConfigError(
            f"tracing is configured ({exporter_name}, endpoint {endpoint or 'default'}) but {exc.name} is not "
            f"installed: pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc") from None
    if exporter_name == "otlp":
        exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    elif exporter_name == "console":
        exporter = ConsoleSpanExporter()
    name = service_name(service)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("tessera")
    _propagator = TraceContextTextMapPropagator()
    _otel_context, _trace = otel_context, trace
    _SpanKind, _Status, _StatusCode = SpanKind, Status, StatusCode
    ENABLED = True
    log.info("tracing on", extra={"service_name": name, "exporter": exporter_name,
                                  "endpoint": endpoint or "default"})
    return True


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans ended so far now (tests); a no-op when off."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Export what is queued and turn tracing off (a service's exit); a no-op when off."""
    global ENABLED, _provider, _tracer
    provider, _provider, _tracer, ENABLED = _provider, None, None, False
    if provider is not None:
        try:
            provider.shutdown()
        except Exception:  # noqa: BLE001 (an unreachable collector must not fail the exit)
            log.warning("flushing traces failed", exc_info=True)


# --- context: W3C traceparent in headers, gRPC metadata and proto fields -------------------------

def extract(carrier: dict[str, str]):
    """The OTel context a W3C carrier ({"traceparent": ..., "tracestate": ...}) names (the
    current context's root when it names none or a malformed one)."""
    return _propagator.extract(carrier)


def extract_metadata(metadata) -> Any:
    """The context of gRPC invocation metadata (a sequence of (key, value) pairs)."""
    return extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})


def extract_headers(headers: list[tuple[bytes, bytes]]) -> Any:
    """The context of an ASGI scope's raw headers."""
    carrier = {}
    for key, value in headers:
        if key in (b"traceparent", b"tracestate"):
            carrier[key.decode("latin-1")] = value.decode("latin-1")
    return extract(carrier)


def context_of(traceparent: str):
    """The context a proto field's traceparent names (see `traceparent_of`)."""
    return _propagator.extract({TRACEPARENT: traceparent})


def inject_metadata(metadata: list[tuple[str, str]] | None = None, context=None) -> list[tuple[str, str]]:
    """gRPC metadata carrying `context` (the current one by default); a no-op when off."""
    metadata = list(metadata or [])
    if ENABLED:
        carrier: dict[str, str] = {}
        _propagator.inject(carrier, context=context)
        metadata.extend(carrier.items())
    return metadata


def traceparent_of(span) -> str:
    """`span`'s W3C traceparent ("00-<trace id>-<span id>-<flags>"); "" for None or an invalid span."""
    if span is None:
        return ""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def current_traceparent() -> str:
    """The current span's traceparent, for a per-request proto field ("" when off or none)."""
    if not ENABLED:
        return ""
    return traceparent_of(_trace.get_current_span())


# --- spans -----------------------------------------------------------------------------------------

def _kind(kind: str):
    return {"server": _SpanKind.SERVER, "client": _SpanKind.CLIENT}.get(kind, _SpanKind.INTERNAL)


def _parent_context(parent):
    """`parent` as an OTel context: None = the current one; a traceparent string; a span; a context."""
    if parent is None or not ENABLED:
        return None
    if isinstance(parent, str):
        return context_of(parent) if parent else None
    if hasattr(parent, "get_span_context"):
        return _trace.set_span_in_context(parent)
    return parent


def _ns(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e9)


def start_span(name: str, parent=None, kind: str = "internal", attributes: dict | None = None,
               start_time: float | None = None):
    """A started span (end it with `end`), or None when off. `parent`: see `_parent_context`;
    `start_time`: unix seconds (default now)."""
    if not ENABLED:
        return None
    return _tracer.start_span(name, context=_parent_context(parent), kind=_kind(kind),
                              attributes=attributes, start_time=_ns(start_time))


def end(span, error: BaseException | str | None = None, end_time: float | None = None,
        attributes: dict | None = None) -> None:
    """End `span` (None: nothing), as an error when `error` is given."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        _set_error(span, error)
    span.end(end_time=_ns(end_time))


def _set_error(span, error: BaseException | str) -> None:
    if isinstance(error, BaseException):
        span.record_exception(error)
        error = f"{type(error).__name__}: {error}"
    span.set_status(_Status(_StatusCode.ERROR, str(error)))


def record_span(name: str, start: float, end_: float, parent=None, attributes: dict | None = None,
                kind: str = "internal", error: str | None = None):
    """A span that already happened, from its timestamps (unix seconds); returns it (None when off)."""
    span = start_span(name, parent, kind, attributes, start)
    if span is not None:
        end(span, error, end_)
    return span


@contextlib.contextmanager
def span(name: str, parent=None, kind: str = "internal", attributes: dict | None = None):
    """A span around a block, current inside it (so `current_traceparent` and child spans see
    it), an error if the block raises; nothing when off. For synchronous code, or code that
    stays in one asyncio task."""
    if not ENABLED:
        yield None
        return
    s = start_span(name, parent, kind, attributes)
    token = _otel_context.attach(_trace.set_span_in_context(s))
    try:
        yield s
    except GeneratorExit:  # a streaming handler's consumer went away: no error of ours
        raise
    except BaseException as exc:
        _set_error(s, exc)
        raise
    finally:
        _otel_context.detach(token)
        s.end()


def remote_span(name: str, traceparent: str, attributes: dict | None = None):
    """`span(name)` as a SERVER child of a per-request message's traceparent; a no-op when off
    or when the message carries none (its sender does not trace)."""
    if not ENABLED or not traceparent:
        return contextlib.nullcontext()
    return span(name, traceparent, "server", attributes)


def child_span(name: str, attributes: dict | None = None):
    """`span(name)` under the current span when tracing is on and one is recording, else a
    no-op: for a phase of work that only a traced request should time."""
    if not ENABLED or not _trace.get_current_span().is_recording():
        return contextlib.nullcontext()
    return span(name, attributes=attributes)


def traced(name: str, kind: str = "internal") -> Callable:
    """Decorate a coroutine function: when on, its call runs in a span of its own (current
    inside); when off, the call is the undecorated coroutine itself."""
    def wrap(fn):
        @functools.wraps(fn)
        def traced_call(*args, **kwargs):
            if not ENABLED:
                return fn(*args, **kwargs)
            return _in_span(name, kind, fn(*args, **kwargs))
        return traced_call
    return wrap


async def _in_span(name: str, kind: str, work):
    with span(name, kind=kind):
        return await work


def traced_stream(name: str, attributes: Callable[..., dict] | None = None,
                  on_item: Callable[[Any, Any], None] | None = None) -> Callable:
    """Decorate an async generator function: when on, a span covers the whole iteration and is
    current while the generator runs (attached around each step only, never across a yield,
    so consumers in any task are fine). `attributes(*args, **kwargs)`: the span's starting
    attributes; `on_item(span, item)`: called on each item yielded (e.g. usage on the last)."""
    def wrap(fn):
        @functools.wraps(fn)
        def traced_gen(*args, **kwargs):
            if not ENABLED:
                return fn(*args, **kwargs)
            return _traced_iteration(name, fn(*args, **kwargs),
                                     attributes(*args, **kwargs) if attributes else None, on_item)
        return traced_gen
    return wrap


async def _traced_iteration(name: str, inner: AsyncIterator, attributes: dict | None,
                            on_item: Callable | None) -> AsyncIterator:
    s = start_span(name, attributes=attributes)
    ctx = _trace.set_span_in_context(s)
    error: BaseException | None = None
    try:
        while True:
            token = _otel_context.attach(ctx)
            try:
                item = await inner.__anext__()
            except StopAsyncIteration:
                return
            finally:
                _otel_context.detach(token)
            if on_item is not None:
                on_item(s, item)
            yield item
    except GeneratorExit:
        s.set_attribute("tessera.cancelled", True)  # the consumer went away
        raise
    except BaseException as exc:
        error = exc
        raise
    finally:
        token = _otel_context.attach(ctx)
        try:
            await inner.aclose()
        finally:
            _otel_context.detach(token)
            end(s, error)


# --- the frontend's handler spans: gRPC server interceptor, ASGI middleware -----------------------

def grpc_server_interceptors() -> list:
    """[the interceptor giving every public gRPC call a SERVER span] when on, else []."""
    if not ENABLED:
        return []
    return [_make_grpc_interceptor()]


def _make_grpc_interceptor():
    import inspect

    import grpc

    class TracingInterceptor(grpc.aio.ServerInterceptor):
        """A SERVER span per call, child of the caller's traceparent metadata, current in the handler."""

        async def intercept_service(self, continuation, details):
            handler = await continuation(details)
            if handler is None or details.method.startswith("/grpc."):  # health, reflection
                return handler
            name = details.method.lstrip("/")
            parent = extract_metadata(details.invocation_metadata)
            attrs = {"rpc.system": "grpc", "rpc.method": name.rsplit("/", 1)[-1],
                     "rpc.service": name.rsplit("/", 1)[0]}
            for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
                behavior = getattr(handler, kind)
                if behavior is not None:
                    break
            else:
                return handler
            if inspect.isasyncgenfunction(behavior):
                async def wrapped(request, context):
                    with span(name, parent, "server", attrs):
                        async for response in behavior(request, context):
                            yield response
            else:
                async def wrapped(request, context):
                    with span(name, parent, "server", attrs):
                        return await behavior(request, context)
            make = getattr(grpc, f"{kind}_rpc_method_handler")
            return make(wrapped, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)

    return TracingInterceptor()


UNTRACED_PATHS = frozenset({"/health", "/metrics", "/ping"})


class AsgiTracingMiddleware:
    """A SERVER span per HTTP request (the client's `traceparent` header its parent), current for
    the whole response, streamed bodies included; add it only when `ENABLED`."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not ENABLED or scope.get("path") in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method", "GET"), scope.get("path", "")
        attrs = {"http.request.method": method, "url.path": path}

        async def send_traced(message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                current.set_attribute("http.response.status_code", status)
                if status >= 500:
                    current.set_status(_Status(_StatusCode.ERROR, f"HTTP {status}"))
            await send(message)

        with span(f"{method} {path}", extract_headers(scope.get("headers", [])), "server", attrs) as current:
            await self.app(scope, receive, send_traced)


# --- the engine's spans, built when a sample finishes ---------------------------------------------

class EngineTraces:
    """The traced requests in flight in an engine: their traceparent until their last sample
    finishes, then its spans (engine > queued, prefill, decode) built from the sample's timing."""

    def __init__(self) -> None:
        self._parents: dict[str, list] = {}  # engine request id -> [traceparent, samples left]

    def __len__(self) -> int:
        return len(self._parents)

    def add(self, request_id: str, traceparent: str, samples: int) -> None:
        if traceparent:
            self._parents[request_id] = [traceparent, samples]

    def discard(self, request_id: str) -> None:
        self._parents.pop(request_id, None)

    def finished(self, out) -> None:
        """A sample's last output (an EngineCoreOutput with finish_reason set): its spans."""
        entry = self._parents.get(out.request_id)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0 or out.finish_reason == "error":
            del self._parents[out.request_id]
        record_engine_sample(entry[0], out)


def record_engine_sample(traceparent: str, out) -> None:
    """The spans of one finished sample under `traceparent`, from `out.timing` (RequestTiming):
    engine (received to finished), queued (to first scheduled), prefill (to the first token),
    decode (to the last token)."""
    t = out.timing
    now = time.time()
    attrs = {"gen_ai.request.id": out.request_id, "gen_ai.response.finish_reasons": [out.finish_reason or "error"],
             "tessera.sample.index": out.index, "gen_ai.usage.input_tokens": out.num_prompt_tokens,
             "tessera.usage.cached_tokens": out.num_cached_tokens}
    error = None
    if out.error is not None:
        error = f"{out.error[0]}: {out.error[1]}"
    if t is None:
        record_span("engine", now, now, traceparent, attrs, "server", error)
        return
    attrs["gen_ai.usage.output_tokens"] = t.num_generation_tokens
    attrs["tessera.steps"] = t.num_steps
    attrs["tessera.preemptions"] = t.num_preemptions
    parent = record_span("engine", t.queued, t.finished, traceparent, attrs, "server", error)
    scheduled = t.scheduled if t.scheduled is not None else t.finished
    record_span("queued", t.queued, scheduled, parent)
    if t.scheduled is None:
        return
    prefill_end = t.first_token if t.first_token is not None else t.finished
    record_span("prefill", t.scheduled, prefill_end, parent, {
        "tessera.prefill.tokens": max(out.num_prompt_tokens - out.num_cached_tokens, 0),
        "tessera.prefill.cached_tokens": out.num_cached_tokens,
        "tessera.prefill.steps": t.num_prefill_steps})
    if t.first_token is not None:
        last = t.last_token if t.last_token is not None else t.first_token
        # the first token comes from the prefill's step; every later one from a decode step
        record_span("decode", t.first_token, last, parent, {
            "tessera.decode.tokens": max(t.num_generation_tokens - 1, 0),
            "tessera.decode.steps": t.num_steps - t.num_prefill_steps,
            "gen_ai.usage.output_tokens": t.num_generation_tokens})
