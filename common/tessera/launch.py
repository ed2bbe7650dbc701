"""tessera's services as child processes: one service (its command line, ports, environment and
log, its gRPC health, its stop) and the three-service stack. `tessera serve`, the test suite's
stack helper and the benchmarks start the services through this module.

    stack = Stack(log_dir, engine_args=["--max-num-seqs", "8"]).start(timeout_s=300)
    ...  # stack.addr("frontend"), stack.http_url, stack.engine.process.pid
    stack.stop()                       # the frontend first (its drain), then the tokenizer and the engine

A child runs `python -m <module> --port <port> [args]` (behind an optional command prefix such
as taskset) in a session of its own, so a terminal's Ctrl-C reaches only the parent, which stops
the children in order; on Linux each child started with die_with_parent also gets SIGTERM
when the thread that started it ends (the parent dying, even by SIGKILL, ends it), so nothing
is left orphaned: start such children from a thread that lives as long as they should. Its stdout and stderr go to its log file (appended: a
restarted service keeps one log), or, with no log file, its stderr is a pipe of text lines for
the parent to read (`tessera serve` shows them) and its stdout is discarded.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tessera.common import logs

HOST = "127.0.0.1"
SERVICE_MODULES = {"tokenizer": "tessera_tokenizer", "engine": "tessera_engine", "frontend": "tessera_frontend"}
STOP_TIMEOUT_S = 15.0      # SIGTERM -> SIGKILL when a service has not exited by then
KILL_WAIT_S = 10.0         # then how long to wait for the killed process
LOG_TAIL_CHARS = 4000

_handed_out: set[int] = set()


def free_port(host: str = HOST) -> int:
    """A port nobody listens on now on `host` and that this process has not handed out before.

    The kernel may give the same port to two bind(0) calls in a row once the first socket is
    closed; two services of one stack on one port would leave one of them unbound (a metrics
    server that cannot bind only logs it, so its URL would reach another service's gRPC)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def health_status(channel: grpc.Channel, service: str = "", timeout: float = 2.0) -> int:
    """grpc.health.v1 Check on a channel: the status (raises grpc.RpcError when unreachable)."""
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return reply.status


def is_serving(addr: str, timeout: float = 1.0) -> bool:
    """Whether the server at addr answers SERVING now (a channel of its own, closed after)."""
    try:
        with grpc.insecure_channel(addr) as channel:
            return health_status(channel, timeout=timeout) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


# -- processes -------------------------------------------------------------------------------------
def _prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _prctl()  # looked up here: a forked child must not load libraries (other threads may hold locks)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: SIGTERM when the thread that forked it ends (PR_SET_PDEATHSIG follows the
    thread, not the process), which the parent's death, even by SIGKILL, does."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def spawn(command: Sequence, env: dict[str, str], log_path: pathlib.Path | None = None,
          die_with_parent: bool = True) -> subprocess.Popen:
    """Start a command in a session of its own: stdout and stderr appended to log_path, or with
    no log_path stderr piped (text lines) and stdout discarded."""
    command = [str(c) for c in command]
    preexec = _die_with_parent if die_with_parent else None
    if log_path is None:
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                bufsize=1, start_new_session=True, preexec_fn=preexec)
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=preexec)


def _signal(process: subprocess.Popen, signum: int, group: bool) -> None:
    try:
        if group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(processes: Iterable[subprocess.Popen], timeout: float = STOP_TIMEOUT_S, group: bool = False) -> None:
    """SIGTERM every one still running, wait for each up to `timeout`, SIGKILL one still up then.
    group=True signals each one's process group (its session), and at the end SIGKILLs whatever
    is left in the groups (children of the processes, such as vLLM's engine core)."""
    processes = [p for p in processes if p is not None]
    for process in processes:
        if process.poll() is None:
            _signal(process, signal.SIGTERM, group)
    for process in processes:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal(process, signal.SIGKILL, group)
            process.wait(KILL_WAIT_S)
    if group:
        for process in processes:
            _signal(process, signal.SIGKILL, True)


