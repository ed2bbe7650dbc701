"""The real three-service stack, started as OS processes for integration tests.

`Stack.start()` launches the tokenizer, the engine and the frontend with
`sys.executable -m <package> --port <free port>`, each on a free loopback port
(all at once: the frontend waits for the others), then waits until each answers
SERVING on grpc.health.v1. If a process dies or stays NOT_SERVING past the
timeout, the error shows the tail of its log. `Stack.stop()` terminates them all.

Use the session-scoped `stack` fixture (import it into a test module, or list
this module in `pytest_plugins`); it starts one stack per test session however
many modules use it. Environment knobs:

    TESSERA_TEST_STARTUP_TIMEOUT   seconds to wait for SERVING (default 300)
    TESSERA_TEST_ENGINE_ARGS       extra engine flags, space-separated
    TESSERA_TEST_TOKENIZER_ARGS    extra tokenizer flags
    TESSERA_TEST_FRONTEND_ARGS     extra frontend flags
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import engine_pb2_grpc, frontend_pb2_grpc, tokenizer_pb2_grpc

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = float(os.environ.get("TESSERA_TEST_STARTUP_TIMEOUT", "300"))
LOG_TAIL_CHARS = 4000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def health_status(channel: grpc.Channel, service: str = "", timeout: float = 2.0) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return reply.status


@dataclasses.dataclass
class Service:
    """One service process: its name, module, port and log file."""
    name: str
    module: str
    port: int
    args: list[str]
    log_path: pathlib.Path
    process: subprocess.Popen | None = None

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, TESSERA_BIND_HOST=HOST, PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module, "--port", str(self.port), *self.args],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"

    def wait_serving(self, deadline: float) -> None:
        with grpc.insecure_channel(self.addr) as channel:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise RuntimeError(f"{self.name} exited with status {code} before SERVING; "
                                       f"log tail:\n{self.log_tail()}")
                try:
                    if health_status(channel) == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not SERVING after {STARTUP_TIMEOUT_S:g}s; "
                                       f"log tail:\n{self.log_tail()}")
                time.sleep(0.25)

    def stop(self, timeout: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


class Stack:
    """Tokenizer + engine + frontend processes and client stubs for each."""

    def __init__(self) -> None:
        self.log_dir = pathlib.Path(tempfile.mkdtemp(prefix="tessera-stack-"))
        extra = lambda var: shlex.split(os.environ.get(var, ""))  # noqa: E731
        self.tokenizer = Service("tokenizer", "tessera_tokenizer", free_port(),
                                 extra("TESSERA_TEST_TOKENIZER_ARGS"), self.log_dir / "tokenizer.log")
        self.engine = Service("engine", "tessera_engine", free_port(),
                              extra("TESSERA_TEST_ENGINE_ARGS"), self.log_dir / "engine.log")
        self.frontend = Service("frontend", "tessera_frontend", free_port(),
                                ["--tokenizer-addr", self.tokenizer.addr,
                                 "--engine-addrs", self.engine.addr,
                                 *extra("TESSERA_TEST_FRONTEND_ARGS")],
                                self.log_dir / "frontend.log")
        self.services = [self.tokenizer, self.engine, self.frontend]
        self._channels: list[grpc.Channel] = []

    def start(self) -> "Stack":
        try:
            for service in self.services:
                service.start()
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            for service in self.services:
                service.wait_serving(deadline)
        except BaseException:
            self.stop()
            raise
        self.frontend_channel = self._channel(self.frontend.addr)
        self.frontend_stub = frontend_pb2_grpc.FrontendServiceStub(self.frontend_channel)
        self.tokenizer_stub = tokenizer_pb2_grpc.TokenizerServiceStub(self._channel(self.tokenizer.addr))
        self.engine_stub = engine_pb2_grpc.EngineServiceStub(self._channel(self.engine.addr))
        return self

    def _channel(self, addr: str) -> grpc.Channel:
        channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self._channels.append(channel)
        return channel

    def stop(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        for service in reversed(self.services):  # frontend first
            service.stop()

    def logs(self) -> str:
        """Every service's log tail (for assertion messages)."""
        return "\n".join(f"--- {s.name} ---\n{s.log_tail()}" for s in self.services)


_shared: Stack | None = None


@pytest.fixture(scope="session")
def stack():
    """The running stack, shared by every test module of the session."""
    global _shared
    if _shared is None:
        _shared = Stack().start()
    yield _shared
    if _shared is not None:
        _shared.stop()
        _shared = None
