"""The tokenizer service's Prometheus metrics (prefix `tessera:`; vLLM has no separate
tokenizer process, so these names are our own). See docs/metrics.md.

Recorded by `server`: one observation per unary call or TokenizeStream item and one per
DetokenizeStream message (an engine step's worth of tokens for many requests), never per token.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from tessera.common.metrics import FAST_LATENCY_BUCKETS

TOKENIZE_TIME = Histogram(
    "tessera:tokenize_duration_seconds",
    "Time to tokenize one Tokenize request or TokenizeStream item (chat template included), in seconds.",
    ["input"], buckets=FAST_LATENCY_BUCKETS)
DETOKENIZE_TIME = Histogram(
    "tessera:detokenize_duration_seconds",
    "Time to detokenize one Detokenize call (method=unary) or one DetokenizeStream message "
    "holding many requests' new tokens (method=stream), in seconds.",
    ["method"], buckets=FAST_LATENCY_BUCKETS)
TOKENS = Counter(
    "tessera:tokenizer_tokens",
    "Tokens processed: produced by Tokenize (op=tokenize) or decoded by Detokenize and "
    "DetokenizeStream (op=detokenize).",
    ["op"])
REQUESTS = Counter(
    "tessera:tokenizer_requests",
    "Unary calls (Tokenize, Detokenize, GetModelInfo) and TokenizeStream items (method=TokenizeStream) "
    "by method and gRPC status code.",
    ["method", "code"])
STREAMS_ACTIVE = Gauge(
    "tessera:detokenize_streams_active", "Open DetokenizeStream calls (one per frontend).")
STREAM_REQUESTS_ACTIVE = Gauge(
    "tessera:detokenize_requests_active", "Requests open on the DetokenizeStream calls.")
STREAM_REQUESTS_DONE = Counter(
    "tessera:detokenize_requests",
    "Requests ended on a DetokenizeStream, by how: finished (the engine finished it), "
    "stop (a stop string matched), cancel, error, or stream_closed (the stream ended first).",
    ["outcome"])

TOKENIZE_TEXT = TOKENIZE_TIME.labels("text")
TOKENIZE_CHAT = TOKENIZE_TIME.labels("chat")
DETOKENIZE_UNARY = DETOKENIZE_TIME.labels("unary")
DETOKENIZE_STREAM = DETOKENIZE_TIME.labels("stream")
TOKENIZED = TOKENS.labels("tokenize")
DETOKENIZED = TOKENS.labels("detokenize")
OUTCOMES = {o: STREAM_REQUESTS_DONE.labels(o) for o in ("finished", "stop", "cancel", "error", "stream_closed")}
for _method in ("Tokenize", "TokenizeStream", "Detokenize", "GetModelInfo"):
    REQUESTS.labels(_method, "OK")
