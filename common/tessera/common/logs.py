"""Logging: one line per record, as JSON (for machines) or as text (for a person).

Pass `extra={"request_id": ...}` to tag a line with a request; every other extra field is
printed too. `--log-format` / TESSERA_LOG_FORMAT (`flags.add_common_flags`) picks the form:

    json  {"ts": 1765000000.345, "level": "INFO", "service": "engine", "logger": "tessera.engine",
           "msg": "request finished", "request_id": "req-abc", "tokens": 12}    (on one line)
    text  12:01:02.345 INFO  engine    [req-abc] request finished  tokens=12
    auto  text when stderr is a terminal, else JSON (what log collectors, compose and Kubernetes read)

`tessera serve` reads its children's JSON lines and shows them as text with `json_to_text`;
`failure_reason` picks a failed service's last error out of its log.
"""
from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import IO, Any, Iterable

LOG_FORMATS = ("auto", "json", "text")
# logging's own attributes, and uvicorn's copy of its message with terminal colours
_RESERVED = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "color_message"}
# Text form: the fixed columns (the longest service name is "tokenizer", so that the three
# services' lines line up when shown together).
_LEVEL_WIDTH, _SERVICE_WIDTH = 5, 9
_JSON_FIXED = ("ts", "level", "service", "logger", "msg", "request_id", "exc")


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record was given with `extra=` (none of logging's own attributes)."""
    return {key: value for key, value in record.__dict__.items()
            if key not in _RESERVED and not key.startswith("_")}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(_extra_fields(record))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def _value_text(value: Any) -> str:
    """A field's value in a text line: bare when that reads unambiguously, else quoted as JSON."""
    if isinstance(value, str):
        if value and not any(c.isspace() or c in '"=[]' for c in value):
            return value
        return json.dumps(value)
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str, separators=(",", ":"))
    return str(value)


def text_line(ts: float, level: str, service: str, msg: str, fields: dict[str, Any] | None = None,
              request_id: str | None = None, exc: str | None = None) -> str:
    """`12:01:02.345 INFO  engine    [req-abc] request finished  tokens=12 ...` (local time; a
    traceback, if any, on the lines after)."""
    clock = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}"
    parts = [clock, f"{level:<{_LEVEL_WIDTH}}", f"{service:<{_SERVICE_WIDTH}}"]
    if request_id:
        parts.append(f"[{request_id}]")
    parts.append(msg)
    line = " ".join(parts)
    if fields:
        line += "  " + " ".join(f"{key}={_value_text(value)}" for key, value in fields.items())
    if exc:
        line += "\n" + exc.rstrip("\n")
    return line


class TextFormatter(logging.Formatter):
    """A record as `text_line` writes it (the logger's name is left out: the message says what)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        fields = _extra_fields(record)
        request_id = fields.pop("request_id", None)
        exc = self.formatException(record.exc_info) if record.exc_info else None
        return text_line(record.created, record.levelname, self.service, record.getMessage(), fields,
                         str(request_id) if request_id else None, exc)


def log_format(value: str) -> str:
    """A --log-format / TESSERA_LOG_FORMAT value, checked (an environment value too, which
    argparse's choices do not check)."""
    name = value.strip().lower()
    if name not in LOG_FORMATS:
        raise ValueError(f"expected one of {', '.join(LOG_FORMATS)}, got {value!r}")
    return name


def resolve_format(log_format: str, stream: IO | None = None) -> str:
    """"json" or "text": `auto` is text when `stream` (default stderr) is a terminal."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    if log_format != "auto":
        return log_format
    stream = sys.stderr if stream is None else stream
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return "json"


def make_formatter(service: str, log_format: str, stream: IO | None = None) -> logging.Formatter:
    return TextFormatter(service) if resolve_format(log_format, stream) == "text" else JsonFormatter(service)


def setup_logging(service: str, level: str = "INFO", log_format: str = "auto") -> None:
    """Every record of the process to stderr as `service`, at `level` and up, in `log_format`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter(service, log_format, sys.stderr))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# -- reading JSON log lines (tessera serve, the stack helper) ----------------------------------------
def parse_line(text: str) -> dict[str, Any] | None:
    """A JSON log line as a dict; None for anything else (a library's own print, a partial line)."""
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "msg" in record else None


def record_text(record: dict[str, Any], traceback: bool = True) -> str:
    """A parsed JSON log line in the text form (traceback=False: only the exception's last line)."""
    fields = {k: v for k, v in record.items() if k not in _JSON_FIXED}
    exc = record.get("exc")
    if exc and not traceback:
        fields["error"] = _last_line(exc)
        exc = None
    ts = record.get("ts")
    return text_line(float(ts) if isinstance(ts, (int, float)) else time.time(), str(record.get("level", "")),
                     str(record.get("service", "")), str(record.get("msg", "")), fields,
                     record.get("request_id") or None, exc)


def json_to_text(text: str, traceback: bool = True) -> str:
    """A JSON log line in the text form; any other line as it is (without its newline)."""
    record = parse_line(text)
    return text.rstrip("\n") if record is None else record_text(record, traceback)


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def failure_reason(lines: Iterable[str]) -> str | None:
    """Why a service failed, from its log: the message of its last ERROR (or CRITICAL) line, with
    the model when that line names one and the exception's last line when it has one; a
    traceback or usage error printed after the last record (outside the logging) gives its last
    line. None when the log says nothing of it."""
    reason = None
    stray: list[str] = []  # lines that are not JSON records, since the last record
    for text in lines:
        record = parse_line(text)
        if record is None:
            if text.strip():
                stray.append(text)
            continue
        stray = []
        if record.get("level") in ("ERROR", "CRITICAL"):
            reason = str(record.get("msg", ""))
            model = record.get("model")
            if model and str(model) not in reason:
                reason += f" (model {model})"
            error = _last_line(record.get("exc") or "")
            if error and error not in reason:
                reason += f": {error}"
    # what a process printed after its last record: a traceback outside the logging, a usage error
    if stray and (any(line.startswith("Traceback") for line in stray) or "error:" in stray[-1]):
        return _last_line("".join(stray))
    return reason


def now() -> float:
    return time.time()


# The frontend runs a client request "<request_id>" in the engine as "<request_id>-<12 hex
# digits>" (unique per attempt) and on the detokenize stream as that plus "#<sample index>".
# Logs of every service carry the client's id as `request_id`, so one grep finds a request
# everywhere (and the full id as `engine_request_id`).
_ATTEMPT_SUFFIX = re.compile(r"-[0-9a-f]{12}(#\d+)?$")


def client_request_id(request_id: str) -> str:
    """The client's request id inside an engine / detokenize request id (itself if none)."""
    return _ATTEMPT_SUFFIX.sub("", request_id) if request_id else request_id
