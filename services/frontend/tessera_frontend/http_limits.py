"""Guards on an HTTP request's raw input, before anything parses it.

BodyLimit answers 413 to a body larger than --max-body-bytes, from its Content-Length or,
for a body sent without one, as soon as the bytes received pass the cap: an oversized body
is never read whole, never parsed, and never reaches the shared streams to the tokenizer.
invalid_unicode finds a lone surrogate ("\\ud800" is valid JSON but no valid text: protobuf
and the tokenizer refuse it), so that it is a 400 naming the field instead of a 500.
"""
from __future__ import annotations

import json

from tessera_frontend.openai_protocol import ApiError


class BodyLimit:
    """ASGI middleware: 413 for a request body over max_bytes (0: no cap)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.max_bytes <= 0:
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send, int(length))
        received = 0
        refused = False

        async def limited_receive():
            # past the cap: answer 413 at once and tell the app the client went away (an
            # exception here would reach FastAPI's body parsing and become its 400)
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._refuse(send, None)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not refused:  # after a 413 the app has nothing more to say
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _refuse(self, send, length: int | None) -> None:
        size = f"{length} bytes" if length is not None else "more bytes"
        err = ApiError(413, f"the request body is {size} than the server's limit of {self.max_bytes} bytes "
                            f"(--max-body-bytes)", code="request_too_large")
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def invalid_unicode(value, path: str = "") -> str | None:
    """The path of the first string in `value` (nested dicts / lists) that is not valid
    Unicode text (a lone surrogate), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        where = invalid_unicode(item, f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key)))
        if where is not None:
            return where
    return None


def check_unicode(body) -> None:
    """ApiError 400 naming the field of a pydantic request body that holds a lone surrogate."""
    where = invalid_unicode(body.model_dump())
    if where is not None:
        raise ApiError(400, f"{where}: not valid Unicode text (a lone surrogate such as \\ud800)", param=where)
