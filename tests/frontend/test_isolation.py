"""One client's input cannot hurt another's requests (issue 18, item 1), through the real
stack: four streaming requests run to completion, token for token as when they ran alone,
while a 64 MiB body (413 as it passes the cap, the rest drained), a JSON string with a lone surrogate (400
naming the field), a malformed body (400) and a prompt too large for the tokenize stream
(refused alone) are sent; /health and the gRPC health stay SERVING throughout."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time
import urllib.parse

import grpc
import openai
import pytest

from helpers.stack import health_status, stack  # noqa: F401  (the session fixture)
from tessera.v1 import frontend_pb2, tokenizer_pb2

pytestmark = pytest.mark.integration

QUESTIONS = ["Write a haiku about the sea.", "List three primary colors.",
             "Explain gravity to a child in two sentences.", "Name a planet."]


def post_raw(stack, body: bytes, headers: dict | None = None, chunked: bool = False) -> tuple[int, dict]:
    url = urllib.parse.urlparse(stack.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if chunked:
            conn.putrequest("POST", "/v1/chat/completions")
            for k, v in {**hdrs, "Transfer-Encoding": "chunked"}.items():
                conn.putheader(k, v)
            conn.endheaders()
            try:
                for i in range(0, len(body), 1 << 20):
                    piece = body[i:i + (1 << 20)]
                    conn.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                conn.send(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered 413 and closed before the whole body went out
        else:
            try:
                conn.request("POST", "/v1/chat/completions", body=body, headers=hdrs)
            except (BrokenPipeError, ConnectionResetError):
                pass
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def stream_text(client: openai.OpenAI, model: str, question: str) -> str:
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            max_tokens=24, temperature=0.0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_bad_bodies_fail_alone_and_health_stays_serving(stack):
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = stack.tokenizer_stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest(), timeout=10).model_name
    alone = [stream_text(client, model, q) for q in QUESTIONS]
    assert all(alone)

    health: list[tuple[int, int]] = []
    stop = threading.Event()

    def watch_health():
        url = urllib.parse.urlparse(stack.http_url)
        while not stop.is_set():
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
            conn.request("GET", "/health")
            http_status = conn.getresponse().status
            conn.close()
            health.append((http_status, health_status(stack.frontend_channel)))
            time.sleep(0.05)

    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * (64 << 20) + b'"}]}'
    surrogate = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi \ud800 there"}],
                            "max_tokens": 4}).encode()  # json.dumps writes the surrogate as \\ud800
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        watcher = pool.submit(watch_health)
        streams = [pool.submit(stream_text, client, model, q) for q in QUESTIONS]
        big_status, big_body = post_raw(stack, big)
        chunked_status, _ = post_raw(stack, big, chunked=True)
        sur_status, sur_body = post_raw(stack, surrogate)
        bad_status, bad_body = post_raw(stack, b'{"model": "m", "messages": [')
        # a gRPC prompt over the tokenize stream's per-request cap (the public port takes 64 MiB)
        with grpc.insecure_channel(stack.frontend.addr, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            stub = __import__("tessera.v1.frontend_pb2_grpc", fromlist=["x"]).FrontendServiceStub(ch)
            try:
                stub.Complete(frontend_pb2.GenerateRequest(text="b" * (40 << 20)), timeout=60)
                grpc_code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                grpc_code, grpc_message = exc.code(), exc.details()
        together = [s.result(timeout=120) for s in streams]
        stop.set()
        watcher.result(timeout=30)

    assert big_status == 413 and "--max-body-bytes" in big_body["error"]["message"]
    assert chunked_status == 413
    assert sur_status == 400 and "messages[0].content" in sur_body["error"]["message"], sur_body
    assert bad_status == 400 and "not valid JSON" in bad_body["error"]["message"]
    assert grpc_code == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in grpc_message
    assert together == alone
    assert health and all(h == (200, 1) for h in health), health  # 1: SERVING
    assert stream_text(client, model, QUESTIONS[0]) == alone[0]  # and afterwards
