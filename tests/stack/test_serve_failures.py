"""`tessera serve` and `make run` (scripts/run_stack.py) on a model that can never be served: they
notice the engine's (or tokenizer's) exit while waiting for the stack, stop the other services and
exit non-zero with the reason naming the model, within seconds instead of at --startup-timeout-s.
Piped, the reason is a JSON line on stdout; on a terminal, text on stderr with the last lines of
that service's log."""
from __future__ import annotations

import json
import os
import pathlib
import pty
import subprocess
import sys
import time

import psutil
import pytest

from helpers.stack import free_port
from tessera import serve


ROOT = pathlib.Path(__file__).resolve().parents[2]
TESSERA = [sys.executable, "-m", "tessera.cli"]
EXIT_WITHIN_S = 180  # three services' start on a busy CI machine; the startup timeout given is far longer
STARTUP_TIMEOUT_S = "900"


@pytest.fixture(scope="module")
def gpt2_directory(tmp_path_factory) -> pathlib.Path:
    """A tiny GPT-2 as transformers saves it: a real model of a family the engine does not run
    (the tokenizer service loads it, so the engine is the one that fails)."""
    import transformers as tf

    directory = tmp_path_factory.mktemp("gpt2")
    config = tf.GPT2Config(vocab_size=160, n_positions=64, n_embd=32, n_layer=1, n_head=2,
                           bos_token_id=0, eos_token_id=0)
    tf.GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def _ports() -> list[str]:
    return ["--port", str(free_port()), "--tokenizer-port", str(free_port()), "--engine-port", str(free_port()),
            "--http-port", str(free_port()), "--metrics-port", "0", "--startup-timeout-s", STARTUP_TIMEOUT_S]


def _services_on(ports: list[str]) -> list[psutil.Process]:
    """Service processes still running on these ports (a serve run that stopped its services leaves none)."""
    wanted = {ports[i + 1] for i, flag in enumerate(ports) if flag.endswith("port") and flag != "--metrics-port"}
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(arg.startswith("tessera_") for arg in cmdline) and \
                any(a == "--port" and b in wanted for a, b in zip(cmdline, cmdline[1:])):
            found.append(proc)
    return found


