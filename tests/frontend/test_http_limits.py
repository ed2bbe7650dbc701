"""BodyLimit (tessera_frontend.http_limits): a body over --max-body-bytes gets a 413 whose
JSON error the client reads (issue 37 item 7a). Through a real frontend process (1 MiB cap)
with the clients people use, httpx (httpx2 here) and requests: 12.8 MB and 64 MiB bodies,
with a Content-Length and chunked, are answered 413 with the error parsed, and the frontend
serves on; in process, the drain after a 413 stops at its byte and time bounds."""
from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.parse

import httpx2
import openai
import pytest
import requests

from tessera_frontend import http_limits
from tessera_frontend.http_limits import BodyLimit

from helpers.stack import STARTUP_TIMEOUT_S, frontend_service, stack  # noqa: F401  (the session fixture)

CAP = 1 << 20
SIZES = {"12.8MB": 12_800_000, "64MiB": 64 << 20}


def chat_body(size: int) -> bytes:
    """A chat request of `size` bytes (the prompt fills it)."""
    head, tail = b'{"model": "m", "messages": [{"role": "user", "content": "', b'"}]}'
    return head + b"a" * (size - len(head) - len(tail)) + tail


def pieces(body: bytes, size: int = 1 << 20):
    """The body as an iterator: both clients send it chunked (no Content-Length)."""
    for i in range(0, len(body), size):
        yield body[i:i + size]


@pytest.fixture(scope="module")
def capped(stack):
    frontend = frontend_service("frontend-body-limit", stack.tokenizer.addr, stack.engine.addr, stack.log_dir,
                                "--max-body-bytes", str(CAP))
    frontend.start()
    try:
        frontend.wait_serving(time.monotonic() + STARTUP_TIMEOUT_S)
        yield frontend
    finally:
        frontend.stop()


def post_httpx(url: str, body: bytes, chunked: bool) -> tuple[int, dict]:
    with httpx2.Client(timeout=120) as client:
        r = client.post(url, content=pieces(body) if chunked else body, headers={"content-type": "application/json"})
        return r.status_code, r.json()


def post_requests(url: str, body: bytes, chunked: bool) -> tuple[int, dict]:
    with requests.Session() as session:
        r = session.post(url, data=pieces(body) if chunked else body, headers={"content-type": "application/json"},
                         timeout=120)
        return r.status_code, r.json()


@pytest.mark.integration
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size", list(SIZES), ids=list(SIZES))
@pytest.mark.parametrize("post", [post_httpx, post_requests], ids=["httpx", "requests"])
def test_a_client_reads_the_413_of_a_body_too_large(capped, post, size, chunked):
    status, body = post(capped.http_url + "/v1/chat/completions", chat_body(SIZES[size]), chunked)
    assert status == 413, body
    error = body["error"]
    assert error["code"] == "request_too_large" and f"limit of {CAP} bytes (--max-body-bytes)" in error["message"]
    if not chunked:
        assert f"{SIZES[size]} bytes" in error["message"]
    # and the frontend serves on
    client = openai.OpenAI(base_url=capped.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=3, temperature=0.0)
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.content


@pytest.mark.integration
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_the_connection_ends_with_a_clean_close_not_a_reset(capped, chunked):
    """What the clients above rely on, seen on a raw socket: every byte of a 64 MiB body is
    taken (no reset while sending: the server drains it), then the 413 comes whole and the
    connection ends with the server's FIN."""
    url = urllib.parse.urlsplit(capped.http_url)
    body = chat_body(64 << 20)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
            + ("Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {len(body)}\r\n") + "\r\n").encode()
    with socket.create_connection((url.hostname, url.port), timeout=120) as sock:
        sock.sendall(head)
        for piece in pieces(body):
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
        answer = b""
        while chunk := sock.recv(1 << 16):  # ends at the FIN; a reset raises ConnectionResetError
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413 ")
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"


# -- in process: the drain's bounds --------------------------------------------------------------
async def refused(messages, max_bytes: int = 10, length: int | None = None, pause_s: float = 0.0,
                  ends: bool = True):
    """Run BodyLimit over an app that reads its body; `messages` (body pieces, each after
    `pause_s`; the last one ends the body, or with ends=False the client then stalls) are what
    the client sends. Returns (what was sent back, pieces read, the app's last receive())."""
    sent, read, last = [], [], []
    queue = list(messages)

    async def receive():
        if not queue:
            await asyncio.sleep(3600)  # a client that sends nothing more
        await asyncio.sleep(pause_s)
        piece = queue.pop(0)
        read.append(piece)
        return {"type": "http.request", "body": piece, "more_body": bool(queue) or not ends}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                last.append(message)
                return

    headers = [(b"content-length", str(length).encode())] if length is not None else []
    await BodyLimit(app, max_bytes)({"type": "http", "headers": headers}, receive, send)
    return sent, read, last


@pytest.mark.unit
@pytest.mark.parametrize("length", [None, 40], ids=["chunked", "content-length"])
def test_the_413_goes_out_first_then_the_body_is_drained(length):
    sent, read, last = asyncio.run(refused([b"x" * 8] * 5, length=length))
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
    assert sent[1]["more_body"] is True and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert len(read) == 5  # every piece read (and dropped) before the connection is closed
    assert length is not None or last == [{"type": "http.disconnect"}]  # the app is told the client went away


@pytest.mark.unit
def test_the_drain_stops_at_its_byte_bound(monkeypatch):
    monkeypatch.setattr(http_limits, "DRAIN_MAX_BYTES", 100)
    sent, read, _ = asyncio.run(refused([b"x" * 30] * 20))
    assert sent[-1]["more_body"] is False and 100 <= sum(map(len, read)) < 160  # not all 600 bytes


@pytest.mark.unit
def test_the_drain_stops_when_the_client_stalls_or_takes_too_long(monkeypatch):
    monkeypatch.setattr(http_limits, "DRAIN_IDLE_S", 0.2)
    t0 = time.monotonic()
    sent, read, _ = asyncio.run(refused([b"x" * 30], ends=False))  # 30 bytes, then nothing more
    assert sent[-1]["more_body"] is False and time.monotonic() - t0 < 2
    monkeypatch.setattr(http_limits, "DRAIN_MAX_S", 0.3)
    t0 = time.monotonic()
    sent, read, _ = asyncio.run(refused([b"x" * 30] * 1000, pause_s=0.01))  # a slow trickle
    assert sent[-1]["more_body"] is False and time.monotonic() - t0 < 2 and len(read) < 1000