# -- one service ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Service:
    """One service process: `python -m <module> --port <port> [args]`, its log, its addresses."""
    name: str
    module: str
    port: int
    args: list[str] = dataclasses.field(default_factory=list)
    log_path: pathlib.Path | None = None   # None: stderr is a pipe (process.stderr), stdout discarded
    process: subprocess.Popen | None = None
    metrics_port: int | None = None        # TESSERA_METRICS_PORT when set (0: no metrics server)
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # added to the environment, last
    host: str = HOST                       # where to reach it; also its bind address with bind_host
    http_port: int | None = None           # a frontend's OpenAI-compatible HTTP API
    health_seen: set[int] = dataclasses.field(default_factory=set)  # statuses wait_serving saw
    base_env: dict[str, str] | None = None  # the environment to start from (None: this process's)
    bind_host: bool = True                 # set TESSERA_BIND_HOST=host
    prefix: list[str] = dataclasses.field(default_factory=list)  # before the python command (taskset ...)
    die_with_parent: bool = True

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}"

    def command(self) -> list[str]:
        return [*self.prefix, sys.executable, "-m", self.module, "--port", str(self.port), *self.args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ if self.base_env is None else self.base_env)
        if self.bind_host:
            env["TESSERA_BIND_HOST"] = self.host
        env["PYTHONUNBUFFERED"] = "1"
        # its log is read back (serve's progress and failure reasons, log_tail, the tests):
        # JSON lines, whatever TESSERA_LOG_FORMAT the parent was given (self.env may still say)
        env["TESSERA_LOG_FORMAT"] = "json"
        if self.metrics_port is not None:
            env["TESSERA_METRICS_PORT"] = str(self.metrics_port)
        return {**env, **self.env}

    def start(self) -> None:
        self.process = spawn(self.command(), self.environment(), self.log_path, self.die_with_parent)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self) -> str:
        if self.log_path is None:
            return "(no log file)"
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"

    def failure_reason(self) -> str | None:
        """Why it failed, as its log says (its last error line: `logs.failure_reason`); None
        when the log says nothing of it or there is no log file."""
        if self.log_path is None:
            return None
        try:
            with open(self.log_path, errors="replace") as log:
                return logs.failure_reason(log)
        except OSError:
            return None

    def wait_serving(self, deadline: float, timeout_s: float | None = None) -> None:
        """Poll its health until SERVING; RuntimeError (with its log tail) when it exits first or
        the monotonic deadline passes (timeout_s: the figure that message quotes)."""
        with grpc.insecure_channel(self.addr) as channel:
            while True:
                code = self.process.poll()
                if code is not None:
                    reason = self.failure_reason()
                    raise RuntimeError(f"{self.name} exited with status {code} before SERVING"
                                       + (f": {reason}" if reason else "") + f"; log tail:\n{self.log_tail()}")
                try:
                    status = health_status(channel)
                    self.health_seen.add(status)
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    after = f" after {timeout_s:g}s" if timeout_s is not None else " by its deadline"
                    raise RuntimeError(f"{self.name} not SERVING{after}; log tail:\n{self.log_tail()}")
                time.sleep(0.25)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, and SIGKILL when it has not exited after `timeout` seconds."""
        if self.running():
            terminate([self.process], timeout)

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as a crashed or OOM-killed one does."""
        if self.running():
            self.process.kill()
            self.process.wait(KILL_WAIT_S)


def start_all(services: Sequence[Service], timeout_s: float) -> None:
    """Start these services at once (a frontend waits for its backends by itself) and wait until
    each is SERVING, one deadline for all; on failure stop them all and raise."""
    try:
        for service in services:
            service.start()
        deadline = time.monotonic() + timeout_s
        for service in services:
            service.wait_serving(deadline, timeout_s)
    except BaseException:
        stop_all(services)
        raise


