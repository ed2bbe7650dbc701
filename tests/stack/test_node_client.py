"""A second language on the public gRPC API: Node's @grpc/grpc-js (from npm) reads protos/ as it
is (@grpc/proto-loader, no generated code) and drives FrontendService on the real stack
(tests/stack/node/client.mjs): a streamed answer, a cancellation the engine sees, a deadline, a
bad field, ListModels and GetServerInfo.

The packages (tests/stack/node/package.json and its lock, exact versions) are installed with
`npm install` into a cache directory reused between runs, TESSERA_TEST_NPM_DIR (default
~/.cache/tessera-test-npm). Without node and npm, or when the install fails (offline), every
test here is skipped with the reason.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest

from helpers.stack import stack, wait_engine_idle  # noqa: F401  (the session fixture)
from tessera.v1 import common_pb2, engine_pb2, frontend_pb2, tokenizer_pb2

pytestmark = pytest.mark.integration

NODE_DIR = pathlib.Path(__file__).parent / "node"
PROTOS = pathlib.Path(__file__).resolve().parents[2] / "protos"
NPM_DIR = pathlib.Path(os.environ.get("TESSERA_TEST_NPM_DIR", pathlib.Path.home() / ".cache" / "tessera-test-npm"))
PACKAGE_FILES = ("package.json", "package-lock.json")
INSTALL_TIMEOUT_S = 300


def _installed() -> bool:
    """The cache holds node_modules installed from these very package files."""
    return (NPM_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir() and all(
        (NPM_DIR / name).is_file() and (NPM_DIR / name).read_bytes() == (NODE_DIR / name).read_bytes()
        for name in PACKAGE_FILES)


@pytest.fixture(scope="module")
def npm_dir() -> pathlib.Path:
    """The directory whose node_modules has the client's packages (installed once, then reused)."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: the Node client test needs node and npm")
    if not _installed():
        NPM_DIR.mkdir(parents=True, exist_ok=True)
        for name in PACKAGE_FILES:
            shutil.copyfile(NODE_DIR / name, NPM_DIR / name)
        try:
            done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=NPM_DIR,
                                  capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install in {NPM_DIR} took over {INSTALL_TIMEOUT_S}s (offline?)")
        if done.returncode != 0:
            (NPM_DIR / "package.json").unlink(missing_ok=True)  # not a good install: try again next run
            pytest.skip(f"npm install in {NPM_DIR} failed (offline?): {done.stderr.strip()[-500:]}")
    return NPM_DIR


def _command(npm_dir: pathlib.Path, stack, scenario: str) -> tuple[list[str], dict]:
    return (["node", str(NODE_DIR / "client.mjs"), scenario, stack.frontend.addr, str(PROTOS)],
            {**os.environ, "TESSERA_NPM_DIR": str(npm_dir)})


def node_client(npm_dir: pathlib.Path, stack, scenario: str) -> dict:
    """Run one scenario of client.mjs; its JSON result."""
    command, env = _command(npm_dir, stack, scenario)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_streamed_answer(npm_dir, stack):
    result = node_client(npm_dir, stack, "stream")
    assert result["code"] == "OK", result
    messages = result["messages"]
    assert sum(1 for m in messages if m["text"]) >= 2, messages  # the text came in pieces
    assert all(m["finish_reason"] == "FINISH_REASON_UNSPECIFIED" for m in messages[:-1])
    last = messages[-1]
    assert last["finish_reason"] == "FINISH_REASON_LENGTH"
    ids = [t for m in messages for t in m["token_ids"]]
    assert last["usage"]["completion_tokens"] == len(ids) == 24
    assert last["usage"]["prompt_tokens"] > 0
    assert len({m["request_id"] for m in messages}) == 1
    # the same greedy answer a Python client gets: Node's request was read as written
    python = stack.frontend_stub.Complete(frontend_pb2.GenerateRequest(
        chat=tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(
            role="user", content="What is the capital of France? Answer in one sentence.")]),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)), timeout=120)
    assert "".join(m["text"] for m in messages) == python.choices[0].text
    assert ids == list(python.choices[0].token_ids)
    assert "Paris" in python.choices[0].text


def test_cancel_mid_stream_aborts_in_engine(npm_dir, stack):
    command, env = _command(npm_dir, stack, "cancel")
    with subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as node:
        try:
            first = json.loads(node.stdout.readline() or "{}")
            assert first.get("streaming", 0) >= 3, (first, node.stderr.read() if node.poll() is not None else "")
            running = stack.engine_stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
            assert running.num_running + running.num_waiting >= 1
            node.stdin.write("cancel\n")
            node.stdin.flush()
            out, err = node.communicate(timeout=60)
        finally:
            if node.poll() is None:
                node.kill()
    assert node.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["code"] == "CANCELLED" and result["received"] < 400, result
    wait_engine_idle(stack.engine_stub, require=True)  # the frontend aborted it in the engine


def test_deadline_exceeded(npm_dir, stack):
    result = node_client(npm_dir, stack, "deadline")
    assert result["code"] == "DEADLINE_EXCEEDED", result
    wait_engine_idle(stack.engine_stub, require=True)  # the expired call was aborted in the engine too


def test_bad_field(npm_dir, stack):
    result = node_client(npm_dir, stack, "bad_field")
    assert result["code"] == "INVALID_ARGUMENT", result
    assert result["details"].startswith("sampling_params.temperature: "), result


def test_list_models_and_server_info(npm_dir, stack):
    result = node_client(npm_dir, stack, "models")
    assert result["code"] == "OK", result
    model = stack.tokenizer_stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest(), timeout=10)
    engine = stack.engine_stub.GetInfo(engine_pb2.EngineInfoRequest(), timeout=10)
    base = result["models"][0]
    assert (base["id"], base["parent"], base["max_model_len"]) == (model.model_name, "", engine.max_model_len)
    info = result["info"]
    assert info["model"] == model.model_name and info["max_model_len"] == engine.max_model_len
    assert info["max_n"] >= 1 and info["version"]
