"""The frontend's Prometheus metrics: per-request latency as the client sees it (vLLM's
frontend histograms, prefix `tessera:`), requests by status code, in flight, and
rejected by admission control; every series is labelled by `api` (grpc | http).

Self-contained: the API handlers make one `RequestTracker` per request and tell it
about each output they send and how the request ended; `record_rejected` counts a
request that admission control turned away. The tracker also writes the request's one
structured log line ("request finished"). See docs/metrics.md.

gRPC handlers use it as a context manager, which finishes it with the call's status
(OK, the code given to context.abort, CANCELLED when the client went away):

    with grpc_tracker(context) as tracker:                    # on arrival, before validation
        request_id = ...; tracker.set_request_id(request_id)
        ...
        tracker.on_output(out.index, len(out.token_ids), out.usage)   # per output sent

HTTP handlers call `tracker.finish(status)` themselves (the status they answered).
Costs a few dict/float operations per output and a handful of observations per request.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
from prometheus_client import Counter, Gauge, Histogram

from tessera.common.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

log = logging.getLogger("tessera.frontend.requests")

APIS = ("grpc", "http")

TIME_TO_FIRST_TOKEN = Histogram(
    "tessera:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
    ["api"], buckets=TTFT_BUCKETS)
INTER_TOKEN_LATENCY = Histogram(
    "tessera:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
    ["api"], buckets=ITL_BUCKETS)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "tessera:request_time_per_output_token_seconds",
    "Histogram of time_per_output_token_seconds per request.", ["api"], buckets=ITL_BUCKETS)
E2E_LATENCY = Histogram(
    "tessera:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
    ["api"], buckets=REQUEST_LATENCY_BUCKETS)
REQUESTS = Counter(
    "tessera:requests",
    "Requests by API and final status code (gRPC status name for api=grpc, HTTP status for api=http).",
    ["api", "code"])
IN_FLIGHT = Gauge("tessera:requests_in_flight", "Requests being served now.", ["api"])
REJECTED = Counter(
    "tessera:requests_rejected",
    "Requests turned away by admission control before reaching the engine, by reason.",
    ["api", "reason"])

# Migration (async_llm): a request whose engine replica was lost or handed it off continues on another.
MIGRATIONS = Counter(
    "tessera:requests_migrated",
    "Requests moved to another engine replica mid-answer, by why (lost: its session broke; handoff: "
    "its replica drained).", ["reason"])
MIGRATION_RECOMPUTED_TOKENS = Counter(
    "tessera:migration_recomputed_tokens",
    "Tokens sent again to the replica a request migrated to (prompt + outputs so far), which it "
    "prefills (less what its prefix cache holds).")
MIGRATION_DELAY = Histogram(
    "tessera:migration_delay_seconds",
    "From losing a request's replica to the first output of the replica it migrated to.",
    buckets=TTFT_BUCKETS)
MIGRATION_FAILURES = Counter(
    "tessera:migration_failures",
    "Requests that could not migrate and failed UNAVAILABLE, by why (attempts: moved too often; "
    "no_replica: none serving within --engine-timeout-s).", ["reason"])
for _reason in ("lost", "handoff"):
    MIGRATIONS.labels(_reason)
for _reason in ("attempts", "no_replica"):
    MIGRATION_FAILURES.labels(_reason)

for _api in APIS:
    for _family in (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, TIME_PER_OUTPUT_TOKEN, E2E_LATENCY, IN_FLIGHT):
        _family.labels(_api)
REQUESTS.labels("grpc", "OK")
REQUESTS.labels("http", "200")


class RequestTracker:
    """One request's timings, from arrival to its end; counts it in flight meanwhile."""

    __slots__ = ("api", "request_id", "arrival", "first_token", "last_token", "last_by_index",
                 "num_tokens", "usage", "done", "context", "_ttft", "_itl", "_tpot", "_e2e", "_in_flight")

    def __init__(self, api: str, request_id: str = "", arrival: float | None = None,
                 context: grpc.aio.ServicerContext | None = None) -> None:
        self.api = api
        self.request_id = request_id
        self.arrival = time.monotonic() if arrival is None else arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.last_by_index: dict[int, float] = {}
        self.num_tokens = 0
        self.usage = None  # the request's Usage, once an output carried it
        self.done = False
        self.context = context  # gRPC: where the status code is read on exit
        self._ttft = TIME_TO_FIRST_TOKEN.labels(api)
        self._itl = INTER_TOKEN_LATENCY.labels(api)
        self._tpot = TIME_PER_OUTPUT_TOKEN.labels(api)
        self._e2e = E2E_LATENCY.labels(api)
        self._in_flight = IN_FLIGHT.labels(api)
        self._in_flight.inc()

    def on_output(self, index: int, num_tokens: int, usage=None, now: float | None = None) -> None:
        """An output carrying `num_tokens` new tokens of choice `index` (and the request's
        Usage on its last output) went to the client.

        The first such output observes time to first token; each later one of the same choice
        observes the inter-token latency since that choice's previous output (one observation
        per engine step, as vLLM does, however many tokens the step carried). With n > 1 the
        time per output token is taken over all choices' tokens together.
        """
        if usage is not None:
            self.usage = usage
        if num_tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first_token is None:
            self.first_token = now
            self._ttft.observe(now - self.arrival)
        previous = self.last_by_index.get(index)
        if previous is not None:
            self._itl.observe(now - previous)
        self.last_by_index[index] = now
        self.last_token = now
        self.num_tokens += num_tokens

    def set_request_id(self, request_id: str) -> None:
        self.request_id = request_id

    def finish(self, code: str | int, prompt_tokens: int | None = None, cached_tokens: int | None = None,
               now: float | None = None, **log_fields) -> None:
        """The request ended with status `code` ("OK", "CANCELLED", ... or an HTTP status).

        Counts it by code and leaves in-flight; a successful request also observes its
        end-to-end latency and time per output token. Writes the request's log line.
        Idempotent: only the first call counts.
        """
        if self.done:
            return
        self.done = True
        now = time.monotonic() if now is None else now
        code = str(code)
        self._in_flight.dec()
        REQUESTS.labels(self.api, code).inc()
        e2e = now - self.arrival
        ok = code in ("OK", "200")
        line = {"request_id": self.request_id, "api": self.api, "code": code, "e2e_s": round(e2e, 6),
                "completion_tokens": self.num_tokens}
        if prompt_tokens is None and self.usage is not None:
            prompt_tokens, cached_tokens = self.usage.prompt_tokens, self.usage.cached_prompt_tokens
        if prompt_tokens is not None:
            line["prompt_tokens"] = prompt_tokens
        if cached_tokens is not None:
            line["cached_tokens"] = cached_tokens
        if self.first_token is not None:
            line["ttft_s"] = round(self.first_token - self.arrival, 6)
        if ok:
            self._e2e.observe(e2e)
        if self.first_token is not None and self.last_token is not None and self.num_tokens > 1:
            tpot = (self.last_token - self.first_token) / (self.num_tokens - 1)
            line["tpot_s"] = round(tpot, 6)
            if ok:
                self._tpot.observe(tpot)
        line.update(log_fields)
        log.info("request finished", extra=line)

    def __enter__(self) -> "RequestTracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.finish("OK" if self.api == "grpc" else 200)
        elif isinstance(exc, asyncio.CancelledError):
            self.finish("CANCELLED" if self.api == "grpc" else 499)  # 499: client closed the request
        else:
            code = self.context.code() if self.context is not None else None
            if isinstance(code, grpc.StatusCode):
                self.finish(code.name)
            else:
                self.finish("UNKNOWN" if self.api == "grpc" else 500, error=repr(exc))


def grpc_tracker(context: grpc.aio.ServicerContext, request_id: str = "") -> RequestTracker:
    """A tracker for one gRPC call; `with` it around the handler's body."""
    return RequestTracker("grpc", request_id, context=context)


def record_rejected(api: str, reason: str) -> None:
    """Admission control turned a request away (e.g. reason="queue_full", "too_many_tokens")."""
    REJECTED.labels(api, reason).inc()