def stop_all(services: Sequence[Service], timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop services in reverse start order, one after another (a frontend before its backends)."""
    for service in reversed(services):
        service.stop(timeout)


@contextlib.contextmanager
def all_serving(*services: Service, timeout_s: float):
    """start_all, yield the services, stop them in reverse order on exit."""
    start_all(services, timeout_s)
    try:
        yield services
    finally:
        stop_all(services)


def frontend_service(name: str, tokenizer_addr: str, engine_addrs: str, log_dir: pathlib.Path | None,
                     *args: str, http: bool = True, service_class: type[Service] = Service, **fields) -> Service:
    """A frontend (not started) on a free gRPC port in front of these backends; with http its
    OpenAI-compatible HTTP API on a free port too (`http_port`), else none (--http-port 0).
    A --http-port in args wins over the free one."""
    http_port = None
    flags = ["--tokenizer-addr", tokenizer_addr, "--engine-addrs", engine_addrs]
    if "--http-port" in args:
        http_port = int(args[list(args).index("--http-port") + 1]) or None
    elif http:
        http_port = free_port()
        flags += ["--http-port", str(http_port)]
    else:
        flags += ["--http-port", "0"]
    return service_class(name, SERVICE_MODULES["frontend"], free_port(), [*flags, *args],
                         log_dir / f"{name}.log" if log_dir is not None else None, http_port=http_port, **fields)


# -- the stack --------------------------------------------------------------------------------------
class Stack:
    """Tokenizer, engine and frontend as child processes on free loopback ports, logs in log_dir
    (default: a new temporary directory) as tokenizer.log, engine.log, frontend.log.

    `fields` go to every Service (base_env, env, bind_host, metrics_port, ...); `prefix` maps a
    service name to its command prefix (taskset ...); `http` gives the frontend an HTTP port
    (`http_port` chooses it, else a free one)."""

    def __init__(self, log_dir: pathlib.Path | str | None = None, *, tokenizer_args: Sequence[str] = (),
                 engine_args: Sequence[str] = (), frontend_args: Sequence[str] = (), http: bool = True,
                 http_port: int | None = None, prefix: dict[str, list[str]] | None = None,
                 service_class: type[Service] = Service, **fields) -> None:
        self.log_dir = pathlib.Path(log_dir) if log_dir is not None else pathlib.Path(
            tempfile.mkdtemp(prefix="tessera-stack-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        prefix = prefix or {}

        def backend(name: str, args: Sequence[str]) -> Service:
            return service_class(name, SERVICE_MODULES[name], free_port(), list(args), self.log_dir / f"{name}.log",
                                 prefix=list(prefix.get(name, [])), **fields)

        self.tokenizer = backend("tokenizer", tokenizer_args)
        self.engine = backend("engine", engine_args)
        frontend_args = list(frontend_args)
        if http_port is not None:
            frontend_args = ["--http-port", str(http_port), *frontend_args]
        self.frontend = frontend_service("frontend", self.tokenizer.addr, self.engine.addr, self.log_dir,
                                         *frontend_args, http=http, service_class=service_class,
                                         prefix=list(prefix.get("frontend", [])), **fields)
        self.services = [self.tokenizer, self.engine, self.frontend]

    def service(self, name: str) -> Service:
        return {s.name: s for s in self.services}[name]

    def addr(self, name: str) -> str:
        return self.service(name).addr

    @property
    def http_url(self) -> str:
        """Base URL of the frontend's OpenAI-compatible HTTP API (append /v1/...)."""
        return self.frontend.http_url

    def start(self, timeout_s: float) -> "Stack":
        """All three at once, then each SERVING within timeout_s (stopped again on failure)."""
        start_all(self.services, timeout_s)
        return self

    def pids(self) -> dict[str, int]:
        return {s.name: s.process.pid for s in self.services if s.process is not None}

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """The frontend first (its in-flight requests drain), then the engine and the tokenizer."""
        stop_all(self.services, timeout)

    def logs(self) -> str:
        """Every service's log tail (for error messages)."""
        return "\n".join(f"--- {s.name} ---\n{s.log_tail()}" for s in self.services)
