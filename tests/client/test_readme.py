"""client/README.md's python example runs as written against the stack (its address through
TESSERA_FRONTEND_ADDR, which the client reads: `make run`'s localhost:50051 otherwise), with the
dev venv's packages and with tessera-client alone: `pip install ./client` into a fresh venv
gives a working client (its own tessera.v1 stubs, compiled from protos/ at build time) with only
grpcio and protobuf, no torch / transformers / tessera-common (slow: a venv and a package build)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import venv

import pytest

from helpers.stack import stack  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "client" / "README.md"


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "client/README.md should have one ```python example"
    return blocks[0]


def run_example(python: str, frontend_addr: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_API_KEY"}
    env["TESSERA_FRONTEND_ADDR"] = frontend_addr
    # run outside the repository, so that only the installed packages are imported
    return subprocess.run([python, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def check_output(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"\[(stop|length), \d+ tokens\]", out), out
    assert "{'city': " in out, out                       # the JSON answer
    assert re.search(r"^0 '.*' -", out, flags=re.M) and re.search(r"^1 '", out, flags=re.M), out
    assert re.search(r"^get_weather \{'city': ", out, flags=re.M), out
    assert "refused: sampling_params.max_tokens" in out or "refused: max_tokens" in out, out


def test_readme_example_runs(stack, tmp_path):  # noqa: F811
    check_output(run_example(sys.executable, stack.frontend.addr, tmp_path))


@pytest.mark.slow
def test_standalone_install_runs_the_example(stack, tmp_path):  # noqa: F811
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    done = subprocess.run([python, "-m", "pip", "install", "-q", str(ROOT / "client")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            timeout=60).stdout.lower()
    names = {line.split("==")[0] for line in listed.split()}
    assert "tessera-client" in names and {"grpcio", "protobuf"} <= names, names
    assert not names & {"torch", "transformers", "tessera-common", "numpy"}, names
    probe = ("import tessera.client, tessera.v1.frontend_pb2_grpc, importlib.util as u;"
             "assert u.find_spec('tessera.common') is None; print(tessera.v1.__file__)")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and str(env_dir) in done.stdout, done.stderr
    check_output(run_example(python, stack.frontend.addr, tmp_path))
