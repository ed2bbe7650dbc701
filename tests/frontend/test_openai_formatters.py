"""The OpenAI response shapes in-process: openai_formatters' chat and completion formatters
(whole responses, stream chunks, usage, finish_reason / stop_reason mapping, logprobs) and
openai_api's server-sent-event stream built on them. SampleOutputs are made by hand;
the stack tests (test_openai_api.py) check the same shapes through the openai client.
"""
from __future__ import annotations

import asyncio
import json
import math

import grpc
import pytest

from tessera.v1 import common_pb2
from tessera_frontend.async_llm import GenerateError
from tessera_frontend.openai_api import event_stream
from tessera_frontend.openai_formatters import (LOGPROB_FLOOR, ChatFormatter, CompletionFormatter, IndexedOutput,
                                                Usage)
from tessera_frontend.openai_protocol import ChatCompletionRequest, CompletionRequest
from tessera_frontend.output_processor import SampleOutput

pytestmark = pytest.mark.unit

RUNNING = common_pb2.FINISH_REASON_UNSPECIFIED
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT
MESSAGES = [{"role": "user", "content": "hi"}]


def lp(token: str, logprob: float, token_id: int = 0, rank: int = 1) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token=token, logprob=logprob, token_id=token_id, rank=rank)


def position(chosen: common_pb2.TokenLogprob, *top: common_pb2.TokenLogprob) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(chosen=chosen, top=top)


def out(text: str, index: int = 0, finish: int = RUNNING, stop_reason: str | None = None,
        stop_token_id: int | None = None, usage: common_pb2.Usage | None = None, logprobs=(),
        prompt_logprobs=None) -> SampleOutput:
    return SampleOutput("req", index, text, [1] * max(1, len(logprobs)), list(logprobs), finish, stop_reason,
                        usage, stop_token_id, prompt_logprobs, num_prompt_tokens=5)


def usage(prompt: int, completion: int, cached: int = 0) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=cached)


