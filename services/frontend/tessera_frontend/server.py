"""The frontend process: flags, wiring, health, reflection, graceful shutdown.

Health stays NOT_SERVING until the tokenizer answers SERVING (and its ModelInfo is
read), the detokenize stream is open and at least one engine replica has an open
Session; a watcher keeps polling, so the services may start in any order.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc

from tessera.common.flags import add_common_flags, add_flag
from tessera.common.grpc_service import CHANNEL_OPTIONS, Health, add_reflection
from tessera.common.logs import setup_logging
from tessera.v1 import frontend_pb2, frontend_pb2_grpc
from tessera_frontend.async_llm import AsyncLLM
from tessera_frontend.engine_client import EngineCoreClient
from tessera_frontend.grpc_api import FrontendServicer, Limits
from tessera_frontend.router import Router
from tessera_frontend.tokenizer_client import TokenizerClient

log = logging.getLogger("tessera_frontend")

SERVICE_NAME = frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"].full_name
SHUTDOWN_GRACE_S = 5.0
READINESS_POLL_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera-frontend",
                                     description="tessera streaming frontend (public gRPC API)")
    add_common_flags(parser, 50051, "TESSERA_FRONTEND_PORT")
    add_flag(parser, "--tokenizer-addr", "TESSERA_TOKENIZER_ADDR", "localhost:50052",
             help="tokenizer service address")
    add_flag(parser, "--engine-addrs", "TESSERA_ENGINE_ADDRS", "localhost:50053",
             help="comma-separated engine replica addresses")
    add_flag(parser, "--max-n", "TESSERA_MAX_N", 16, type=int, help="largest n a request may ask for")
    add_flag(parser, "--max-logprobs", "TESSERA_MAX_LOGPROBS", 20, type=int,
             help="largest logprobs / prompt_logprobs a request may ask for")
    add_flag(parser, "--max-stop", "TESSERA_MAX_STOP", 16, type=int,
             help="most stop strings a request may give")
    return parser


def parse_engine_addrs(value: str) -> list[str]:
    addrs = [a.strip() for a in value.split(",") if a.strip()]
    if not addrs:
        raise ValueError("--engine-addrs names no engine")
    return addrs


async def watch_readiness(llm: AsyncLLM, health: Health) -> None:
    """Keep the health status in step with the backends (read ModelInfo once the tokenizer is up)."""
    serving: bool | None = None
    while True:
        if llm.tokenizer.model_info is None and await llm.tokenizer.is_serving():
            try:
                info = await llm.tokenizer.fetch_model_info()
                log.info("tokenizer ready", extra={"model": info.model_name,
                                                   "max_model_len": info.max_model_len})
            except grpc.aio.AioRpcError as exc:
                log.warning("GetModelInfo failed", extra={"error": exc.details()})
        ready = llm.ready
        if ready != serving:
            await health.set(ready)
            log.info("health changed", extra={"serving": ready,
                                              "max_model_len": llm.max_model_len})
            serving = ready
        await asyncio.sleep(READINESS_POLL_S)


async def serve(args: argparse.Namespace) -> None:
    tokenizer = TokenizerClient(args.tokenizer_addr)
    engine = EngineCoreClient(parse_engine_addrs(args.engine_addrs), Router())
    llm = AsyncLLM(tokenizer, engine)
    limits = Limits(max_n=args.max_n, max_logprobs=args.max_logprobs, max_stop=args.max_stop)

    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    frontend_pb2_grpc.add_FrontendServiceServicer_to_server(FrontendServicer(llm, limits), server)
    health = Health(server, [SERVICE_NAME])
    add_reflection(server, [SERVICE_NAME])
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await health.set(False)
    await server.start()
    log.info("frontend listening", extra={"port": port, "tokenizer": args.tokenizer_addr,
                                          "engines": [r.addr for r in engine.replicas]})
    llm.start()
    readiness = asyncio.create_task(watch_readiness(llm, health), name="readiness")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    log.info("shutting down", extra={"grace_s": SHUTDOWN_GRACE_S})
    readiness.cancel()
    await health.set(False)
    await server.stop(SHUTDOWN_GRACE_S)
    await asyncio.gather(readiness, return_exceptions=True)
    await llm.close()
    log.info("stopped")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging("frontend", args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
