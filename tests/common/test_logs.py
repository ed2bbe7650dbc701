"""tessera.common.logs: the JSON and text forms of a record, `auto`'s choice, --log-format /
TESSERA_LOG_FORMAT, and reading a failed service's reason out of its JSON log."""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest

from tessera.common import logs
from tessera.common.flags import add_common_flags

pytestmark = pytest.mark.unit


def _record(msg: str = "request finished", level: int = logging.INFO, exc_info=None, **extra) -> logging.LogRecord:
    record = logging.LogRecord("tessera.engine", level, __file__, 1, msg, None, exc_info)
    record.__dict__.update(extra)
    return record


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_line_has_time_service_level_message_and_every_extra_field():
    record = _record(request_id="req-abc", tokens=12)
    line = json.loads(logs.JsonFormatter("engine").format(record))
    assert line == {"ts": round(record.created, 6), "level": "INFO", "service": "engine", "logger": "tessera.engine",
                    "msg": "request finished", "request_id": "req-abc", "tokens": 12}


def test_text_line_is_time_level_service_request_id_message_then_fields():
    record = _record(request_id="req-abc", tokens=12, ttft_s=0.25, finish="stop")
    line = logs.TextFormatter("engine").format(record)
    clock = time.strftime("%H:%M:%S", time.localtime(record.created))
    assert line == f"{clock}.{int(record.created % 1 * 1000):03d} INFO  engine    [req-abc] request finished  " \
                   "tokens=12 ttft_s=0.25 finish=stop"


def test_text_line_without_request_id_or_fields_and_with_quoted_values():
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3} WARNING tokenizer slow", logs.TextFormatter("tokenizer").format(
        _record("slow", logging.WARNING)))
    line = logs.TextFormatter("frontend").format(_record("listening", why="two words", empty="", cpus=[0, 1],
                                                         plan={"a": 1}, flag=True, none=None))
    assert line.endswith('listening  why="two words" empty="" cpus=[0,1] plan={"a":1} flag=True none=None')


def test_text_line_puts_a_traceback_on_the_lines_after():
    try:
        raise ValueError("GGUF magic invalid")
    except ValueError:
        record = _record("load failed", logging.ERROR, exc_info=sys.exc_info(), model="/m.gguf")
    first, *rest = logs.TextFormatter("engine").format(record).splitlines()
    assert first.endswith("ERROR engine    load failed  model=/m.gguf")
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: GGUF magic invalid"


def test_uvicorns_coloured_copy_of_the_message_is_left_out():
    record = _record("Uvicorn running", color_message="\x1b[1mUvicorn\x1b[0m running")
    assert "color_message" not in json.loads(logs.JsonFormatter("frontend").format(record))
    assert "color_message" not in logs.TextFormatter("frontend").format(record)


def test_auto_is_text_on_a_terminal_and_json_elsewhere():
    assert logs.resolve_format("auto", _Tty()) == "text"
    assert logs.resolve_format("auto", io.StringIO()) == "json"
    assert logs.resolve_format("json", _Tty()) == "json"
    assert logs.resolve_format("text", io.StringIO()) == "text"
    closed = io.StringIO()
    closed.close()
    assert logs.resolve_format("auto", closed) == "json"  # isatty on a closed stream raises
    assert isinstance(logs.make_formatter("engine", "auto", _Tty()), logs.TextFormatter)
    assert isinstance(logs.make_formatter("engine", "auto", io.StringIO()), logs.JsonFormatter)
    with pytest.raises(ValueError, match="'yaml' is not one of auto, json, text"):
        logs.resolve_format("yaml")


