"""The compose stack as separate hosts: each service in its own network namespace.

Each of the compose file's three services runs as a process in a network namespace of its
own, with its own address on a bridge and the compose environment as it is (container
ports, service host names: nothing rewritten). Host names resolve through
/etc/netns/<ns>/hosts, so the frontend reaches `tokenizer:50052` and `engine:50053` only
through those addresses, as containers or pods do. The test client sits in the root
namespace on the same bridge.

Then the engine's link is taken down: a new request must fail with a clear UNAVAILABLE
within seconds, not hang; a request already in flight waits for a replica and, once the
link is back up, continues there with the same answer; new requests succeed again.

Root only (network namespaces, veth pairs, a bridge); skipped, saying so, otherwise.
Addresses: a random /24 of 10.214.0.0/16 not routed here already; everything made is
removed at the end.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import grpc
import pytest

from helpers.stack import Service, all_serving
from helpers.deploy import compose_bin, compose_config, compose_containers, console_script_module  # noqa: F401
from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

ORDER = ("tokenizer", "engine", "frontend")
# The frontend checks an engine's health every second (3 s timeout): a dead link must
# surface well within this.
UNAVAILABLE_WITHIN_S = 20.0

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2 (`ip`)")]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


@dataclasses.dataclass
class NetnsService(Service):
    """A service process inside network namespace `netns` (its `host` is its address there)."""
    netns: str = ""

    def start(self) -> None:
        env = {**os.environ, "TESSERA_BIND_HOST": self.host, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, sys.executable, "-m", self.module, *self.args],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


class Hosts:
    """A bridge in the root namespace and one namespace per host, each on a veth pair."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.tag = secrets.token_hex(2)
        self.bridge = f"tsrbr{self.tag}"
        self.subnet = self._free_subnet()
        hosts = list(self.subnet.hosts())
        self.gateway = hosts[0]
        self.addr = {name: hosts[i + 1] for i, name in enumerate(names)}
        self.netns = {name: f"tsr-{self.tag}-{name[:3]}" for name in names}
        self.link = {name: f"tsr{self.tag}{name[:3]}" for name in names}  # root-side veth (<= 15 chars)

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        routes = ip("-4", "route", "show").stdout
        used = [ipaddress.ip_network(line.split()[0], strict=False) for line in routes.splitlines()
                if line and line.split()[0][0].isdigit()]
        for _ in range(64):
            net = ipaddress.ip_network(f"10.214.{secrets.randbelow(256)}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
        raise RuntimeError("no free /24 in 10.214.0.0/16")

    def up(self) -> None:
        prefix = self.subnet.prefixlen
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/{prefix}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        lines = ["127.0.0.1 localhost"] + [f"{a} {n}" for n, a in self.addr.items()]
        for name, ns in self.netns.items():
            ip("netns", "add", ns)
            etc = pathlib.Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")
            peer = f"{self.link[name]}p"
            ip("link", "add", self.link[name], "type", "veth", "peer", "name", peer)
            ip("link", "set", peer, "netns", ns)
            ip("link", "set", self.link[name], "master", self.bridge)
            ip("link", "set", self.link[name], "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", peer, "name", "eth0")
            ip("-n", ns, "addr", "add", f"{self.addr[name]}/{prefix}", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def set_link(self, name: str, up: bool) -> None:
        ip("link", "set", self.link[name], "up" if up else "down")

    def down(self) -> None:
        for name, ns in self.netns.items():
            ip("netns", "del", ns, check=False)          # takes its veth pair with it
            ip("link", "del", self.link[name], check=False)
            shutil.rmtree(pathlib.Path("/etc/netns") / ns, ignore_errors=True)
        ip("link", "del", self.bridge, check=False)


def generate(addr: str, timeout: float) -> tuple[str, int]:
    request = frontend_pb2.GenerateRequest(
        chat=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(
            role="user", content="What is the capital of France?")]),
        sampling_params=common_pb2.SamplingParams(max_tokens=8, temperature=0.0))
    with grpc.insecure_channel(addr, options=CHANNEL_OPTIONS) as channel:
        replies = list(frontend_pb2_grpc.FrontendServiceStub(channel).Generate(request, timeout=timeout))
    return "".join(r.text for r in replies), replies[-1].finish_reason


@pytest.fixture
def hosts():
    made = Hosts(ORDER)
    try:
        made.up()
    except (RuntimeError, OSError) as exc:
        made.down()
        pytest.skip(f"cannot make network namespaces here: {exc}")
    yield made
    made.down()


def test_services_as_separate_hosts(hosts, compose_bin):  # noqa: F811 (the fixture)
    containers = {c.name: c for c in compose_containers(compose_config(compose_bin, []))}
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="tessera-netns-"))
    services = []
    for name in ORDER:
        c = containers[name]
        env = {k: v for k, v in c.env.items() if k not in ("PATH", "HOME")}
        service = NetnsService(name, console_script_module(c.kind, c.argv[0]),
                               int(env[f"TESSERA_{c.kind.upper()}_PORT"]), c.argv[1:],
                               log_dir / f"{name}.log", host=str(hosts.addr[name]), netns=hosts.netns[name])
        service.env = env
        services.append(service)
    logs = lambda: "\n".join(f"--- {s.name} ---\n{s.log_tail()}" for s in services)  # noqa: E731
    frontend = services[-1]
    try:
        with all_serving(*services):  # stopped in reverse order on the way out
            text, finish = generate(frontend.addr, timeout=120)
            assert text.strip() and finish != common_pb2.FINISH_REASON_UNSPECIFIED, logs()
            first_text, first_finish = text, finish

            # The engine's host drops off the network: no RST, no FIN, packets just vanish.
            hosts.set_link("engine", up=False)
            # (a) a request sent at once, before the frontend can know: its session is broken off
            # (keepalive) and it waits for a replica to migrate to (up to --engine-timeout-s)
            pool = concurrent.futures.ThreadPoolExecutor(1)
            start = time.monotonic()
            racing = pool.submit(generate, frontend.addr, 90)
            # (b) a request once the frontend's health check has had its few seconds: a clear
            # UNAVAILABLE that names the engine, quickly.
            time.sleep(max(0.0, 6.0 - (time.monotonic() - start)))
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as failure:
                generate(frontend.addr, timeout=60)
            elapsed = time.monotonic() - start
            assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, \
                f"{failure.value.code()}: {failure.value.details()} after {elapsed:.1f}s\n{logs()}"
            assert elapsed < UNAVAILABLE_WITHIN_S, f"UNAVAILABLE only after {elapsed:.1f}s"
            assert "engine" in (failure.value.details() or "").lower(), failure.value.details()

            # Back on the network: served again.
            hosts.set_link("engine", up=True)
            deadline = time.monotonic() + 60
            while True:
                try:
                    text, finish = generate(frontend.addr, timeout=30)
                    break
                except grpc.RpcError as exc:
                    if time.monotonic() > deadline:
                        pytest.fail(f"not served after the link came back: {exc.code()} {exc.details()}\n{logs()}")
                    time.sleep(1)
            assert text.strip()
            # The request sent over the dead link did not hang on it (the frontend's engine channel
            # needs keepalive pings to notice a silent link): it moved to the engine once back,
            # under a new engine request id, and answered as the first request did.
            raced_text, raced_finish = racing.result(timeout=90)
            pool.shutdown()
            assert raced_text == first_text and raced_finish == first_finish, (raced_text, first_text)
    except BaseException:
        print(logs())
        raise
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
