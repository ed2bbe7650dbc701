"""The frontend process: flags, wiring, health, reflection, graceful shutdown.

One asyncio loop serves both public APIs over one AsyncLLM: the gRPC
FrontendService (grpc.aio, --port) and the OpenAI-compatible HTTP API (FastAPI on
uvicorn, --http-port; 0 turns it off). Both share one AdmissionController
(--max-inflight-requests), one set of Limits and one LoRARegistry (the adapters the
engines serve; loading and unloading them when --allow-runtime-lora-updating).

Health (grpc.health.v1 and HTTP /health) stays NOT_SERVING until the tokenizer
answers SERVING (and its ModelInfo is read), the detokenize stream is open and at
least one engine replica has an open Session; a watcher keeps polling, so the
services may start in any order.

Shutdown (SIGTERM / SIGINT): health goes NOT_SERVING, both servers stop taking new
requests and give running ones --drain-timeout-s to finish, then the backend
streams close. The gRPC server's start and stop are `tessera.common.grpc_server`'s.
"""
from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from tessera.common import tls, tracing
from tessera.common.flags import add_common_flags, add_flag
from tessera.common.grpc_server import GrpcServer, run_service
from tessera.common.grpc_service import Health
from tessera.common.heap import freeze_startup_heap
from tessera.common.metrics import add_metrics_flag
from tessera.v1 import frontend_pb2, frontend_pb2_grpc
from tessera_frontend.admission import AdmissionController
from tessera_frontend.async_llm import AsyncLLM
from tessera_frontend.auth import ApiKeyInterceptor, ApiKeyMiddleware, ApiKeys, parse_api_keys
from tessera_frontend.discovery import parse_engine_addrs
from tessera_frontend.engine_client import DEFAULT_RESOLVE_INTERVAL_S, DEFAULT_STALL_TIMEOUT_S, EngineCoreClient
from tessera_frontend.grpc_api import FrontendServicer
from tessera_frontend.http_server import HttpServer
from tessera_frontend.lora import LoRARegistry
from tessera_frontend.openai_api import create_app
from tessera_frontend.router import DEFAULT_MAX_IMBALANCE, Router
from tessera_frontend.tokenizer_client import DEFAULT_TIMEOUT_S as DEFAULT_TOKENIZER_TIMEOUT_S
from tessera_frontend.tokenizer_client import DEFAULT_TOKENIZER_PORT, TokenizerClient
from tessera_frontend.validation import Limits

log = logging.getLogger("tessera_frontend")

SERVICE_NAME = frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"].full_name
READINESS_POLL_S = 0.5


