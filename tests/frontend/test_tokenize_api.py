"""vLLM's /tokenize and /detokenize HTTP endpoints, through the real stack.

The token ids are checked against the Hugging Face tokenizer of the default model (the
reference), the chat form against the prompt tokens a chat completion of the same messages
counts, and every refusal for its status and OpenAI's error body naming the parameter.
"""
from __future__ import annotations

import http.client
import json
import urllib.parse

import pytest

from helpers.engine_fixtures import hf_tokenizer, model_source  # noqa: F401  (session fixtures)
from helpers.stack import stack  # noqa: F401  (the session fixture)
from tessera.v1 import tokenizer_pb2

pytestmark = pytest.mark.integration

TEXTS = ["What is the capital of France? Answer in one word.",
         "  leading spaces, tabs\tand\nnew lines  ",
         "Ünïcödé: 日本語のテキスト, emoji 🦜🐉, math ∑∫√"]
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a planet."},
            {"role": "assistant", "content": "Mars."},
            {"role": "user", "content": [{"type": "text", "text": "Another "}, {"type": "text", "text": "one?"}]}]
# MESSAGES as the chat template gets them (text parts joined)
PLAIN_MESSAGES = [*MESSAGES[:3], {"role": "user", "content": "Another one?"}]


@pytest.fixture(scope="module")
def model_info(stack) -> tokenizer_pb2.ModelInfo:
    return stack.tokenizer_stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest(), timeout=10)


@pytest.fixture(scope="module")
def model(model_info) -> str:
    return model_info.model_name


def call(stack, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of one HTTP request to the frontend."""
    url = urllib.parse.urlsplit(stack.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def post(stack, path: str, body: dict) -> tuple[int, dict]:
    return call(stack, "POST", path, body)


def tokenize(stack, body: dict) -> dict:
    status, reply = post(stack, "/tokenize", body)
    assert status == 200, reply
    return reply


def test_tokenize_prompt_matches_hf(stack, model, hf_tokenizer):
    status, models = call(stack, "GET", "/v1/models")
    assert status == 200
    max_model_len = models["data"][0]["max_model_len"]
    for text in TEXTS:
        reply = tokenize(stack, {"model": model, "prompt": text})
        expected = hf_tokenizer(text)["input_ids"]
        assert reply == {"count": len(expected), "max_model_len": max_model_len, "tokens": expected}
        bare = tokenize(stack, {"prompt": text, "add_special_tokens": False})  # "model" may be left out
        assert bare["tokens"] == hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_detokenize_round_trips(stack, model, hf_tokenizer):
    for text in TEXTS:
        tokens = tokenize(stack, {"model": model, "prompt": text})["tokens"]
        status, reply = post(stack, "/detokenize", {"model": model, "tokens": tokens})
        assert status == 200 and reply == {"prompt": text}
    # special tokens are kept, as vLLM's decode keeps them: the rendered chat template comes back
    rendered = hf_tokenizer.apply_chat_template(PLAIN_MESSAGES, tokenize=False, add_generation_prompt=True)
    tokens = tokenize(stack, {"messages": MESSAGES})["tokens"]
    assert post(stack, "/detokenize", {"tokens": tokens}) == (200, {"prompt": rendered})
    assert post(stack, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


def test_tokenize_chat_matches_template_and_chat_usage(stack, model, hf_tokenizer):
    reply = tokenize(stack, {"model": model, "messages": MESSAGES})
    expected = hf_tokenizer.apply_chat_template(PLAIN_MESSAGES, tokenize=True, add_generation_prompt=True,
                                                return_dict=False)
    assert reply["tokens"] == expected and reply["count"] == len(expected)

    status, completion = post(stack, "/v1/chat/completions",
                              {"model": model, "messages": MESSAGES, "max_tokens": 1, "temperature": 0})
    assert status == 200, completion
    assert reply["count"] == completion["usage"]["prompt_tokens"]

    without = tokenize(stack, {"messages": MESSAGES, "add_generation_prompt": False})
    assert without["tokens"] == hf_tokenizer.apply_chat_template(
        PLAIN_MESSAGES, tokenize=True, add_generation_prompt=False, return_dict=False)
    assert without["count"] < reply["count"] and reply["tokens"][:without["count"]] == without["tokens"]


def test_token_strs(stack, model_info, hf_tokenizer):
    text = TEXTS[0]
    reply = tokenize(stack, {"prompt": text, "return_token_strs": True})
    assert len(reply["token_strs"]) == reply["count"]
    assert "".join(reply["token_strs"]) == hf_tokenizer.decode(reply["tokens"]) == text
    chat = tokenize(stack, {"messages": MESSAGES[1:2], "return_token_strs": True})
    assert [s for s in chat["token_strs"] if s in model_info.special_tokens]  # special tokens named, not dropped
    assert "".join(chat["token_strs"]) == hf_tokenizer.decode(chat["tokens"])
    assert "token_strs" not in tokenize(stack, {"prompt": text})


def test_unknown_model_is_404(stack):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        status, reply = post(stack, path, {**body, "model": "gpt-9"})
        assert status == 404, reply
        assert reply["error"]["code"] == "model_not_found" and reply["error"]["param"] == "model"


TOKENIZE_ERRORS = [  # (param, body, a part of the message)
    ("prompt", {}, "either prompt or messages"),
    ("prompt", {"prompt": ""}, "must not be empty"),
    ("prompt", {"prompt": 5}, "string"),
    # over the tokenizer's --max-input-chars: the tokenizer's refusal, under the client's parameter name
    ("prompt", {"prompt": "x" * 1_000_001}, "prompt: 1000001 characters is over the limit"),
    ("messages", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "not both"),
    ("messages", {"messages": []}, "at least one message"),
    ("messages[0].role", {"messages": [{"role": "wizard", "content": "hi"}]}, "'wizard'"),
    ("messages[0].content", {"messages": [{"role": "user"}]}, "required"),
    ("continue_final_message", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
                                "add_generation_prompt": False}, "not supported"),
    ("add_special_tokens", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
     "not supported"),
    ("tools", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "not supported"),
    ("prompt", {"prompt": "\ud800"}, "lone surrogate"),
]


@pytest.mark.parametrize("param,body,message", TOKENIZE_ERRORS,
                         ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(TOKENIZE_ERRORS)])
def test_tokenize_rejects_bad_input(stack, param, body, message):
    status, reply = post(stack, "/tokenize", body)
    assert status == 400, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert message in error["message"], error


def test_detokenize_rejects_bad_tokens(stack, model_info):
    vocab = model_info.vocab_size
    cases = [("tokens[1]", [1, vocab]), ("tokens[2]", [1, 2, -1]), ("tokens[0]", [2 ** 40]),
             ("tokens", None), ("tokens[0]", ["a"])]
    for param, tokens in cases:
        status, reply = post(stack, "/detokenize", {} if tokens is None else {"tokens": tokens})
        assert status == 400, (tokens, reply)
        assert reply["error"]["param"] == param, (tokens, reply)
    status, reply = post(stack, "/detokenize", {"tokens": [1, vocab]})
    assert reply["error"]["message"] == f"tokens[1]: {vocab} is outside the vocabulary [0, {vocab})"
    # the last id of the vocabulary is in it
    assert post(stack, "/detokenize", {"tokens": [vocab - 1]})[0] == 200
