"""tessera.common.grpc_server: the serving lifecycle all three services share, on a real
grpc.aio server on a loopback port (health order, reflection, IPv6 brackets, graceful stop)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tessera.common import aio, grpc_server
from tessera.common.flags import DEFAULT_DRAIN_TIMEOUT_S, add_common_flags
from tessera.common.grpc_server import BindError, GrpcServer, bind_address, run_service

from helpers.stack import free_port

pytestmark = pytest.mark.unit

SERVICE = "tessera.test.Sleeper"
SLEEP_METHOD = f"/{SERVICE}/Sleep"
log = logging.getLogger("tessera.test")


def sleeper_handler(started: asyncio.Event) -> grpc.GenericRpcHandler:
    """A unary `Sleep` method: the request is the seconds to sleep as text, the reply is b"done"."""

    async def sleep(request: bytes, context) -> bytes:
        started.set()
        await asyncio.sleep(float(request.decode()))
        return b"done"

    handler = grpc.unary_unary_rpc_method_handler(sleep)  # bytes in, bytes out (no (de)serializers)
    return grpc.method_handlers_generic_handler(SERVICE, {"Sleep": handler})


def make_server(grace_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> tuple[GrpcServer, asyncio.Event]:
    server = GrpcServer([SERVICE], log, grace_s=grace_s)
    started = asyncio.Event()
    server.server.add_generic_rpc_handlers([sleeper_handler(started)])
    return server, started


async def health_of(channel: grpc.aio.Channel, service: str = SERVICE) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                            timeout=5)
    return reply.status


def http_health(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return reply.status, json.loads(reply.read())["status"]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["status"]


def test_bind_address_brackets_ipv6_literals():
    assert bind_address("0.0.0.0", 50051) == "0.0.0.0:50051"
    assert bind_address("localhost", 1) == "localhost:1"
    assert bind_address("::", 50052) == "[::]:50052"
    assert bind_address("::1", 7) == "[::1]:7"
    assert bind_address("[::1]", 7) == "[::1]:7"  # already bracketed: left alone


def test_health_not_serving_until_the_service_says_so_and_reflection_lists_it():
    metrics_port = free_port()

    async def run() -> None:
        server, _ = make_server()
        port = await server.start("127.0.0.1", 0, metrics_port, handle_signals=False)
        assert port > 0 and server.port == port and server.address == "127.0.0.1:0"
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                # Known, and NOT_SERVING, from the first check on (never NOT_FOUND / unknown).
                assert await health_of(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
                assert await health_of(channel, "") == health_pb2.HealthCheckResponse.NOT_SERVING
                assert await asyncio.to_thread(http_health, metrics_port) == (503, "NOT_SERVING")
                await server.health.set(True)
                assert await health_of(channel) == health_pb2.HealthCheckResponse.SERVING
                assert await health_of(channel, "") == health_pb2.HealthCheckResponse.SERVING
                assert await asyncio.to_thread(http_health, metrics_port) == (200, "SERVING")

                reflection = reflection_pb2_grpc.ServerReflectionStub(channel)

                async def requests():
                    yield reflection_pb2.ServerReflectionRequest(list_services="")

                async for reply in reflection.ServerReflectionInfo(requests(), timeout=5):
                    names = {s.name for s in reply.list_services_response.service}
                assert {SERVICE, "grpc.health.v1.Health",
                        "grpc.reflection.v1alpha.ServerReflection"} <= names
        finally:
            await server.stop()
        assert not server.health.serving
        with pytest.raises(OSError):  # the metrics server is closed with the gRPC one
            await asyncio.to_thread(http_health, metrics_port)

    aio.run(run(), "asyncio")


def test_ipv6_loopback_is_bracketed():
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")

    async def run() -> None:
        server, _ = make_server()
        port = await server.start("::1", 0, handle_signals=False)
        try:
            assert server.address == "[::1]:0"
            async with grpc.aio.insecure_channel(f"[::1]:{port}") as channel:
                assert await health_of(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await server.stop()

    aio.run(run(), "asyncio")


def test_an_address_that_cannot_be_bound_is_a_bind_error():
    async def run() -> None:
        server, _ = make_server()
        with pytest.raises(BindError, match="cannot listen on 192.0.2.1:"):
            await server.start("192.0.2.1", free_port(), handle_signals=False)  # not this machine's

    aio.run(run(), "asyncio")


def test_try_start_logs_an_address_that_cannot_be_bound_and_answers_none(caplog):
    async def run() -> None:
        server, _ = make_server()
        with caplog.at_level(logging.ERROR, logger=log.name):
            assert await server.try_start("192.0.2.1", free_port(), handle_signals=False) is None
        assert any("cannot listen on 192.0.2.1:" in r.getMessage() for r in caplog.records)

    aio.run(run(), "asyncio")


def test_run_service_makes_serves_code_the_exit_status(monkeypatch):
    args = argparse.Namespace(log_level="DEBUG", log_format="text", event_loop="asyncio")
    logging_set_up = []  # (the real one would take the root logger's handlers from pytest)
    monkeypatch.setattr(grpc_server, "setup_logging", lambda *a: logging_set_up.append(a))

    async def serve(code: int) -> int:
        return code

    assert run_service("test", lambda a: serve(0), args) == 0
    assert logging_set_up == [("test", "DEBUG", "text")]
    with pytest.raises(SystemExit) as info:
        run_service("test", lambda a: serve(1), args)
    assert info.value.code == 1


def test_sigterm_stops_and_open_calls_drain_within_the_grace():
    """SIGTERM: wait_for_stop returns; health goes NOT_SERVING at once; a call that ends within
    the grace period completes, and no new call is taken."""

    async def run() -> None:
        server, started = make_server(grace_s=5.0)
        port = await server.start("127.0.0.1", 0)
        await server.health.set(True)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            sleep = channel.unary_unary(SLEEP_METHOD)
            call = asyncio.ensure_future(sleep(b"0.5", timeout=10))
            await started.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(server.wait_for_stop(), 5)
            stopping = asyncio.ensure_future(server.stop())
            await asyncio.sleep(0.05)
            assert not server.health.serving
            with pytest.raises(grpc.aio.AioRpcError):  # no new calls once stopping
                await sleep(b"0", timeout=2)
            assert await call == b"done"
            await asyncio.wait_for(stopping, 5)

    aio.run(run(), "asyncio")


def test_calls_longer_than_the_grace_are_cancelled():
    async def run() -> None:
        server, started = make_server(grace_s=0.2)
        port = await server.start("127.0.0.1", 0, handle_signals=False)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = asyncio.ensure_future(channel.unary_unary(SLEEP_METHOD)(b"30", timeout=60))
            await started.wait()
            server.request_stop()
            await server.wait_for_stop()
            loop = asyncio.get_running_loop()
            began = loop.time()
            await server.stop()
            assert loop.time() - began < 3
            with pytest.raises(grpc.aio.AioRpcError):
                await call

    aio.run(run(), "asyncio")


def test_stop_runs_other_shutdowns_alongside():
    async def run() -> None:
        server, _ = make_server(grace_s=0.1)
        await server.start("127.0.0.1", 0, handle_signals=False)
        done = []

        async def other() -> None:
            await asyncio.sleep(0.05)
            done.append("other")

        await server.stop(other())
        assert done == ["other"]

    aio.run(run(), "asyncio")


def test_drain_timeout_flag_and_env(monkeypatch):
    def parse(argv: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_common_flags(parser, 1, "X_PORT")
        return parser.parse_args(argv)

    assert parse([]).drain_timeout_s == DEFAULT_DRAIN_TIMEOUT_S == 30
    assert parse(["--drain-timeout-s", "0"]).drain_timeout_s == 0
    assert parse(["--shutdown-grace-s", "2"]).drain_timeout_s == 2  # the former name
    monkeypatch.setenv("TESSERA_DRAIN_TIMEOUT_S", "12.5")
    assert parse([]).drain_timeout_s == 12.5
    assert parse(["--drain-timeout-s", "1"]).drain_timeout_s == 1
    with pytest.raises(SystemExit):
        parse(["--drain-timeout-s", "-1"])
