"""The tokenizer service as a real OS process, tested over gRPC.

One process serves the whole module (started with `python -m tessera_tokenizer` on a
free loopback port, stopped with SIGTERM at the end, which must exit cleanly). It runs
with small input limits (one from a flag, one from the environment) so that the limit
checks are cheap to reach.
"""
from __future__ import annotations

import json
import os
import pathlib
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tessera.v1 import tokenizer_pb2 as pb
from tessera.v1 import tokenizer_pb2_grpc

from helpers.stack import free_port

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
SERVICE = "tessera.v1.TokenizerService"
MAX_INPUT_CHARS = 5000
MAX_MESSAGES = 8
STARTUP_TIMEOUT_S = 90


def start_process(port: int, log_path: pathlib.Path, *args: str) -> subprocess.Popen:
    # a load of a second, so that the health test sees the service refuse calls while it loads
    env = dict(os.environ, PYTHONUNBUFFERED="1", TESSERA_MAX_INPUT_CHARS=str(MAX_INPUT_CHARS),
               TESSERA_TOKENIZER_TEST_LOAD_DELAY_S="1")
    log = open(log_path, "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "tessera_tokenizer", "--host", HOST, "--port", str(port), *args],
        stdout=log, stderr=subprocess.STDOUT, env=env)


def health(channel: grpc.Channel, service: str = SERVICE) -> int | None:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=1.0)
        return reply.status
    except grpc.RpcError:
        return None  # not listening yet


