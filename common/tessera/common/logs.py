"""Structured (JSON lines) logging. Pass `extra={"request_id": ...}` to tag a line."""
from __future__ import annotations

import json
import logging
import re
import sys
import time

_RESERVED = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


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
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


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
