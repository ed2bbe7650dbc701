"""The real three-service stack, started as OS processes for integration tests (through
tessera.launch, the launcher `tessera serve` and the benchmarks use too).

`Stack.start()` launches the tokenizer, the engine and the frontend with
`sys.executable -m <package> --port <free port>`, each on a free loopback port
(all at once: the frontend waits for the others), then waits until each answers
SERVING on grpc.health.v1. If a process dies or stays NOT_SERVING past the
timeout, the error shows the tail of its log. `Stack.stop()` terminates them all.

The frontend also serves its OpenAI-compatible HTTP API on a free port
(`Stack.http_url`). `frontend_service()` makes an extra frontend process (its own
flags) in front of running backends, for tests that need a differently configured
frontend without loading the model again.

Use the session-scoped `stack` fixture (import it into a test module, or list
this module in `pytest_plugins`); it starts one stack per test session however
many modules use it. Environment knobs:

    TESSERA_TEST_STARTUP_TIMEOUT   seconds to wait for SERVING (default 300)
    TESSERA_TEST_ENGINE_ARGS       extra engine flags, space-separated
    TESSERA_TEST_TOKENIZER_ARGS    extra tokenizer flags
    TESSERA_TEST_FRONTEND_ARGS     extra frontend flags

Each service also gets a free metrics port (env TESSERA_METRICS_PORT; `Service.metrics_url`),
and `Service.env` adds environment variables for one process (e.g. fault injection).

For tests of one engine process: `engine_service(*flags)` starts one and yields it with a
`stub`, `EngineSession` drives its Session stream, and `wait_engine_idle` polls it until
nothing runs and every KV block is free.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import queue
import shlex
import signal
import tempfile
import time

import grpc
import pytest

from tessera import launch
from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.launch import HOST, LOG_TAIL_CHARS, free_port, health_status  # noqa: F401  (the tests' names)
from tessera.v1 import engine_pb2, engine_pb2_grpc, frontend_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc

STARTUP_TIMEOUT_S = float(os.environ.get("TESSERA_TEST_STARTUP_TIMEOUT", "300"))


@dataclasses.dataclass
class Service(launch.Service):
    """One service process (tessera.launch.Service) with the tests' defaults: a free metrics port
    of its own, and an engine in float32 with a set quantized row limit unless the environment
    or the test says otherwise."""
    metrics_port: int | None = dataclasses.field(default_factory=free_port)
    # tests restart services from worker threads (test_soak): a child tied to the thread that
    # started it would get SIGTERM when that thread ends; the test session stops them itself
    die_with_parent: bool = False
    timed_rows: bool = False  # engine: not batch-invariant, the quantized row limit timed at start

    def environment(self) -> dict[str, str]:
        # Engines under test run in float32 unless a test says otherwise: the dtype outputs are
        # checked against HF transformers in. (The container test runs the images at their defaults.)
        # timed_rows: --no-batch-invariant, so that the quantized crossover is timed at start
        # (tests/engine/test_service.py checks the timing).
        defaults = {}
        if self.module == "tessera_engine":
            defaults["TESSERA_DTYPE"] = "float32"
            if self.timed_rows:
                defaults["TESSERA_BATCH_INVARIANT"] = "false"
        return {**defaults, **super().environment()}

    def wait_serving(self, deadline: float, timeout_s: float | None = STARTUP_TIMEOUT_S) -> None:
        super().wait_serving(deadline, timeout_s)


def frontend_service(name: str, tokenizer_addr: str, engine_addrs: str, log_dir: pathlib.Path,
                     *args: str) -> Service:
    """A frontend process (not started) with its own gRPC and HTTP ports in front of these backends."""
    return launch.frontend_service(name, tokenizer_addr, engine_addrs, log_dir, *args, service_class=Service)


@contextlib.contextmanager
def all_serving(*services: Service):
    """Start these services at once, wait until each is SERVING (one deadline), yield them;
    stop them in reverse order on exit."""
    with launch.all_serving(*services, timeout_s=STARTUP_TIMEOUT_S):
        yield services


@contextlib.contextmanager
def tokenizer_and_frontend(stack: "Stack", name: str, *frontend_args: str):
    """A tokenizer process of its own and a frontend (these flags) in front of it and the shared
    stack's engine, both SERVING: for tests that stop, hang or restart the tokenizer without
    touching the shared one. Yields (tokenizer, frontend); a stopped (SIGSTOP) tokenizer is
    continued before both are stopped."""
    tokenizer = Service(f"tokenizer-{name}", "tessera_tokenizer", free_port(), [],
                        stack.log_dir / f"tokenizer-{name}.log")
    frontend = frontend_service(f"frontend-{name}", tokenizer.addr, stack.engine.addr, stack.log_dir,
                                *frontend_args)
    with all_serving(tokenizer, frontend):
        try:
            yield tokenizer, frontend
        finally:
            if tokenizer.running():
                os.kill(tokenizer.process.pid, signal.SIGCONT)


@contextlib.contextmanager
def serving(service: Service):
    """Start `service`, wait until it is SERVING and yield a channel to it; stop it on exit."""
    service.start()
    try:
        service.wait_serving(time.monotonic() + STARTUP_TIMEOUT_S)
        with grpc.insecure_channel(service.addr, options=CHANNEL_OPTIONS) as channel:
            yield channel
    finally:
        service.stop()


@contextlib.contextmanager
def engine_service(*flags: str, log_prefix: str = "tessera-engine-", **fields):
    """An engine process with these flags (and Service `fields`), SERVING; yields its Service with
    `stub` (EngineServiceStub) and `channel` set. Its log is engine.log in a new temporary directory."""
    log = pathlib.Path(tempfile.mkdtemp(prefix=log_prefix)) / "engine.log"
    service = Service("engine", "tessera_engine", free_port(), list(flags), log, **fields)
    with serving(service) as channel:
        service.channel = channel
        service.stub = engine_pb2_grpc.EngineServiceStub(channel)
        yield service


class EngineSession:
    """An engine Session stream driven from a test: put SessionInputs, read EngineStepOutputs from `call`."""

    def __init__(self, stub, timeout: float | None = 120) -> None:
        self.inputs: queue.Queue = queue.Queue()
        self.call = stub.Session(iter(self.inputs.get, None), timeout=timeout)

    def send(self, **fields) -> None:
        self.inputs.put(engine_pb2.SessionInput(**fields))

    def add(self, *requests: engine_pb2.EngineRequest) -> None:
        self.send(add=list(requests))

    def abort(self, *request_ids: str) -> None:
        self.send(abort=engine_pb2.AbortRequests(request_ids=list(request_ids)))

    def run(self, request_ids: set[str]) -> dict[str, dict]:
        """Read until every id in `request_ids` finished; per id: tokens, prompt and cached tokens, reason."""
        got = {i: {"tokens": [], "cached": 0, "reason": 0, "prompt": 0} for i in request_ids}
        done: set[str] = set()
        for message in self.call:
            for o in message.outputs:
                g = got[o.request_id]
                g["tokens"].extend(o.new_token_ids)
                g["cached"] = max(g["cached"], o.num_cached_tokens)
                g["prompt"] = o.num_prompt_tokens
                if o.finish_reason:
                    g["reason"] = o.finish_reason
                    done.add(o.request_id)
            if done == request_ids:
                return got
        raise AssertionError(f"stream ended before {request_ids - done} finished")

    def close(self) -> None:
        """The client goes away: end the input stream and cancel the call."""
        self.inputs.put(None)
        self.call.cancel()


class Stack(launch.Stack):
    """Tokenizer + engine + frontend processes (tessera.launch.Stack, the tests' Service and the
    TESSERA_TEST_*_ARGS flags) and client stubs for each."""

    def __init__(self) -> None:
        extra = lambda var: shlex.split(os.environ.get(var, ""))  # noqa: E731
        super().__init__(tokenizer_args=extra("TESSERA_TEST_TOKENIZER_ARGS"),
                         engine_args=extra("TESSERA_TEST_ENGINE_ARGS"),
                         frontend_args=extra("TESSERA_TEST_FRONTEND_ARGS"), service_class=Service)
        self._channels: list[grpc.Channel] = []

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> "Stack":
        super().start(timeout_s)  # stops them all again when one fails
        self.frontend_channel = self._channel(self.frontend.addr)
        self.frontend_stub = frontend_pb2_grpc.FrontendServiceStub(self.frontend_channel)
        self.tokenizer_stub = tokenizer_pb2_grpc.TokenizerServiceStub(self._channel(self.tokenizer.addr))
        self.engine_stub = engine_pb2_grpc.EngineServiceStub(self._channel(self.engine.addr))
        return self

    def _channel(self, addr: str) -> grpc.Channel:
        channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self._channels.append(channel)
        return channel

    def stop(self, timeout: float = launch.STOP_TIMEOUT_S) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        super().stop(timeout)  # frontend first


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


def engine_idle(stats: engine_pb2.EngineStats) -> bool:
    """Nothing runs or waits and every KV block is free."""
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks_free == stats.num_blocks_total


def wait_engine_idle(engine_stub, seconds: float = 3.0, require: bool = False) -> engine_pb2.EngineStats:
    """Poll an engine until it is idle (engine_idle) or `seconds` pass; return its last EngineStats.
    With require=True an engine still busy after `seconds` fails the test."""
    deadline = time.monotonic() + seconds
    while True:
        stats = engine_stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
        if engine_idle(stats):
            return stats
        if time.monotonic() > deadline:
            assert not require, f"engine not idle after {seconds:g}s: {stats}"
            return stats
        time.sleep(0.05)


@pytest.fixture(scope="module")
def client(stack):
    """The real `openai` client on the session stack's HTTP API."""
    import openai

    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model(stack) -> str:
    """The served model's name, as the tokenizer reports it."""
    return stack.tokenizer_stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest(), timeout=10).model_name

