"""Prometheus helpers every service uses: the `--metrics-port` flag, an HTTP server
for `/metrics` and `/health`, and the histogram buckets (vLLM's where vLLM has the metric).

Each service defines its own metric objects (prefix `tessera:`, mirroring vLLM's
`vllm:` names) in its own `metrics` module, and calls `start_metrics_server` once it
is listening. The HTTP server runs on a daemon thread and serves:

    GET /metrics   the Prometheus text format (OpenMetrics when the scraper asks for it)
    GET /health    200 {"status": "SERVING"} or 503 {"status": "NOT_SERVING"}: the same
                   answer as the service's grpc.health.v1 overall ("") status
"""
from __future__ import annotations

import argparse
import http.server
import json
import logging
import threading
from typing import Callable

import prometheus_client
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder

from tessera.common.flags import add_flag

log = logging.getLogger(__name__)

PREFIX = "tessera:"
METRICS_PORT_ENV = "TESSERA_METRICS_PORT"
# Defaults of --metrics-port per service (0 disables the HTTP server).
DEFAULT_METRICS_PORTS = {"frontend": 9301, "tokenizer": 9302, "engine": 9303}

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards and SLOs carry over.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
# inter_token_latency_seconds and request_time_per_output_token_seconds.
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
# e2e_request_latency_seconds and the request phase histograms (queue, prefill, decode, inference).
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# Our own (no vLLM counterpart): one engine step, one tokenizer call. Sub-millisecond to seconds.
STEP_TIME_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                     0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0]
FAST_LATENCY_BUCKETS = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                        0.1, 0.25, 0.5, 1.0, 2.5]

# No `<name>_created` series next to every counter and histogram (vLLM does the same).
prometheus_client.disable_created_metrics()


def build_buckets(mantissas: list[int], max_value: int) -> list[int]:
    """vLLM's build_buckets: mantissas times powers of ten, up to max_value."""
    exponent, buckets = 0, []
    while True:
        for m in mantissas:
            value = m * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """[1, 2, 5, 10, 20, 50, ...] up to max_value (vLLM's token-count buckets)."""
    return build_buckets([1, 2, 5], max_value)


def add_metrics_flag(parser: argparse.ArgumentParser, service: str) -> None:
    """`--metrics-port` (env TESSERA_METRICS_PORT) with the service's default port; 0 disables."""
    add_flag(parser, "--metrics-port", METRICS_PORT_ENV, DEFAULT_METRICS_PORTS[service], type=int,
             help="HTTP port for Prometheus /metrics and /health (0 disables)")


class MetricsServer:
    """A small threaded HTTP server: /metrics and /health."""

    def __init__(self, host: str, port: int, health: Callable[[], bool] | None,
                 registry: CollectorRegistry) -> None:
        handler = _make_handler(health, registry)
        self.httpd = http.server.ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start_metrics_server(port: int, host: str = "0.0.0.0", health: Callable[[], bool] | None = None,
                         registry: CollectorRegistry = REGISTRY) -> MetricsServer | None:
    """Serve /metrics and /health on `port` (0: not at all). `health()` says SERVING or not.

    A port that cannot be bound is logged and skipped: the service still serves its API.
    """
    if not port:
        log.info("metrics server disabled (--metrics-port 0)")
        return None
    bind = host.strip("[]") if host else "0.0.0.0"
    try:
        server = MetricsServer(bind, port, health, registry)
    except OSError as exc:
        log.error("cannot serve metrics on %s:%s: %s", bind, port, exc,
                  extra={"metrics_port": port})
        return None
    log.info("metrics listening", extra={"metrics_address": f"{bind}:{server.port}"})
    return server


def _make_handler(health: Callable[[], bool] | None, registry: CollectorRegistry):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                try:
                    body = encoder(registry)
                except Exception as exc:  # a broken collector: say so instead of hanging up
                    log.exception("metrics collection failed")
                    return self._send(500, "text/plain; charset=utf-8", f"collection failed: {exc}\n".encode())
                return self._send(200, content_type, body)
            if path in ("/health", "/healthz"):
                serving = True if health is None else bool(health())
                body = json.dumps({"status": "SERVING" if serving else "NOT_SERVING"}).encode() + b"\n"
                return self._send(200 if serving else 503, "application/json", body)
            self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics or /health\n")

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # scrapes are not worth a log line
            pass

    return Handler