def test_setup_logging_writes_the_chosen_format_to_stderr_at_the_level(monkeypatch):
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # (pytest's own capture handlers)
    try:
        for fmt, tty, want_json in (("auto", True, False), ("auto", False, True), ("text", False, False)):
            stream = _Tty() if tty else io.StringIO()
            monkeypatch.setattr(sys, "stderr", stream)
            logs.setup_logging("engine", "warning", fmt)
            logging.getLogger("tessera.engine").info("hidden")
            logging.getLogger("tessera.engine").warning("shown", extra={"request_id": "r1"})
            out = stream.getvalue()
            assert "hidden" not in out and out.count("\n") == 1
            if want_json:
                assert json.loads(out)["msg"] == "shown"
            else:
                assert " WARNING engine    [r1] shown" in out
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_log_format_flag_and_its_environment_variable(monkeypatch):
    def parse(*argv):
        parser = argparse.ArgumentParser()
        add_common_flags(parser, 1, "X_PORT")
        return parser.parse_args(list(argv))

    monkeypatch.delenv("TESSERA_LOG_FORMAT", raising=False)
    assert parse().log_format == "auto"
    assert parse("--log-format", "text").log_format == "text"
    monkeypatch.setenv("TESSERA_LOG_FORMAT", "JSON")
    assert parse().log_format == "json"
    assert parse("--log-format", "text").log_format == "text"  # the command line wins
    assert parse("--log-level", "DEBUG").log_level == "DEBUG"  # still there beside it


def test_a_bad_log_format_is_a_usage_error_naming_it():
    env = {**os.environ, "TESSERA_LOG_FORMAT": "yaml"}
    proc = subprocess.run([sys.executable, "-m", "tessera_tokenizer", "--help"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "TESSERA_LOG_FORMAT='yaml' is invalid: expected one of auto, json, text" in proc.stderr
    env.pop("TESSERA_LOG_FORMAT")
    proc = subprocess.run([sys.executable, "-m", "tessera_tokenizer", "--log-format", "yaml"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--log-format" in proc.stderr and "'yaml'" in proc.stderr


def test_a_json_line_read_back_as_text():
    line = json.dumps({"ts": 1765000000.5, "level": "ERROR", "service": "engine", "logger": "x",
                       "msg": "load failed", "request_id": "r9", "model": "/m.gguf",
                       "exc": "Traceback (most recent call last):\n  ...\nValueError: bad"})
    text = logs.json_to_text(line + "\n")
    assert text.splitlines()[0].endswith("ERROR engine    [r9] load failed  model=/m.gguf")
    assert text.splitlines()[-1] == "ValueError: bad"
    short = logs.json_to_text(line, traceback=False)
    assert "\n" not in short and short.endswith('model=/m.gguf error="ValueError: bad"')
    assert logs.json_to_text("usage: tessera-engine [-h]\n") == "usage: tessera-engine [-h]"
    assert logs.parse_line('{"no": "msg"}') is None and logs.parse_line("[1, 2]") is None


def _json(level: str, msg: str, **fields) -> str:
    return json.dumps({"ts": 1.0, "level": level, "service": "engine", "msg": msg, **fields}) + "\n"


def test_failure_reason_is_the_last_error_with_its_model_and_exception():
    lines = [_json("INFO", "listening"), _json("ERROR", "an earlier error"),
             _json("ERROR", "cannot serve the model /m.gguf: not a GGUF file", model="/m.gguf", exit_code=3),
             _json("INFO", "stopped", exit_code=3)]
    assert logs.failure_reason(lines) == "cannot serve the model /m.gguf: not a GGUF file"
    tokenizer = [_json("ERROR", "loading the tokenizer failed", model="/m.gguf",
                       exc="Traceback (most recent call last):\nValueError: GGUF magic invalid\n")]
    assert logs.failure_reason(tokenizer) == \
        "loading the tokenizer failed (model /m.gguf): ValueError: GGUF magic invalid"
    assert logs.failure_reason([_json("INFO", "listening"), _json("INFO", "stopped")]) is None


def test_failure_reason_from_what_was_printed_outside_the_logging():
    crash = [_json("INFO", "listening"), "Traceback (most recent call last):\n", '  File "x.py"\n',
             "ImportError: no module named torch\n"]
    assert logs.failure_reason(crash) == "ImportError: no module named torch"
    usage = ["usage: tessera-frontend [-h]\n", "tessera-frontend: error: --engine-addrs: port 0 is out of range\n"]
    assert logs.failure_reason(usage) == "tessera-frontend: error: --engine-addrs: port 0 is out of range"
    # output after a later record is not the reason
    assert logs.failure_reason(["Traceback (most recent call last):\n", "X: y\n", _json("INFO", "listening")]) is None
