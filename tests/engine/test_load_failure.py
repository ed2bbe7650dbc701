"""A model that can never be served ends the engine: `load_failure.classify` (in process), and the
engine process itself on a file that is not a model, a family it does not run and a path that does
not exist: it exits with status 3 within seconds, its last error line naming the model and why,
and never reports SERVING (it used to stay up NOT_SERVING forever)."""
from __future__ import annotations

import errno
import pathlib
import time

import pytest
from grpc_health.v1 import health_pb2

from helpers.stack import Service, free_port
from tessera.common import logs
from tessera.common.model_source import DEFAULT_GGUF_NAME, resolve_model
from tessera_engine import load_failure
from tessera_engine.load_failure import EXIT_LOAD_FAILED, EXIT_MODEL_UNSERVABLE, classify

EXIT_WITHIN_S = 120  # the process's start (torch's import) on a busy CI machine, then the load fails at once


# -- which failures can never be served (in process) -----------------------------------------------
@pytest.mark.unit
def test_a_model_that_is_not_there_or_not_a_model_can_never_be_served(tmp_path):
    failure = classify(FileNotFoundError(f"model not found: {tmp_path}/nope.gguf"))
    assert failure == (EXIT_MODEL_UNSERVABLE, f"model not found: {tmp_path}/nope.gguf", False)
    assert failure.permanent
    text = tmp_path / "notes.txt"
    text.write_text("hello")  # there, but no .gguf: resolve_model says what it is not
    with pytest.raises(FileNotFoundError) as info:
        resolve_model(str(text))
    assert classify(info.value).reason == \
        f"{text}: not a model: neither a .gguf file nor an HF model directory (config.json)"
    assert classify(ValueError("GGUF magic invalid")).reason == "not a GGUF file (GGUF magic invalid)"
    unsupported = classify(ValueError("model type 'gpt2' not supported (supported: ['llama'])"))
    assert unsupported == (EXIT_MODEL_UNSERVABLE, "model type 'gpt2' not supported (supported: ['llama'])", False)
    denied = classify(PermissionError(errno.EACCES, "Permission denied", "/m/model.safetensors"))
    assert denied.exit_code == EXIT_MODEL_UNSERVABLE and denied.reason.startswith("cannot read it: ")


@pytest.mark.unit
def test_out_of_memory_at_load_can_never_be_served():
    for exc in (MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't "
                                            "allocate memory: you tried to allocate 123 bytes")):
        failure = classify(exc)
        assert failure.exit_code == EXIT_MODEL_UNSERVABLE and failure.reason.startswith("out of memory while loading")


@pytest.mark.unit
def test_a_failure_of_the_medium_may_pass_and_an_unexplained_one_keeps_its_traceback():
    for exc in (OSError(errno.EIO, "Input/output error"), OSError(errno.ESTALE, "Stale file handle"),
                TimeoutError("timed out"), ConnectionResetError(errno.ECONNRESET, "reset")):
        failure = classify(exc)
        assert failure.exit_code == EXIT_LOAD_FAILED and not failure.permanent and failure.traceback, exc
    odd = classify(RuntimeError("size mismatch for model.norm.weight"))
    assert odd == (EXIT_MODEL_UNSERVABLE, "RuntimeError: size mismatch for model.norm.weight", True)
    assert len(classify(ValueError("x" * 2000)).reason) == 500


@pytest.mark.unit
def test_the_default_model_is_named_by_its_file():
    assert load_failure.model_path("/models/x.gguf") == "/models/x.gguf"
    assert load_failure.model_path(None).endswith(DEFAULT_GGUF_NAME)


# -- the engine process -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_directory(tmp_path_factory) -> pathlib.Path:
    """A tiny GPT-2 as transformers saves it: a real model of a family the engine does not run."""
    import transformers as tf

    directory = tmp_path_factory.mktemp("gpt2")
    config = tf.GPT2Config(vocab_size=160, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    tf.GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def _bad_model(kind: str, tmp_path: pathlib.Path, gpt2_directory: pathlib.Path) -> tuple[str, str]:
    """(the --model value, what the reason must say)."""
    if kind == "not a model":
        path = tmp_path / "weights.gguf"
        path.write_bytes(b"<html>404 Not Found</html>\n" * 64)  # a download gone wrong
        return str(path), "not a GGUF file"
    if kind == "text file":
        path = tmp_path / "README.md"
        path.write_text("# not a model\n")
        return str(path), "not a model: neither a .gguf file nor an HF model directory"
    if kind == "unsupported family":
        return str(gpt2_directory), "model type 'gpt2' not supported"
    return str(tmp_path / "missing" / "model.gguf"), "model not found"


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["not a model", "text file", "unsupported family", "missing"])
def test_engine_exits_3_naming_the_model_and_why(kind, tmp_path, gpt2_directory):
    model, why = _bad_model(kind, tmp_path, gpt2_directory)
    engine = Service("engine", "tessera_engine", free_port(), ["--model", model], tmp_path / "engine.log")
    started = time.monotonic()
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="exited with status 3 before SERVING") as info:
            engine.wait_serving(started + EXIT_WITHIN_S, EXIT_WITHIN_S)
    finally:
        engine.stop()
    assert engine.process.returncode == EXIT_MODEL_UNSERVABLE
    assert health_pb2.HealthCheckResponse.SERVING not in engine.health_seen
    # one error line, the last, names the model and says why; wait_serving's error carries it
    reason = engine.failure_reason()
    assert reason is not None and reason.startswith(f"cannot serve the model {model}: ") and why in reason, reason
    assert reason in str(info.value)
    records = [r for r in map(logs.parse_line, engine.log_path.read_text().splitlines()) if r is not None]
    errors = [r for r in records if r["level"] == "ERROR"]
    assert len(errors) == 1 and errors[0]["model"] == model and errors[0]["exit_code"] == EXIT_MODEL_UNSERVABLE
    assert records[-1]["msg"] == "stopped" and records[-1]["exit_code"] == EXIT_MODEL_UNSERVABLE
