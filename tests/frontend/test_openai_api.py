"""The OpenAI-compatible HTTP API, through the real stack, with the real `openai` package as the client.

Raw HTTP (http.client) is used only where the client library hides what is tested:
the server-sent-event framing ending in `data: [DONE]`, invalid JSON, and a client
that drops its connection mid-request (the request must be aborted in the engine).
"""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import time
import urllib.parse

import grpc
import openai
import pytest

from helpers.stack import client, model, stack, wait_engine_idle  # noqa: F401  (fixtures)
from tessera.v1 import common_pb2, engine_pb2, frontend_pb2, tokenizer_pb2

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France? Answer in one word."
LONG_STORY = "Write a very long story about a dragon."



def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def grpc_complete(stack, text: str, **params) -> frontend_pb2.GenerateResult:
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=text)])
    return stack.frontend_stub.Complete(frontend_pb2.GenerateRequest(
        chat=chat, sampling_params=common_pb2.SamplingParams(**params)), timeout=120)


def open_post(stack, path: str, body, timeout: float = 120) -> tuple[http.client.HTTPConnection,
                                                                      http.client.HTTPResponse]:
    """POST a JSON body (or raw bytes) with http.client; returns the connection and its response."""
    url = urllib.parse.urlsplit(stack.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"content-type": "application/json"})
    return conn, conn.getresponse()


def sse_events(response: http.client.HTTPResponse):
    """The `data:` payloads of a server-sent-event response, as they arrive."""
    for raw in response:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data: "):
            yield line[len("data: "):]
        else:
            assert line == "", f"unexpected SSE line {line!r}"


# -- discovery and health ---------------------------------------------------------------------
def test_models_and_health(stack, client, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert models.data[0].owned_by == "tessera"
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")

    url = urllib.parse.urlsplit(stack.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", "/health")
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read()) == {"status": "ok"}
    conn.request("GET", "/v1/nowhere")
    response = conn.getresponse()
    assert response.status == 404
    assert json.loads(response.read())["error"]["code"] == "not_found"


# -- chat ---------------------------------------------------------------------------------------
def test_chat_matches_grpc(stack, client, model):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=user(QUESTION), temperature=0, max_tokens=16,
        extra_headers={"x-request-id": "http-chat-1"})
    assert raw.headers["x-request-id"] == "http-chat-1"
    reply = raw.parse()
    assert reply.id == "chatcmpl-http-chat-1" and reply.object == "chat.completion"
    assert reply.model == model
    [choice] = reply.choices
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content, stack.logs()
    assert choice.finish_reason in ("stop", "length")

    reference = grpc_complete(stack, QUESTION, temperature=0.0, max_tokens=16)
    assert choice.message.content == reference.choices[0].text
    assert reply.usage.completion_tokens == reference.usage.completion_tokens
    assert reply.usage.prompt_tokens == reference.usage.prompt_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_with_usage(client, model):
    whole = client.chat.completions.create(model=model, messages=user(QUESTION), temperature=0, max_tokens=16)
    chunks = list(client.chat.completions.create(
        model=model, messages=user(QUESTION), temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_framing_ends_with_done(stack, model):
    conn, response = open_post(stack, "/v1/chat/completions", {
        "model": model, "messages": user(QUESTION), "temperature": 0, "max_tokens": 8, "stream": True})
    try:
        assert response.status == 200
        assert response.getheader("content-type").startswith("text/event-stream")
        events = list(sse_events(response))
    finally:
        conn.close()
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads and all("choices" in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_n_choices(client, model):
    reply = client.chat.completions.create(model=model, messages=user("Tell me a short joke."), n=3,
                                           temperature=0.9, seed=7, max_tokens=12)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert all(c.message.content and c.finish_reason for c in reply.choices)

    chunks = list(client.chat.completions.create(model=model, messages=user("Tell me a short joke."), n=3,
                                                 temperature=0.9, seed=7, max_tokens=12, stream=True))
    streamed = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
                for i in range(3)}
    # The same seed gives the same samples, streamed or not.
    assert streamed == {c.index: c.message.content for c in reply.choices}


def test_chat_logprobs(client, model):
    reply = client.chat.completions.create(model=model, messages=user(QUESTION), temperature=0, max_tokens=6,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for position in content:
        assert position.logprob <= 0 and position.bytes == list(position.token.encode())
        assert len(position.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert position.top_logprobs[0].token == position.token
    assert "".join(p.token for p in content).startswith(reply.choices[0].message.content[:3])


# -- completions ----------------------------------------------------------------------------------
def test_completions_text_ids_and_stream(stack, client, model):
    prompt = "The capital of France is"
    text = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8)
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    assert text.choices[0].text and text.usage.completion_tokens == 8  # greedy prose runs to max_tokens

    ids = list(stack.tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=prompt), timeout=10).token_ids)
    by_ids = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=8)
    assert by_ids.choices[0].text == text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == text.usage.prompt_tokens

    chunks = list(client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_completions_batch_with_n(client, model):
    prompts = ["Once upon a time", "The sky is"]
    reply = client.completions.create(model=model, prompt=prompts, n=2, temperature=0.8, seed=3, max_tokens=5)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert reply.usage.completion_tokens == 4 * 5
    single = client.completions.create(model=model, prompt=prompts[1], n=2, temperature=0.8, seed=3, max_tokens=5)
    # Choices 2 and 3 are the second prompt's samples.
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)][2:] == \
           [c.text for c in sorted(single.choices, key=lambda c: c.index)]