def _positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:  # (also refuses nan)
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {value!r}")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera-frontend",
                                     description="tessera streaming frontend (public gRPC and OpenAI HTTP APIs)")
    add_common_flags(parser, 50051, "TESSERA_FRONTEND_PORT")
    add_metrics_flag(parser, "frontend")
    add_flag(parser, "--http-port", "TESSERA_HTTP_PORT", 8000, type=int,
             help="port of the OpenAI-compatible HTTP API (0: no HTTP API)")
    add_flag(parser, "--served-model-name", "TESSERA_SERVED_MODEL_NAME", None,
             help="model name of the HTTP API (default: the tokenizer's model name)")
    add_flag(parser, "--api-key", "TESSERA_API_KEY", None,
             help="API key(s), comma-separated: HTTP needs 'Authorization: Bearer <key>' (401 otherwise; /health "
                  "exempt), gRPC the same 'authorization' metadata (UNAUTHENTICATED otherwise; health exempt). "
                  "Empty: no authentication", secret=True)
    add_flag(parser, "--tokenizer-addr", "TESSERA_TOKENIZER_ADDR", "localhost:50052",
             help="tokenizer replicas: host:port, comma-separated; a DNS name resolving to several addresses is "
                  "one replica each. One replica carries the streams, the others stand by; when it goes, the "
                  "requests in flight resume on the next one serving")
    tls.add_client_tls_flags(parser)
    add_flag(parser, "--tokenizer-timeout-s", "TESSERA_TOKENIZER_TIMEOUT_S", DEFAULT_TOKENIZER_TIMEOUT_S,
             type=_positive_seconds,
             help="the longest any wait on the tokenizer may take: a prompt's tokens (else DEADLINE_EXCEEDED), "
                  "a stream message's answer (else the stream is broken off, its requests fail UNAVAILABLE "
                  "and health is NOT_SERVING until the tokenizer answers again)")
    add_flag(parser, "--engine-addrs", "TESSERA_ENGINE_ADDRS", "localhost:50053",
             help="comma-separated engine addresses (host:port); a name resolving to several "
                  "addresses (a headless service) is one replica per address")
    add_flag(parser, "--engine-timeout-s", "TESSERA_ENGINE_TIMEOUT_S", DEFAULT_STALL_TIMEOUT_S,
             type=_positive_seconds,
             help="an engine replica with requests in flight that answers neither a step nor a health check "
                  "for this long has its session broken off: its requests fail UNAVAILABLE (or are retried "
                  "elsewhere when they have no token yet)")
    add_flag(parser, "--engine-resolve-interval", "TESSERA_ENGINE_RESOLVE_INTERVAL", DEFAULT_RESOLVE_INTERVAL_S,
             type=float, help="seconds between DNS resolutions of --engine-addrs")
    add_flag(parser, "--affinity-max-imbalance", "TESSERA_AFFINITY_MAX_IMBALANCE", DEFAULT_MAX_IMBALANCE,
             type=int, help="prefix affinity yields when its replica has this many more requests "
                            "outstanding than the least loaded")
    add_flag(parser, "--max-inflight-requests", "TESSERA_MAX_INFLIGHT_REQUESTS", 256, type=int,
             help="requests in flight past which new ones are refused (RESOURCE_EXHAUSTED / HTTP 429)")
    add_flag(parser, "--stream-interval", "TESSERA_STREAM_INTERVAL", 1, type=int,
             help="tokens per streamed message after a choice's first (as vLLM's --stream-interval): 1 sends "
                  "every token at once; N > 1 holds them until N are ready or the choice ends (fewer messages, "
                  "less CPU per token)")
    add_flag(parser, "--max-n", "TESSERA_MAX_N", 16, type=int, help="largest n a request may ask for")
    add_flag(parser, "--max-logprobs", "TESSERA_MAX_LOGPROBS", 20, type=int,
             help="largest logprobs / prompt_logprobs a request may ask for")
    add_flag(parser, "--max-stop", "TESSERA_MAX_STOP", 16, type=int,
             help="most stop strings a request may give")
    add_flag(parser, "--max-body-bytes", "TESSERA_MAX_BODY_BYTES", 8 << 20, type=int,
             help="largest HTTP request body, answered 413 before it is read past the cap (0: no cap)")
    add_flag(parser, "--allow-runtime-lora-updating", "TESSERA_ALLOW_RUNTIME_LORA_UPDATING", False, type=bool,
             help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (and the gRPC "
                  "LoadLoRAAdapter / UnloadLoRAAdapter), which load or unload a LoRA adapter on every engine "
                  "replica (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); off: those routes are 404 and the "
                  "calls FAILED_PRECONDITION")
    return parser


async def watch_readiness(llm: AsyncLLM, health: Health) -> None:
    """Keep the health status in step with the backends (read ModelInfo once the tokenizer is up)."""
    serving: bool | None = None
    frozen = False
    while True:
        if llm.tokenizer.model_info is None and await llm.tokenizer.is_serving():
            try:
                info = await llm.tokenizer.fetch_model_info()
                log.info("tokenizer ready", extra={"model": info.model_name,
                                                   "max_model_len": info.max_model_len})
            except grpc.aio.AioRpcError as exc:
                log.warning("GetModelInfo failed", extra={"error": exc.details()})
        ready = llm.ready
        if ready and not frozen:
            freeze_startup_heap(log)  # first time ready: the backends' clients and ModelInfo are in
            frozen = True
        if ready != serving:
            await health.set(ready)
            log.info("health changed", extra={"serving": ready,
                                              "max_model_len": llm.max_model_len})
            serving = ready
        await asyncio.sleep(READINESS_POLL_S)


async def serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; the process exit code (1: the gRPC port cannot be bound)."""
    server_tls, backend_tls = tls.server_tls(args), tls.client_tls(args)
    tokenizer = TokenizerClient(args.tokenizer_addr, args.tokenizer_timeout_s, backend_tls)
    engine = EngineCoreClient(parse_engine_addrs(args.engine_addrs),
                              Router(max_imbalance=args.affinity_max_imbalance),
                              resolve_interval_s=args.engine_resolve_interval,
                              stall_timeout_s=args.engine_timeout_s, tls=backend_tls)
    llm = AsyncLLM(tokenizer, engine, stream_interval=args.stream_interval)
    lora = LoRARegistry(engine, allow_updates=args.allow_runtime_lora_updating)
    limits = Limits(max_n=args.max_n, max_logprobs=args.max_logprobs, max_stop=args.max_stop,
                    max_body_bytes=args.max_body_bytes)
    admission = AdmissionController(args.max_inflight_requests)

    keys = ApiKeys(parse_api_keys(args.api_key))
    grpc_server = GrpcServer([SERVICE_NAME], log, grace_s=args.drain_timeout_s,
                             interceptors=tracing.grpc_server_interceptors()  # [] unless tracing is on
                             + ([ApiKeyInterceptor(keys)] if keys.enabled else []))
    frontend_pb2_grpc.add_FrontendServiceServicer_to_server(
        FrontendServicer(llm, limits, admission, lora, args.served_model_name), grpc_server.server)
    if await grpc_server.try_start(
            args.host, args.port, args.metrics_port, tls=server_tls, http_port=args.http_port or None,
            tokenizer=args.tokenizer_addr, engines=[str(e) for e in engine.entries],
            max_inflight_requests=args.max_inflight_requests, api_keys=len(parse_api_keys(args.api_key)),
            allow_runtime_lora_updating=args.allow_runtime_lora_updating) is None:
        await llm.close()
        return 1
    http = None
    if args.http_port:
        app = create_app(llm, limits, admission, args.served_model_name, lora)
        if keys.enabled:
            app.add_middleware(ApiKeyMiddleware, keys=keys)  # outermost: before the body is read
        if tracing.ENABLED:  # a span per HTTP request, a refused key's included
            app.add_middleware(tracing.AsgiTracingMiddleware)
        http = HttpServer(app, args.host, args.http_port, grace_s=grpc_server.grace_s,
                          certfile=args.tls_cert_file if server_tls else None,
                          keyfile=args.tls_key_file if server_tls else None)
        await http.start()
    llm.start()
    readiness = asyncio.create_task(watch_readiness(llm, grpc_server.health), name="readiness")

    await grpc_server.wait_for_stop()
    readiness.cancel()
    await grpc_server.stop(*([http.stop()] if http else []))
    await asyncio.gather(readiness, return_exceptions=True)
    await llm.close()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parse_engine_addrs(args.engine_addrs)
    except ValueError as exc:
        parser.error(f"--engine-addrs: {exc}")
    try:
        parse_engine_addrs(args.tokenizer_addr, DEFAULT_TOKENIZER_PORT, "tokenizer")
    except ValueError as exc:
        parser.error(f"--tokenizer-addr: {exc}")
    tls.check_flags(parser, args)
    for flag in ("max_inflight_requests", "max_n", "engine_resolve_interval", "stream_interval"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0")
    if not 0 <= args.http_port < 65536:
        parser.error("--http-port must be in [0, 65535]")
    return run_service("frontend", serve, args)


if __name__ == "__main__":
    main()
