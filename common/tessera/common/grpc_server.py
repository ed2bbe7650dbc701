"""A service process's gRPC server, from start to graceful stop; the three services share it.

    async def serve(args) -> int:
        server = GrpcServer([SERVICE_NAME], log, grace_s=args.drain_timeout_s)
        add_FooServicer_to_server(servicer, server.server)       # servicers before start
        if await server.try_start(args.host, args.port, args.metrics_port) is None:
            return 1                                             # cannot listen (logged)
        ...  # load; then `await server.health.set(True)` when ready
        await server.wait_for_stop()                             # SIGTERM / SIGINT
        await server.stop(drain=...)                             # NOT_SERVING, drain, close
        log.info("stopped")
        return 0

    def main(argv=None) -> int:
        return run_service("foo", serve, parse_args(argv))      # logging, event loop, exit code

What it does, in this order:

- builds the grpc.aio server with SERVER_OPTIONS, grpc.health.v1 (`health`, for the given
  service names and the overall "") and server reflection;
- `start`: installs the SIGTERM / SIGINT handlers, binds `host:port` (an IPv6 literal is
  bracketed: `::` listens on `[::]:port`), sets every health name NOT_SERVING *before* the
  server starts (so no health check ever sees a name the server does not know), starts it,
  logs one "listening" line, and serves Prometheus /metrics and an HTTP /health that agrees
  with the gRPC health on `metrics_port` (0: none). Turning SERVING is the service's call:
  only it knows when its model, or its backends, are ready;
- `stop`: NOT_SERVING first (load balancers and clients stop sending), then the server
  refuses new calls and gives open ones `grace_s` seconds to end before cancelling them
  (other shutdowns passed to `stop`, e.g. an HTTP server's, run alongside), then the
  metrics server closes. What the service owns (model threads, client channels) it closes
  itself after `stop`.

The grace period is `--drain-timeout-s` / TESSERA_DRAIN_TIMEOUT_S (see
`flags.add_common_flags`). A service whose requests ride on long-lived streams (the
engine's Session, the tokenizer's streams) passes its own `drain` to `stop`, run once
health is NOT_SERVING and before the server closes: closing the server alone would let
those streams carry new requests until the grace runs out.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any, Awaitable, Callable, Coroutine, Iterable

import grpc

from tessera.common import aio, tracing
from tessera.common.flags import DEFAULT_DRAIN_TIMEOUT_S
from tessera.common.grpc_service import SERVER_OPTIONS, Health, add_reflection
from tessera.common.logs import setup_logging
from tessera.common.metrics import MetricsServer, start_metrics_server
from tessera.common.tls import ServerTls

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class BindError(RuntimeError):
    """The server cannot listen on the address it was given (in use, not local, malformed)."""


def bind_address(host: str, port: int) -> str:
    """`host:port` as gRPC takes it: an IPv6 literal in brackets ("[::1]:50051")."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class GrpcServer:
    """One service's grpc.aio server with health and reflection; see the module docstring."""

    def __init__(self, service_names: Iterable[str], log: logging.Logger, *,
                 grace_s: float = DEFAULT_DRAIN_TIMEOUT_S, options: list | None = None,
                 interceptors: list | None = None) -> None:
        names = list(service_names)
        self.log = log
        self.grace_s = grace_s
        self.server = grpc.aio.server(options=SERVER_OPTIONS if options is None else options,
                                      interceptors=interceptors or None)
        self.health = Health(self.server, names)
        add_reflection(self.server, names)
        self.stop_requested = asyncio.Event()  # set by SIGTERM / SIGINT (or `request_stop`)
        self.address: str | None = None
        self.port: int | None = None
        self.metrics_server: MetricsServer | None = None

    async def start(self, host: str, port: int, metrics_port: int = 0, *, handle_signals: bool = True,
                    tls: ServerTls | None = None, **log_fields) -> int:
        """Bind, start NOT_SERVING, serve metrics; the bound port (`port` 0 picks a free one).

        `handle_signals`: SIGTERM / SIGINT request the stop (only the main thread can take
        them; the handlers stay until the loop closes, so a second signal changes nothing).
        `tls`: serve over TLS (mutual, when it has a client CA). `log_fields` are added to the
        "listening" line."""
        if handle_signals:
            loop = asyncio.get_running_loop()
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, self.stop_requested.set)
        address = bind_address(host, port)
        try:
            if tls is None:
                bound = self.server.add_insecure_port(address)
            else:
                bound = self.server.add_secure_port(address, tls.grpc_credentials())
        except RuntimeError as exc:  # grpc's way of saying the address cannot be bound
            raise BindError(f"cannot listen on {address}: {exc}") from exc
        await self.health.set(False)
        await self.server.start()
        self.address, self.port = address, bound
        self.log.info("listening", extra={"address": bind_address(host, bound), "event_loop": aio.loop_name(),
                                          "tls": "off" if tls is None else "mutual" if tls.client_ca else "on",
                                          **log_fields})
        self.metrics_server = start_metrics_server(metrics_port, host, health=lambda: self.health.serving)
        return bound

    async def try_start(self, host: str, port: int, metrics_port: int = 0, **kwargs) -> int | None:
        """`start`, with an address that cannot be bound logged as an error and answered None
        (the service then exits 1) instead of raising BindError."""
        try:
            return await self.start(host, port, metrics_port, **kwargs)
        except BindError as exc:
            self.log.error("%s", exc)
            return None

    def request_stop(self) -> None:
        """What SIGTERM / SIGINT do: `wait_for_stop` returns."""
        self.stop_requested.set()

    async def wait_for_stop(self) -> None:
        await self.stop_requested.wait()

    async def stop(self, *alongside: Awaitable, drain: Callable[[], Awaitable] | None = None) -> None:
        """NOT_SERVING, then the service's own `drain` (requests on its long-lived streams), then
        open calls get `grace_s` (with `alongside`), then metrics close."""
        self.log.info("shutting down", extra={"grace_s": self.grace_s})
        await self.health.set(False)
        if drain is not None:
            await drain()
        await asyncio.gather(self.server.stop(self.grace_s), *alongside)
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None


def run_service(service: str, serve: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
                args: argparse.Namespace) -> int:
    """The end of a service's main(), once its flags are parsed: logging as `service` at
    --log-level in --log-format, `serve(args)` run to its end on the --event-loop chosen (`serve` starts a
    GrpcServer, whose `start` installs the SIGTERM / SIGINT handlers, and after `wait_for_stop`
    drains with `stop`), and its exit code made the process's: a non-zero code is raised as
    SystemExit (`python -m <service>` does not pass main's return value on); 0 is returned."""
    setup_logging(service, args.log_level, args.log_format)
    try:  # OpenTelemetry tracing when configured (a no-op otherwise); flushed at the exit
        tracing.setup(service, getattr(args, "otlp_traces_endpoint", None))
    except tracing.TracingConfigError as exc:
        logging.getLogger(service).error("%s", exc)
        raise SystemExit(2) from None
    try:
        code = aio.run(serve(args), args.event_loop)
    finally:
        tracing.shutdown()
    if code:
        raise SystemExit(code)
    return code