def test_completions_logprobs(client, model):
    reply = client.completions.create(model=model, prompt="The capital of France is", temperature=0,
                                      max_tokens=5, logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and token in top and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the most likely


def test_prompt_logprobs(client, model):
    reply = client.completions.create(model=model, prompt="The capital of France is", temperature=0,
                                      max_tokens=2, extra_body={"prompt_logprobs": 1})
    positions = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == reply.usage.prompt_tokens
    assert positions[0] is None  # the first prompt token has no context
    for position in positions[1:]:
        assert 1 <= len(position) <= 2  # the prompt's token, and the top-1 when it differs
        assert all(entry["logprob"] <= 0 and entry["rank"] >= 1 for entry in position.values())


# -- vLLM's extra sampling fields ------------------------------------------------------------------
def test_vllm_extra_sampling_fields(stack, client, model):
    forced = client.chat.completions.create(model=model, messages=user(QUESTION), max_tokens=24,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 24 and forced.choices[0].finish_reason == "length"

    at_least = client.chat.completions.create(model=model, messages=user(QUESTION), max_tokens=20,
                                              temperature=0, extra_body={"min_tokens": 20})
    assert at_least.usage.completion_tokens == 20

    greedy = client.chat.completions.create(model=model, messages=user(QUESTION), max_tokens=12, temperature=0)
    top1 = client.chat.completions.create(model=model, messages=user(QUESTION), max_tokens=12, temperature=1.0,
                                          seed=5, extra_body={"top_k": 1})
    min_p = client.chat.completions.create(model=model, messages=user(QUESTION), max_tokens=12, temperature=1.0,
                                           seed=5, extra_body={"min_p": 1.0})
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    assert min_p.choices[0].message.content == greedy.choices[0].message.content
    penalized = client.chat.completions.create(model=model, messages=user(QUESTION), max_tokens=12,
                                               temperature=0, extra_body={"repetition_penalty": 1.3})
    assert penalized.choices[0].message.content

    ids = list(grpc_complete(stack, QUESTION, temperature=0.0, max_tokens=12).choices[0].token_ids)
    assert len(ids) >= 3
    stopped = client.chat.completions.create(model=model, messages=user(QUESTION), max_tokens=12, temperature=0,
                                             extra_body={"stop_token_ids": [ids[2]]})
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == ids[2]
    assert stopped.usage.completion_tokens == ids.index(ids[2]) + 1


def test_stop_string(client, model):
    whole = client.completions.create(model=model, prompt="Count: one, two, three,", temperature=0, max_tokens=12)
    words = whole.choices[0].text.split()
    assert len(words) >= 3, whole.choices[0].text
    stop = words[1]
    cut = client.completions.create(model=model, prompt="Count: one, two, three,", temperature=0,
                                    max_tokens=12, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    assert cut.choices[0].text == whole.choices[0].text[:whole.choices[0].text.index(stop)]


# -- errors -----------------------------------------------------------------------------------------
CHAT_ERRORS = [
    ("temperature", dict(temperature=-1)),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("n", dict(n=0)),
    ("n", dict(n=17)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_completion_tokens", dict(max_completion_tokens=0)),
    ("max_tokens", dict(max_tokens=10 ** 6)),
    ("max_tokens", dict(max_tokens=2 ** 40)),
    ("presence_penalty", dict(presence_penalty=3)),
    ("frequency_penalty", dict(frequency_penalty=-3)),
    ("top_logprobs", dict(logprobs=True, top_logprobs=21)),
    ("top_logprobs", dict(top_logprobs=2)),
    ("stop", dict(stop=[f"s{i}" for i in range(17)])),
    ("seed", dict(seed=2 ** 70)),
    ("logit_bias", dict(logit_bias={"1": 101})),
    ("tools[0].function.name", dict(tools=[{"type": "function", "function": {"parameters": {}}}])),
    ("response_format.type", dict(response_format={"type": "yaml"})),
    ("top_k", dict(extra_body={"top_k": -2})),
    ("min_p", dict(extra_body={"min_p": 1.5})),
    ("repetition_penalty", dict(extra_body={"repetition_penalty": 0})),
    ("min_tokens", dict(max_tokens=5, extra_body={"min_tokens": 6})),
    ("min_tokens", dict(extra_body={"min_tokens": -1})),
    ("stop_token_ids", dict(extra_body={"stop_token_ids": [-1]})),
    ("stop_token_ids", dict(extra_body={"stop_token_ids": [10 ** 8]})),
    ("messages", dict(messages=[])),
    ("messages[0].role", dict(messages=[{"role": "robot", "content": "hi"}])),
    ("messages[1].role", dict(messages=[{"role": "user", "content": "hi"}, {"role": "function", "content": "x"}])),
    ("messages[0].content", dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])),
    ("messages[0].content", dict(messages=[{"role": "user"}])),
    ("temperature", dict(temperature="hot")),
]


def test_chat_accepts_tool_messages(client, model):
    # The tool role (with OpenAI's tool_call_id) is taken, as the tokenizer's chat template takes it.
    messages = [*user("What is the weather in Paris?"),
                {"role": "assistant", "content": "Let me look that up."},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0.0)
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 0


@pytest.mark.parametrize("param,kwargs", CHAT_ERRORS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CHAT_ERRORS)])
def test_chat_rejects_bad_field(client, model, param, kwargs):
    request = dict(model=model, messages=user("Say hi."), max_tokens=4)
    request.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    error = info.value.body
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