# -- chat -----------------------------------------------------------------------------------------
def test_chat_response_with_n_choices_and_finish_reasons():
    body = ChatCompletionRequest(messages=MESSAGES, n=3)
    formatter = ChatFormatter(body, "abc", "the-model")
    outputs = [IndexedOutput(0, out("Hel")), IndexedOutput(1, out("Bye", 1, finish=STOP, stop_reason="!")),
               IndexedOutput(0, out("lo", finish=LENGTH)),
               IndexedOutput(2, out("", 2, finish=STOP, stop_token_id=2, usage=usage(5, 4, cached=3)))]
    response = formatter.response(outputs, num_choices=3)
    assert response["id"] == "chatcmpl-abc" and response["object"] == "chat.completion"
    assert response["model"] == "the-model" and isinstance(response["created"], int)
    assert response["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None,
         "finish_reason": "length", "stop_reason": None},
        {"index": 1, "message": {"role": "assistant", "content": "Bye"}, "logprobs": None,
         "finish_reason": "stop", "stop_reason": "!"},
        {"index": 2, "message": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": "stop", "stop_reason": 2},  # vLLM's stop_reason: the stop token id
    ]
    assert response["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                                 "prompt_tokens_details": {"cached_tokens": 3}}


def test_finish_reason_mapping():
    formatter = ChatFormatter(ChatCompletionRequest(messages=MESSAGES), "x", "m")
    reasons = {}
    for finish in (STOP, LENGTH, ABORT, common_pb2.FINISH_REASON_ERROR):
        (chunk,) = formatter.stream_chunks(0, out("", finish=finish))
        reasons[finish] = chunk["choices"][0]["finish_reason"]
    assert reasons == {STOP: "stop", LENGTH: "length", ABORT: "abort", common_pb2.FINISH_REASON_ERROR: "stop"}
    (chunk,) = formatter.stream_chunks(0, out("x"))
    assert chunk["choices"][0]["finish_reason"] is None and chunk["choices"][0]["stop_reason"] is None


def test_chat_stream_chunks():
    body = ChatCompletionRequest(messages=MESSAGES, n=2, stream=True, stream_options={"include_usage": True})
    formatter = ChatFormatter(body, "abc", "m")
    start = formatter.stream_start()
    assert [c["choices"] for c in start] == [
        [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        for i in (0, 1)]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in start)
    (chunk,) = formatter.stream_chunks(1, out("Hi", 1))
    assert chunk["choices"] == [{"index": 1, "delta": {"content": "Hi"}, "logprobs": None,
                                 "finish_reason": None, "stop_reason": None}]
    assert formatter.stream_chunks(0, out("")) == []  # text still held back: nothing to send
    (last,) = formatter.stream_chunks(0, out("", finish=LENGTH))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    final = formatter.usage_chunk({"prompt_tokens": 1})
    assert final["choices"] == [] and final["usage"] == {"prompt_tokens": 1} and final["id"] == "chatcmpl-abc"


def test_chat_chunks_have_no_usage_key_unless_asked():
    formatter = ChatFormatter(ChatCompletionRequest(messages=MESSAGES, stream=True), "abc", "m")
    (chunk,) = formatter.stream_chunks(0, out("Hi"))
    assert "usage" not in chunk


def test_chat_logprobs():
    body = ChatCompletionRequest(messages=MESSAGES, logprobs=True, top_logprobs=1)
    formatter = ChatFormatter(body, "abc", "m")
    positions = [position(lp("Hé", -0.25), lp("Hé", -0.25), lp("Ho", -2.0)), position(lp("!", -math.inf))]
    response = formatter.response([IndexedOutput(0, out("Hé!", finish=STOP, logprobs=positions))], 1)
    assert response["choices"][0]["logprobs"] == {"content": [
        {"token": "Hé", "logprob": -0.25, "bytes": list("Hé".encode()),
         "top_logprobs": [{"token": "Hé", "logprob": -0.25, "bytes": list("Hé".encode())}]},
        {"token": "!", "logprob": LOGPROB_FLOOR, "bytes": [33], "top_logprobs": []},  # -inf is clamped
    ]}
    json.dumps(response, allow_nan=False)  # valid JSON: no -inf left
    # Streamed: a chunk carries its tokens' logprobs even when their text is held back.
    (chunk,) = formatter.stream_chunks(0, out("", logprobs=positions[:1]))
    assert chunk["choices"][0]["logprobs"]["content"][0]["token"] == "Hé"
    no_logprobs = ChatFormatter(ChatCompletionRequest(messages=MESSAGES), "abc", "m")
    assert no_logprobs.stream_chunks(0, out("", logprobs=positions[:1])) == []


def test_prompt_logprobs_in_vllms_shape():
    body = ChatCompletionRequest(messages=MESSAGES, prompt_logprobs=1)
    formatter = ChatFormatter(body, "abc", "m")
    prompt = [common_pb2.PositionLogprobs(), position(lp("lo", -1.5, token_id=7, rank=3), lp("la", -0.5, 8, 1))]
    response = formatter.response([IndexedOutput(0, out("x", finish=STOP, prompt_logprobs=prompt))], 1)
    assert response["choices"][0]["prompt_logprobs"] == [
        None, {"7": {"logprob": -1.5, "rank": 3, "decoded_token": "lo"},
               "8": {"logprob": -0.5, "rank": 1, "decoded_token": "la"}}]
    plain = ChatFormatter(ChatCompletionRequest(messages=MESSAGES), "abc", "m")
    assert "prompt_logprobs" not in plain.response([IndexedOutput(0, out("x", finish=STOP))], 1)["choices"][0]


# -- completions ----------------------------------------------------------------------------------
def test_completion_response_for_a_batch_with_n():
    body = CompletionRequest(prompt=["a", "b"], n=2)
    formatter = CompletionFormatter(body, "abc", "m")
    outputs = [IndexedOutput(i, out(f"t{i}", i % 2, finish=LENGTH,
                                    usage=usage(3, 2) if i % 2 else None)) for i in range(4)]
    response = formatter.response(outputs, num_choices=4)
    assert response["id"] == "cmpl-abc" and response["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in response["choices"]] == [
        (0, "t0", "length"), (1, "t1", "length"), (2, "t2", "length"), (3, "t3", "length")]
    assert response["usage"]["prompt_tokens"] == 6 and response["usage"]["completion_tokens"] == 4
    assert response["usage"]["total_tokens"] == 10


def test_completion_logprobs_and_stream_text_offsets():
    body = CompletionRequest(prompt="a", logprobs=1, stream=True)
    formatter = CompletionFormatter(body, "abc", "m")
    # the top list in rank order, as the engine sends it (logprobs exact in float32)
    first = [position(lp("He", -0.25), lp("He", -0.25), lp("Ha", -1.0)), position(lp("llo", -0.5), lp("lo", -0.75))]
    (chunk1,) = formatter.stream_chunks(0, out("Hello", logprobs=first))
    (chunk2,) = formatter.stream_chunks(0, out("!", finish=STOP, stop_reason="\n",
                                               logprobs=[position(lp("!", -math.inf))]))
    assert chunk1["object"] == "text_completion" and chunk1["choices"][0]["text"] == "Hello"
    assert chunk1["choices"][0]["logprobs"] == {
        "tokens": ["He", "llo"], "token_logprobs": [-0.25, -0.5],
        "top_logprobs": [{"He": -0.25}, {"llo": -0.5, "lo": -0.75}],  # the chosen token, then the top 1
        "text_offset": [0, 2]}
    assert chunk2["choices"][0]["logprobs"] == {"tokens": ["!"], "token_logprobs": [LOGPROB_FLOOR],
                                                "top_logprobs": [{"!": LOGPROB_FLOOR}], "text_offset": [5]}
    assert (chunk2["choices"][0]["finish_reason"], chunk2["choices"][0]["stop_reason"]) == ("stop", "\n")
    assert formatter.stream_start() == []  # completions have no role chunk


def test_completion_without_logprobs():
    formatter = CompletionFormatter(CompletionRequest(prompt="a"), "abc", "m")
    response = formatter.response([IndexedOutput(0, out("x", finish=LENGTH))], 1)
    assert response["choices"][0] == {"index": 0, "text": "x", "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None}


def test_usage_sums_prompts():
    total = Usage()
    for o in (out("a", usage=usage(3, 2, 1)), out("b"), out("c", usage=usage(4, 5, 2))):
        total.add(o)
    assert total.as_dict() == {"prompt_tokens": 7, "completion_tokens": 7, "total_tokens": 14,
                               "prompt_tokens_details": {"cached_tokens": 3}}


# -- the event stream (openai_api) ------------------------------------------------------------------
async def _stream(formatter, first: IndexedOutput, rest: list, body) -> tuple[list, dict]:
    async def outputs():
        for item in rest:
            if isinstance(item, Exception):
                raise item
            yield item

    status: dict = {}
    events = [e async for e in event_stream(formatter, first, outputs(), body, status)]
    return events, status


def _payloads(events: list[str]) -> list:
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def test_event_stream_ends_with_usage_and_done():
    body = ChatCompletionRequest(messages=MESSAGES, stream=True, stream_options={"include_usage": True})
    events, status = asyncio.run(_stream(
        ChatFormatter(body, "abc", "m"), IndexedOutput(0, out("Hi")),
        [IndexedOutput(0, out(" there", finish=STOP, usage=usage(5, 2)))], body))
    payloads = _payloads(events)
    assert [p["choices"][0]["delta"] for p in payloads[:3]] == [
        {"role": "assistant", "content": ""}, {"content": "Hi"}, {"content": " there"}]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["total_tokens"] == 7
    assert status == {"code": 200}


def test_event_stream_reports_a_failure_before_done():
    body = CompletionRequest(prompt="a", stream=True)
    events, status = asyncio.run(_stream(
        CompletionFormatter(body, "abc", "m"), IndexedOutput(0, out("Hi")),
        [GenerateError(grpc.StatusCode.UNAVAILABLE, "engine went away")], body))
    payloads = _payloads(events)
    assert payloads[0]["choices"][0]["text"] == "Hi"
    assert payloads[-1] == {"error": {"message": "engine went away", "type": "service_unavailable_error",
                                      "param": None, "code": None}}
    assert status == {"code": 503}