class Server:
    """The running service: its channel, stub, log, and what was seen while it started."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.port = free_port()
        self.log_path = tmp / "tokenizer.log"
        self.process = start_process(self.port, self.log_path, "--max-messages", str(MAX_MESSAGES))
        self.channel = grpc.insecure_channel(f"{HOST}:{self.port}")
        self.stub = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel)
        self.statuses_seen: list[int] = []
        self.code_while_loading: grpc.StatusCode | None = None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"tokenizer exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"tokenizer not SERVING after {STARTUP_TIMEOUT_S}s:\n{self.log()}")
            status = health(self.channel)
            if status is not None and status not in self.statuses_seen:
                self.statuses_seen.append(status)
            if status == health_pb2.HealthCheckResponse.NOT_SERVING and self.code_while_loading is None:
                try:
                    self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=2)
                except grpc.RpcError as exc:
                    self.code_while_loading = exc.code()
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        self.channel.close()
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("tokenizer"))
    yield srv
    code = srv.stop()
    assert code == 0, f"tokenizer exited with {code} on SIGTERM:\n{srv.log()[-3000:]}"


@pytest.fixture(scope="module")
def stub(server):
    return server.stub


def tokenize(stub, text: str) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(text=text)).token_ids)


def stream(stub, messages: list[pb.DetokenizeStreamRequest]) -> list[pb.DetokenizeStreamResponse]:
    return list(stub.DetokenizeStream(iter(messages), timeout=30))


def item(rid: str, ids=(), **kw) -> pb.DetokenizeItem:
    return pb.DetokenizeItem(request_id=rid, new_token_ids=list(ids), **kw)


# --- startup, health, reflection ------------------------------------------------------------

def test_health_goes_from_not_serving_to_serving(server):
    # The server answers health while the tokenizer loads, and refuses calls until then.
    assert server.statuses_seen[-1] == health_pb2.HealthCheckResponse.SERVING
    assert server.statuses_seen[0] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert server.code_while_loading == grpc.StatusCode.UNAVAILABLE
    assert health(server.channel, "") == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(server):
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert SERVICE in names and "grpc.health.v1.Health" in names


# --- unary calls ----------------------------------------------------------------------------

def test_tokenize_text_with_offsets(stub):
    text = "Héllo wörld 世界 😀!"
    reply = stub.Tokenize(pb.TokenizeRequest(text=text, return_offsets=True))
    assert reply.text == text
    assert len(reply.offsets) == 2 * len(reply.token_ids)
    spans = list(zip(reply.offsets[::2], reply.offsets[1::2]))
    assert all(0 <= a <= b <= len(text) for a, b in spans)
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert [text[a:b] for a, b in spans][:2] == ["H", "é"]
    assert list(stub.Tokenize(pb.TokenizeRequest(text="Hello world")).token_ids) == [19556, 905]
    assert stub.Tokenize(pb.TokenizeRequest(text="Hello world")).offsets == []


def test_tokenize_empty_text_and_special_tokens(stub):
    assert list(stub.Tokenize(pb.TokenizeRequest(text="")).token_ids) == []
    with_special = stub.Tokenize(pb.TokenizeRequest(text="<|im_end|>x", add_special_tokens=True))
    assert list(with_special.token_ids)[0] == 2  # special tokens in the text stay whole


def test_tokenize_chat_uses_the_template(stub):
    messages = [pb.ChatMessage(role="system", content="Be brief."),
                pb.ChatMessage(role="user", content="Hi there")]
    reply = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=messages), return_offsets=True))
    assert reply.text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                          "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert reply.token_ids[0] == 1 and 2 in reply.token_ids
    assert len(reply.offsets) == 2 * len(reply.token_ids)
    back = stub.Detokenize(pb.DetokenizeRequest(token_ids=reply.token_ids, skip_special_tokens=False))
    assert back.text == reply.text
    no_prompt = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=messages),
                                                 add_generation_prompt=False))
    assert no_prompt.text.endswith("Hi there<|im_end|>\n")
    # Without a system message the template adds its own.
    user_only = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=messages[1:])))
    assert user_only.text.startswith("<|im_start|>system\n")
    with_tool = stub.Tokenize(chat(("user", "weather?"), ("assistant", "calling"), ("tool", "sunny")))
    assert "<|im_start|>tool\nsunny<|im_end|>" in with_tool.text


def test_detokenize(stub):
    text = "Ünïcödé 中文 🎉 text"
    ids = tokenize(stub, text)
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text == text
    with_special = [1] + ids + [2]
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=with_special)).text == text
    assert stub.Detokenize(pb.DetokenizeRequest(
        token_ids=with_special, skip_special_tokens=False)).text == f"<|im_start|>{text}<|im_end|>"
    assert stub.Detokenize(pb.DetokenizeRequest()).text == ""


def test_model_info(stub):
    info = stub.GetModelInfo(pb.ModelInfoRequest())
    assert info.model_name.startswith("SmolLM2-135M-Instruct")
    assert info.vocab_size == 49152
    assert info.HasField("bos_token_id") and info.bos_token_id == 1
    assert list(info.eos_token_ids) == [2]
    assert info.max_model_len == 8192
    assert info.has_chat_template
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(info.special_tokens)


# --- bad unary input ------------------------------------------------------------------------

def chat(*roles_and_contents) -> pb.TokenizeRequest:
    return pb.TokenizeRequest(chat=pb.ChatMessages(
        messages=[pb.ChatMessage(role=r, content=c) for r, c in roles_and_contents]))


BAD_UNARY = {
    "no input": ("Tokenize", pb.TokenizeRequest(), "input"),
    "empty message list": ("Tokenize", pb.TokenizeRequest(chat=pb.ChatMessages()), "chat.messages"),
    "unknown role": ("Tokenize", chat(("user", "hi"), ("wizard", "boo")), "chat.messages[1].role"),
    "text too long": ("Tokenize", pb.TokenizeRequest(text="x" * (MAX_INPUT_CHARS + 1)), "text"),
    "chat too long": ("Tokenize", chat(("user", "x" * (MAX_INPUT_CHARS + 1))), "chat.messages"),
    "too many messages": ("Tokenize", chat(*[("user", "hi")] * (MAX_MESSAGES + 1)), "chat.messages"),
    "id too large": ("Detokenize", pb.DetokenizeRequest(token_ids=[5, 49152]), "token_ids"),
    "negative id": ("Detokenize", pb.DetokenizeRequest(token_ids=[-1]), "token_ids"),
}


@pytest.mark.parametrize("case", list(BAD_UNARY))
def test_bad_unary_input_is_invalid_argument(stub, case):
    method, request, field = BAD_UNARY[case]
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, method)(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()
    # The service is fine afterwards.
    assert tokenize(stub, "still here") == tokenize(stub, "still here") != []


def test_limits_are_inclusive(stub):
    assert len(stub.Tokenize(pb.TokenizeRequest(text="x" * MAX_INPUT_CHARS)).token_ids) > 0
    assert stub.Tokenize(chat(*[("user", "hi")] * MAX_MESSAGES)).text.count("<|im_start|>user") == MAX_MESSAGES


def test_rejections_are_logged_with_the_request_id(server, stub):
    with pytest.raises(grpc.RpcError):
        stub.Tokenize(pb.TokenizeRequest(), metadata=[("x-request-id", "req-log-check-42")])
    assert_logged_with_request_id(server, "req-log-check-42")


def assert_logged_with_request_id(server, request_id: str) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        if any(line.get("request_id") == request_id for line in lines):
            return
        time.sleep(0.05)
    pytest.fail(f"no log line carries the request id {request_id}")


# --- the tokenize stream ----------------------------------------------------------------------

def tokenize_items(*requests: pb.TokenizeRequest, first_id: int = 1) -> pb.TokenizeStreamRequest:
    return pb.TokenizeStreamRequest(items=[pb.TokenizeItem(id=first_id + i, request_id=f"tok-{first_id + i}",
                                                           request=r) for i, r in enumerate(requests)])


def test_tokenize_stream_answers_every_item_by_id_as_tokenize_would(stub):
    good = [pb.TokenizeRequest(text="Hello, world!"),
            chat(("system", "Be brief."), ("user", "Why is the sky blue?")),
            pb.TokenizeRequest(text="héllo 数据 🚀", return_offsets=True),
            pb.TokenizeRequest(text="x" * (MAX_INPUT_CHARS - 500)),  # big: tokenized on a worker thread
            pb.TokenizeRequest(text="no bos", add_special_tokens=False)]
    bad = [request for method, request, _ in BAD_UNARY.values() if method == "Tokenize"]
    fields = [field for method, _, field in BAD_UNARY.values() if method == "Tokenize"]
    mixed = [r for pair in zip(good, bad) for r in pair] + good[len(bad):] + bad[len(good):]
    first = tokenize_items(*mixed)
    second = tokenize_items(pb.TokenizeRequest(text="after the first message"), first_id=100)
    replies = list(stub.TokenizeStream(iter([first, second]), timeout=30))

    results = {r.id: r for reply in replies for r in reply.results}
    assert sum(len(reply.results) for reply in replies) == len(results) == len(mixed) + 1  # each once
    for item in list(first.items) + list(second.items):
        result = results[item.id]
        if item.request in bad:
            field = fields[bad.index(item.request)]
            assert result.error.code == "INVALID_ARGUMENT" and result.error.message.startswith(field + ":")
            assert not result.HasField("response")
        else:
            assert not result.HasField("error"), result.error
            assert result.response == stub.Tokenize(item.request), item.request
    # The small items of a message are answered together; the big one may come on its own.
    big_id = first.items[mixed.index(good[3])].id
    small = {item.id for item in first.items if item.id != big_id}
    assert any(small <= {r.id for r in reply.results} for reply in replies)


def test_tokenize_stream_rejections_are_logged_with_the_request_id(server, stub):
    request = tokenize_items(pb.TokenizeRequest(), pb.TokenizeRequest(text="fine"), first_id=7)
    request.items[0].request_id = "req-stream-log-check-7"
    replies = list(stub.TokenizeStream(iter([request]), timeout=30))
    assert [(r.id, r.HasField("error")) for reply in replies for r in reply.results] == [(7, True), (8, False)]
    assert_logged_with_request_id(server, "req-stream-log-check-7")


# --- the detokenize stream --------------------------------------------------------------------

def test_stream_100_interleaved_requests(stub):
    rng = random.Random(7)
    words = ["alpha", "βeta", "γάμμα", "数据", "🚀", "naïve", "東京", "ok", "😀👍🏽", "—", "\n"]
    texts = {f"req-{i}": f"#{i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(3, 25)))
             for i in range(100)}
    ids = {rid: tokenize(stub, text) for rid, text in texts.items()}
    position = {rid: 0 for rid in texts}
    messages, sent = [], []
    active = list(texts)
    while active:
        rng.shuffle(active)
        items = []
        for rid in list(active):
            take = rng.randint(1, 3)
            chunk = ids[rid][position[rid]:position[rid] + take]
            first = position[rid] == 0
            position[rid] += len(chunk)
            done = position[rid] >= len(ids[rid])
            kw = {"open": pb.DetokenizeOpen()} if first and int(rid[4:]) % 2 else {}
            items.append(item(rid, chunk, finished=done, **kw))
            if done:
                active.remove(rid)
        messages.append(pb.DetokenizeStreamRequest(items=items))
        sent.append([(i.request_id, len(i.new_token_ids)) for i in items])

    replies = stream(stub, messages)
    assert len(replies) == len(messages)
    out = {rid: "" for rid in texts}
    for reply, expected in zip(replies, sent):
        assert [(r.request_id, r.tokens_consumed) for r in reply.results] == expected
        for r in reply.results:
            assert not r.HasField("error") and "\ufffd" not in r.text_delta
            out[r.request_id] += r.text_delta
    assert out == texts
    assert all(r.finished for r in replies[-1].results)


def test_stream_stop_strings(stub):
    ids = tokenize(stub, "The quick brown fox jumps over the lazy dog")
    open_a = pb.DetokenizeOpen(stop=["fox jumps"])
    open_b = pb.DetokenizeOpen(stop=["fox jumps"], include_stop_str_in_output=True)
    first = [item("a", ids[:3], open=open_a), item("b", ids[:3], open=open_b)]
    second = [item("a", ids[3:6]), item("b", ids[3:6])]
    late = [item("a", ids[6:7]), item("b", ids[6:7])]  # the engine had not stopped yet
    r1, r2, r3 = stream(stub, [pb.DetokenizeStreamRequest(items=m) for m in (first, second, late)])
    a = [r1.results[0], r2.results[0], r3.results[0]]
    b = [r1.results[1], r2.results[1], r3.results[1]]
    assert a[0].text_delta + a[1].text_delta == "The quick brown "
    assert a[1].stop_matched == "fox jumps" and a[1].finished and a[1].tokens_consumed == 2
    assert b[0].text_delta + b[1].text_delta == "The quick brown fox jumps"
    assert b[1].stop_matched == "fox jumps" and b[1].tokens_consumed == 2
    for r in (a[2], b[2]):  # tokens after the stop are ignored, not a new request
        assert r.finished and r.text_delta == "" and not r.HasField("error")


def test_stream_prompt_context_and_special_tokens(stub):
    prompt = tokenize(stub, "Say hello")
    gen = tokenize(stub, " hello there") + [2]
    msgs = [pb.DetokenizeStreamRequest(items=[
        item("keep", gen, finished=True, open=pb.DetokenizeOpen(prompt_token_ids=prompt, skip_special_tokens=False)),
        item("skip", gen, finished=True, open=pb.DetokenizeOpen(prompt_token_ids=prompt)),
    ])]
    (reply,) = stream(stub, msgs)
    assert reply.results[0].text_delta == " hello there<|im_end|>"
    assert reply.results[1].text_delta == " hello there"


def test_stream_bad_items_leave_the_rest_alone(stub):
    good = tokenize(stub, "Good text stays good 👍")
    other = tokenize(stub, "Another one")
    m1 = [
        item("good", good[:2], open=pb.DetokenizeOpen()),
        item("oov", [5, 49152]),
        item("good", [], open=pb.DetokenizeOpen()),          # reused request id
        item(""),                                            # no request id
        item("empty-stop", [5], open=pb.DetokenizeOpen(stop=[""])),
        item("bad-prompt", [5], open=pb.DetokenizeOpen(prompt_token_ids=[-3])),
        item("neg", [-1]),
        item("other", other[:1]),
    ]
    m2 = [item("good", good[2:], finished=True), item("other", other[1:], finished=True),
          item("oov", [5])]
    r1, r2 = stream(stub, [pb.DetokenizeStreamRequest(items=m1), pb.DetokenizeStreamRequest(items=m2)])
    res = r1.results
    assert [r.request_id for r in res] == [i.request_id for i in m1]
    errors = {i: r.error for i, r in enumerate(res) if r.HasField("error")}
    assert sorted(errors) == [1, 2, 3, 4, 5, 6]
    for i, error in errors.items():
        assert error.code == "INVALID_ARGUMENT" and res[i].finished
    assert errors[1].message.startswith("new_token_ids:") and "49152" in errors[1].message
    assert errors[2].message.startswith("open:") and "already open" in errors[2].message
    assert errors[3].message.startswith("request_id:")
    assert errors[4].message.startswith("open.stop:")
    assert errors[5].message.startswith("open.prompt_token_ids:")
    assert errors[6].message.startswith("new_token_ids:")
    # The good requests go on as if nothing happened.
    assert res[0].text_delta + r2.results[0].text_delta == "Good text stays good 👍"
    assert res[7].text_delta + r2.results[1].text_delta == "Another one"
    assert r2.results[0].finished and not r2.results[0].HasField("error")
    assert r2.results[2].finished  # the failed request stays ended
    # And new calls work.
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=good)).text == "Good text stays good 👍"


def test_stream_cancel_and_forget_on_stream_end(stub):
    ids = tokenize(stub, "cancel me please")
    r1, r2 = stream(stub, [
        pb.DetokenizeStreamRequest(items=[item("c", ids[:1]), item("k", ids[:1])]),
        pb.DetokenizeStreamRequest(items=[item("c", ids[1:], cancel=True), item("k", ids[1:])]),
    ])
    assert r2.results[0].finished and r2.results[0].text_delta == ""
    assert not r2.results[1].finished
    # A new stream knows nothing of the old one: "k" opens afresh, no "already open".
    (r,) = stream(stub, [pb.DetokenizeStreamRequest(items=[item("k", ids, open=pb.DetokenizeOpen(),
                                                                    finished=True)])])
    assert not r.results[0].HasField("error")
    assert r.results[0].text_delta == "cancel me please"


def test_stream_is_fast_with_64_requests_per_message(stub):
    ids = tokenize(stub, "The service must keep up with an engine step of many requests. " * 4)
    steps = len(ids)
    messages = [pb.DetokenizeStreamRequest(items=[
        item(f"r{j}", [ids[s]], finished=s == steps - 1,
             **({"open": pb.DetokenizeOpen(stop=["never appears"])} if s == 0 else {}))
        for j in range(64)]) for s in range(steps)]
    started = time.perf_counter()
    replies = stream(stub, messages)
    elapsed = time.perf_counter() - started
    per_token_ms = elapsed / (64 * steps) * 1e3
    assert len(replies) == steps
    assert "".join(r.results[5].text_delta for r in replies) == tokenize_text(ids, stub)
    print(f"detokenize stream: {per_token_ms * 1e3:.1f} us per token, 64 requests per message")
    assert per_token_ms < 0.25, f"{per_token_ms:.3f} ms per token"


def tokenize_text(ids, stub) -> str:
    return stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text


def test_sigterm_while_loading_exits_promptly(tmp_path):
    port = free_port()
    process = start_process(port, tmp_path / "early.log")
    channel = grpc.insecure_channel(f"{HOST}:{port}")
    try:
        deadline = time.monotonic() + 30
        while health(channel) is None and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert process.wait(timeout=15) == 0, (tmp_path / "early.log").read_text()
        assert time.monotonic() - started < 8
    finally:
        channel.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def _open_streams(stub):
    """A detokenize and a tokenize stream held open (as the frontend holds them), one message
    answered on each: (responses, outboxes); put None in an outbox to end its requests."""
    outboxes = [queue.Queue(), queue.Queue()]

    def requests(box):
        while (message := box.get()) is not None:
            yield message

    detok = stub.DetokenizeStream(requests(outboxes[0]), timeout=60)
    tok = stub.TokenizeStream(requests(outboxes[1]), timeout=60)
    outboxes[0].put(pb.DetokenizeStreamRequest(items=[item("d", tokenize(stub, "hello there"), finished=True,
                                                           open=pb.DetokenizeOpen())]))
    outboxes[1].put(pb.TokenizeStreamRequest(items=[pb.TokenizeItem(id=1, request=pb.TokenizeRequest(text="hi"))]))
    assert next(detok).results[0].text_delta == "hello there"
    assert list(next(tok).results[0].response.token_ids) == tokenize(stub, "hi")
    return {"detok": detok, "tok": tok}, outboxes


def _errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if '"level": "ERROR"' in line]


def test_client_cancelling_open_streams_logs_no_error(server, stub):
    """A frontend that goes away cancels its streams: the server's read of the next message,
    cut short, must not end as asyncio's "Task exception was never retrieved" at ERROR."""
    before = len(server.log())
    calls, outboxes = _open_streams(stub)
    for call in calls.values():
        call.cancel()
    for box in outboxes:
        box.put(None)
    time.sleep(0.5)
    assert stream(stub, [pb.DetokenizeStreamRequest(items=[item("after", tokenize(stub, "still here"), finished=True,
                                                                open=pb.DetokenizeOpen())])])[0] \
        .results[0].text_delta == "still here"
    errors = _errors(server.log()[before:])
    assert not errors, "\n".join(errors)


def test_sigterm_with_open_streams_ends_them_cleanly(tmp_path):
    """On SIGTERM the streams a frontend holds open end with OK, and nothing is logged at ERROR."""
    srv = Server(tmp_path)
    code = None
    outboxes = []
    try:
        calls, outboxes = _open_streams(srv.stub)
        ended: dict[str, object] = {}

        def drain(name, responses):
            try:
                ended[name] = list(responses)
            except grpc.RpcError as exc:
                ended[name] = exc.code()

        readers = [threading.Thread(target=drain, args=(name, call)) for name, call in calls.items()]
        for t in readers:
            t.start()
        time.sleep(0.2)
        srv.process.send_signal(signal.SIGTERM)  # the channel stays open, as the frontend's does
        for t in readers:
            t.join(timeout=15)
        code = srv.process.wait(timeout=15)
        assert ended == {"detok": [], "tok": []}, ended
    finally:
        for box in outboxes:
            box.put(None)
        srv.channel.close()
        if srv.process.poll() is None:
            srv.process.kill()
            srv.process.wait()
    log = srv.log()
    assert code == 0, log[-3000:]
    errors = _errors(log)
    assert not errors, "\n".join(errors)
