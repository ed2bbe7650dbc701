"""Guards on an HTTP request's raw input, before anything parses it.

BodyLimit answers 413 to a body larger than --max-body-bytes, from its Content-Length or,
for a body sent without one, as soon as the bytes received pass the cap: an oversized body
is never held whole, never parsed, and never reaches the shared streams to the tokenizer.
The rest of it is then read and dropped, within bounds, before the connection is closed (a
lingering close, as nginx's), so that a client that sends its whole body before it reads the
answer (requests, httpx) gets the 413 and its JSON error rather than a connection reset.
invalid_unicode finds a lone surrogate ("\\ud800" is valid JSON but no valid text: protobuf
and the tokenizer refuse it), so that it is a 400 naming the field instead of a 500.
"""
from __future__ import annotations

import asyncio
import json

from tessera_frontend.openai_protocol import ApiError

# After a 413 the server reads and drops what the client still sends, because closing a
# socket with unread bytes is a TCP reset, which throws away the 413 the client has not read
# yet. Bounded, so an oversized body costs reading, never memory or a connection forever: at
# most DRAIN_MAX_BYTES more (a 64 MiB body over a small cap is drained whole), for at most
# DRAIN_MAX_S, while the client sends something every DRAIN_IDLE_S (nginx's lingering_time and
# lingering_timeout); past a bound the connection is closed, and a client still sending may
# see the reset.
DRAIN_MAX_BYTES = 128 << 20
DRAIN_MAX_S = 30.0
DRAIN_IDLE_S = 5.0


class BodyLimit:
    """ASGI middleware: 413 for a request body over max_bytes (0: no cap)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.max_bytes <= 0:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            # a client waiting for "100 Continue" has sent no body: there is nothing to drain
            waiting = headers.get(b"expect", b"").lower() == b"100-continue"
            return await self._refuse(receive, send, int(length), drain=not waiting)
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
                    await self._refuse(receive, send, None, drain=message.get("more_body", False))
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not refused:  # after a 413 the app has nothing more to say
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _refuse(self, receive, send, length: int | None, drain: bool) -> None:
        """The 413 and its JSON, all of it sent at once (a client that reads while it sends
        has it), then the rest of the body drained; the response ends, and the server closes
        the connection, after the drain."""
        size = f"{length} bytes" if length is not None else "more bytes"
        err = ApiError(413, f"the request body is {size} than the server's limit of {self.max_bytes} bytes "
                            f"(--max-body-bytes)", code="request_too_large")
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        if drain:
            await drain_body(receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def drain_body(receive) -> int:
    """Read and drop the rest of a request body, within the DRAIN_ bounds; the bytes read."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DRAIN_MAX_S
    drained = 0
    while drained < DRAIN_MAX_BYTES:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            message = await asyncio.wait_for(receive(), min(DRAIN_IDLE_S, left))
        except asyncio.TimeoutError:
            break
        if message["type"] != "http.request":
            break  # the client went away
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return drained


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