def _serve_piped(model: str, tmp_path: pathlib.Path) -> tuple[int, list[dict], float]:
    """Run `tessera serve --model model` with stdout piped: (exit status, its JSON lines, seconds)."""
    started = time.monotonic()
    ports = _ports()
    proc = subprocess.Popen([*TESSERA, "serve", "--model", model, *ports], stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "serve.err", "w"), text=True)
    try:
        out, _ = proc.communicate(timeout=EXIT_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not _services_on(ports)
    return proc.returncode, [json.loads(line) for line in out.splitlines()], time.monotonic() - started


@pytest.mark.integration
def test_serve_exits_naming_a_model_of_a_family_the_engine_does_not_run(gpt2_directory, tmp_path):
    code, lines, seconds = _serve_piped(str(gpt2_directory), tmp_path)
    err = (tmp_path / "serve.err").read_text()[-3000:]
    assert code == 1, (lines, err)
    failure = next(r for r in lines if r["level"] == "ERROR")
    assert failure["msg"] == "engine exited with status 3 before the stack was SERVING", failure
    assert failure["failed"] == "engine" and failure["exit_code"] == 3
    assert failure["reason"].startswith(f"cannot serve the model {gpt2_directory}: model type 'gpt2' not supported")
    assert "ERROR engine" in failure["tail"]  # its last log lines, as text
    assert [r["msg"] for r in lines if r["level"] != "ERROR"][-1].startswith("stopping")  # the others stopped
    assert seconds < EXIT_WITHIN_S
    # the services' own lines passed through on stderr, JSON
    assert json.loads(next(line for line in err.splitlines() if '"service": "engine"' in line))["service"] == "engine"


@pytest.mark.integration
def test_serve_exits_naming_a_file_that_is_not_a_model(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"<html>404 Not Found</html>\n" * 64)  # a download gone wrong
    code, lines, _ = _serve_piped(str(bad), tmp_path)
    assert code == 1, lines
    failures = [r for r in lines if r["level"] == "ERROR"]
    # the tokenizer or the engine, whichever fails first: either names the file and why
    assert failures and all(str(bad) in r["reason"] for r in failures), failures
    assert any("GGUF" in r["reason"] for r in failures), failures


def _run_on_a_terminal(command: list[str], timeout: float) -> tuple[int, str]:
    """Run `command` with a pseudo-terminal as its stdout and stderr (as `make run` in a shell):
    (exit status, everything it wrote)."""
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
                            cwd=ROOT, env={**os.environ, "COLUMNS": "100", "LINES": "24"})
    os.close(terminal)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(controller, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(controller)
    return proc.returncode, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


@pytest.mark.integration
def test_make_run_on_a_terminal_prints_the_reason_and_the_engines_last_lines(gpt2_directory):
    code, out = _run_on_a_terminal([sys.executable, "scripts/run_stack.py", "--model", str(gpt2_directory),
                                    *_ports()], EXIT_WITHIN_S)
    assert code == 1, out
    reason = f"engine exited with status 3 before the stack was SERVING: cannot serve the model {gpt2_directory}: " \
             "model type 'gpt2' not supported"
    assert reason in out, out
    assert "last lines of its log (" in out and " ERROR engine    cannot serve the model" in out, out
    assert "asking:" not in out and "serving  grpc=" not in out, out  # no answer, no endpoints
    assert '{"ts"' not in out, out  # a person reads text, not JSON


# -- what serve writes, in process ------------------------------------------------------------------
def _child_line(level: str, msg: str, **fields) -> str:
    return json.dumps({"ts": 1765000000.25, "level": level, "service": "engine", "logger": "tessera.engine",
                       "msg": msg, **fields}) + "\n"


@pytest.mark.unit
def test_log_format_is_serves_own_and_not_passed_on(monkeypatch):
    monkeypatch.delenv("TESSERA_LOG_FORMAT", raising=False)
    parser = serve.build_parser()
    args, extra = parser.parse_known_args(["--log-format", "text", "--log-level", "DEBUG"])
    assert args.log_format == "text" and extra == ["--log-level", "DEBUG"]  # --log-level goes to the services
    assert parser.parse_known_args([])[0].log_format == "auto"
    monkeypatch.setenv("TESSERA_LOG_FORMAT", "json")
    assert serve.build_parser().parse_known_args([])[0].log_format == "json"


@pytest.mark.unit
def test_piped_text_shows_the_services_lines_and_a_failure_as_text(capsys):
    progress = serve.Progress(tty=False, log_file=None, log_format="text")
    progress.line("engine", _child_line("INFO", "listening", address="0.0.0.0:1"))
    progress.line("engine", "[transformers] a library's own line\n")
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("INFO  engine    listening  address=0.0.0.0:1")
    assert err[1] == "[transformers] a library's own line"

    child = serve.Child("engine", "tessera_engine", 1)
    child.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    child.process.wait()
    child.tail = [_child_line("INFO", "listening"),
                  _child_line("ERROR", "cannot serve the model /m.gguf: not a GGUF file", model="/m.gguf", exit_code=3),
                  _child_line("INFO", "stopped", exit_code=3)]
    progress.failed(child, "before the stack was SERVING")
    out = capsys.readouterr().out.splitlines()
    assert " ERROR serve     engine exited with status 3 before the stack was SERVING  failed=engine exit_code=3 " \
           'reason="cannot serve the model /m.gguf: not a GGUF file"' in out[0]
    assert out[1] == "tail:" and out[-1].endswith("INFO  engine    stopped  exit_code=3")  # the tail after it


@pytest.mark.unit
def test_piped_json_passes_the_services_lines_through_as_they_are(capsys):
    progress = serve.Progress(tty=False, log_file=None, log_format="json")
    line = _child_line("WARNING", "slow", request_id="r1")
    progress.line("engine", line)
    assert capsys.readouterr().err == line
    progress.say("serving", grpc="127.0.0.1:1")
    record = json.loads(capsys.readouterr().out)
    assert record["service"] == "serve" and record["msg"] == "serving" and record["grpc"] == "127.0.0.1:1"


@pytest.mark.unit
def test_on_a_terminal_the_file_gets_text_and_only_warnings_are_shown(tmp_path, capsys):
    with open(tmp_path / "services.log", "w") as log_file:
        progress = serve.Progress(tty=True, log_file=log_file, log_format="text")
        progress.close(complete=False)  # (no bar drawn into pytest's capture)
        capsys.readouterr()
        progress.line("engine", _child_line("INFO", "backend plan"))
        progress.line("engine", _child_line("WARNING", "kernels not built", exc="Traceback\nOSError: gcc missing"))
        progress.line("engine", _child_line("ERROR", "a request failed", request_id="r2"))
        progress.note("starting engine", port=1)
    shown = capsys.readouterr()
    assert shown.out == "" and shown.err.count("\n") == 1  # the warning, on one line
    assert shown.err.strip().endswith('WARNING engine    kernels not built  error="OSError: gcc missing"')
    written = (tmp_path / "services.log").read_text()
    assert "INFO  engine    backend plan" in written and "ERROR engine    [r2] a request failed" in written
    assert "INFO  serve     starting engine  port=1" in written and '{"ts"' not in written
    assert ("engine", "backend plan") in progress.seen  # the progress bar's step
