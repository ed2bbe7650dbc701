"""A server under test, run as a user runs it: start its processes (each in a session of its own,
through tessera.launch), wait until its OpenAI API lists a model, sample its process trees' RSS
for its whole life, stop it (SIGTERM to each process group, SIGKILL after a grace period, then
whatever is left in the groups).

  TesseraServer  the three services as `make run` starts them (every flag at its default, the
                 TESSERA_* environment dropped, only ports chosen free)
  VllmServer     `vllm serve <hf dir>` at its defaults, in vLLM's environment (peers/vllm_cpu.py)
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from peers import llama_server, vllm_cpu
from proctree import RssSampler

from tessera import launch

HOST = launch.HOST
STOP_GRACE_S = 30.0


def _http_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


class Server:
    """A server's processes (role -> Popen, each logging to <log_dir>/<role>.log), its OpenAI base URL."""

    name = ""

    def __init__(self, startup_timeout_s: float) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"serve-vs-vllm-{self.name}-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.http_port = launch.free_port()
        self.root_url = f"http://{HOST}:{self.http_port}"   # the OpenAI API is under /v1
        self.base_url = self.root_url + "/v1"
        self.model_id: str | None = None
        self.sampler: RssSampler | None = None
        self.started_s = 0.0

    def launch(self) -> None:
        """Start the processes (fill self.procs)."""
        raise NotImplementedError

    def rss_groups(self) -> dict[str, list[int]]:
        """Named groups of process trees whose summed RSS is sampled."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {}

    def log_path(self, role: str) -> pathlib.Path:
        return self.log_dir / f"{role}.log"

    def start(self) -> None:
        """Launch, then wait until GET /v1/models lists a model (started_s: how long that took)."""
        t = time.perf_counter()
        self.launch()
        self.sampler = RssSampler(self.rss_groups())
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            for role, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{self.name} {role} exited with {p.returncode}; see {self.log_path(role)}:\n"
                                       + self.log_path(role).read_text(errors="replace")[-3000:])
            try:
                models = _http_json(self.base_url + "/models")
                if models and models.get("data"):
                    self.model_id = models["data"][0]["id"]
                    break
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not serving after {self.startup_timeout_s:g} s; logs in {self.log_dir}")
            time.sleep(0.5)
        self.started_s = time.perf_counter() - t

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def stop(self) -> None:
        """The last started first; children left in the process groups (vLLM's engine core) too."""
        launch.terminate(reversed(list(self.procs.values())), timeout=STOP_GRACE_S, group=True)
        if self.sampler:
            self.sampler.stop()


class TesseraServer(Server):
    name = "tessera"

    def __init__(self, startup_timeout_s: float, model: str | None = None, engine_args: list[str] = ()) -> None:
        super().__init__(startup_timeout_s)
        self.model = model  # None: the default model
        self.engine_args = list(engine_args)  # besides the model (benchmarks of a feature: --speculative-config ...)

    def launch(self) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}  # the defaults are measured
        model = ["--model", self.model] if self.model else []
        stack = launch.Stack(self.log_dir, http_port=self.http_port, base_env=base, bind_host=False,
                             engine_args=model + self.engine_args, tokenizer_args=model)
        self.stack = stack  # its services' gRPC addresses (single_overhead.py's engine side)
        for service in stack.services:
            service.metrics_port = launch.free_port()
            service.start()
            self.procs[service.name] = service.process

    def rss_groups(self) -> dict[str, list[int]]:
        return {"engine": [self.procs["engine"].pid], "stack": self.pids()}

    def describe(self) -> dict:
        dtype = None
        try:
            for line in self.log_path("engine").read_text(errors="replace").splitlines():
                if '"dtype"' in line:
                    dtype = json.loads(line).get("dtype", dtype)
        except (OSError, ValueError):
            pass
        return {"dtype": dtype}


class VllmServer(Server):
    name = "vllm"

    def __init__(self, startup_timeout_s: float, venv: pathlib.Path, model_dir: pathlib.Path, env: dict) -> None:
        super().__init__(startup_timeout_s)
        self.venv, self.model_dir, self.env = venv, model_dir, env

    def launch(self) -> None:
        self.procs["server"] = launch.spawn(vllm_cpu.serve_command(self.venv, self.model_dir, HOST, self.http_port),
                                            self.env, self.log_path("server"))

    def rss_groups(self) -> dict[str, list[int]]:
        return {"tree": self.pids()}

    def describe(self) -> dict:
        dtype = None
        try:
            m = re.search(r"dtype=([a-z0-9.]+)", self.log_path("server").read_text(errors="replace"))
            dtype = m.group(1).rstrip(",") if m else None
        except OSError:
            pass
        return {"dtype": dtype}


class LlamaServer(Server):
    """llama.cpp's llama-server (peers/llama_server.py) on a GGUF file."""
    name = "llama-server"

    def __init__(self, startup_timeout_s: float, binary: pathlib.Path, gguf: str) -> None:
        super().__init__(startup_timeout_s)
        self.binary, self.gguf = binary, gguf

    def launch(self) -> None:
        self.procs["server"] = launch.spawn(llama_server.server_command(self.binary, self.gguf, self.http_port, HOST),
                                            dict(os.environ), self.log_path("server"))

    def rss_groups(self) -> dict[str, list[int]]:
        return {"tree": self.pids()}

    def describe(self) -> dict:
        return {"dtype": "gguf (" + pathlib.Path(self.gguf).name + ")"}