COMPLETION_ERRORS = [
    ("echo", dict(echo=True)),
    ("suffix", dict(suffix="the end")),
    ("best_of", dict(n=3, best_of=2)),
    ("logprobs", dict(logprobs=21)),
    ("prompt", dict(prompt="")),
    ("prompt", dict(prompt=[])),
    ("prompt", dict(prompt=[1, 10 ** 8])),
    ("prompt", dict(prompt=["ok", ""])),
    ("prompt", dict(prompt=["p"] * 65)),
]


@pytest.mark.parametrize("param,kwargs", COMPLETION_ERRORS,
                         ids=[f"{p}-{i}" for i, (p, _) in enumerate(COMPLETION_ERRORS)])
def test_completions_rejects_bad_field(client, model, param, kwargs):
    request = dict(model=model, prompt="Hello", max_tokens=4)
    request.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**request)
    assert info.value.body["param"] == param, info.value.body


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=user("hi"), max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_invalid_json_and_missing_fields(stack, model):
    conn, response = open_post(stack, "/v1/chat/completions", b"{not json")
    body = json.loads(response.read())
    conn.close()
    assert response.status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    conn, response = open_post(stack, "/v1/chat/completions", {"model": model})
    body = json.loads(response.read())
    conn.close()
    assert response.status == 400 and body["error"]["param"] == "messages"


def test_stream_refused_before_it_starts(client, model):
    """A request the engine side refuses is an HTTP error even when streaming was asked for."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=user("hi"), max_tokens=10 ** 6, stream=True)
    assert info.value.body["param"] == "max_tokens"


# -- cancellation and isolation ------------------------------------------------------------------------
def _engine_busy(stack) -> bool:
    stats = stack.engine_stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
    return stats.num_running + stats.num_waiting >= 1


def test_stream_disconnect_aborts_in_engine(stack, model):
    conn, response = open_post(stack, "/v1/chat/completions", {
        "model": model, "messages": user(LONG_STORY), "temperature": 0, "max_tokens": 1000,
        "stream": True, "extra": "ignored", "ignore_eos": True})
    assert response.status == 200
    events = sse_events(response)
    for _ in range(4):  # the role chunk, then tokens
        next(events)
    assert _engine_busy(stack)
    conn.sock.shutdown(2)
    conn.close()
    stats = wait_engine_idle(stack.engine_stub, seconds=5.0)
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert stats.num_blocks_free == stats.num_blocks_total, stats


def test_non_stream_disconnect_aborts_in_engine(stack, model):
    url = urllib.parse.urlsplit(stack.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": model, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}).encode(),
        headers={"content-type": "application/json"})
    deadline = time.monotonic() + 30
    while not _engine_busy(stack):
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.05)
    conn.sock.shutdown(2)
    conn.close()
    stats = wait_engine_idle(stack.engine_stub, seconds=5.0)
    assert stats.num_running == 0 and stats.num_blocks_free == stats.num_blocks_total, stats


def test_bad_requests_do_not_disturb_a_running_one(stack, client, model):
    reference = grpc_complete(stack, "Why is the sky blue?", temperature=0.0, max_tokens=40)

    def bad_http(i: int):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=[{"role": "robot", "content": str(i)}])
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt=[10 ** 8], max_tokens=3)

    def bad_grpc(i: int):
        request = frontend_pb2.GenerateRequest(token_ids=frontend_pb2.TokenIds(ids=[1, 10 ** 8]))
        with pytest.raises(grpc.RpcError):
            list(stack.frontend_stub.Generate(request, timeout=30))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        good = pool.submit(lambda: client.chat.completions.create(
            model=model, messages=user("Why is the sky blue?"), temperature=0, max_tokens=40))
        spam = [pool.submit(fn, i) for i in range(6) for fn in (bad_http, bad_grpc)]
        for future in spam:
            future.result()
        answer = good.result()
    assert answer.choices[0].message.content == reference.choices[0].text
    assert answer.usage.completion_tokens == reference.usage.completion_tokens
