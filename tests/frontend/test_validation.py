"""Request validation of the frontend's gRPC API (the HTTP API's is in test_openai_api.py).

The first tests call the pure validation function; the rest send bad requests to
the real stack and check the INVALID_ARGUMENT status names the offending field,
and that the stack still answers a good request afterwards.
"""
from __future__ import annotations

import grpc
import pytest

from helpers.stack import stack  # noqa: F401  (the session fixture)
from tessera.v1 import common_pb2, engine_pb2, frontend_pb2, tokenizer_pb2
from tessera_frontend.validation import Limits, ValidationError, validate_request

LIMITS = Limits(max_n=16, max_logprobs=20, max_stop=16)

# (field named in the error, bad sampling params)
BAD_PARAMS = [
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.5)),
    ("max_tokens", dict(max_tokens=0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=10, max_tokens=5)),
    ("n", dict(n=0)),
    ("n", dict(n=17)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=21)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=21)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=-2.5)),
    ("frequency_penalty", dict(frequency_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-2.5)),
    ("stop", dict(stop=[f"s{i}" for i in range(17)])),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=["x" * 1025])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=list(range(1025)))),
    ("top_p", dict(top_p=float("inf"))),
]

GOOD_PARAMS = [
    dict(),
    dict(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, max_tokens=1, min_tokens=1, n=16,
         logprobs=0, prompt_logprobs=20, repetition_penalty=1.2, presence_penalty=-2.0,
         frequency_penalty=2.0, stop=[f"s{i}" for i in range(16)]),
    dict(top_k=0, min_tokens=0, logprobs=20),
]


def _chat(text: str) -> tokenizer_pb2.ChatMessages:
    return tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=text)])


def _request(**params) -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(chat=_chat("Say hi."),
                                        sampling_params=common_pb2.SamplingParams(**params))


@pytest.mark.unit
@pytest.mark.parametrize("field,params", BAD_PARAMS)
def test_validate_rejects(field, params):
    with pytest.raises(ValidationError, match=rf"^{field}:"):
        validate_request(_request(**params), LIMITS)


@pytest.mark.unit
@pytest.mark.parametrize("params", GOOD_PARAMS)
def test_validate_accepts(params):
    validate_request(_request(**params), LIMITS)


@pytest.mark.unit
@pytest.mark.parametrize("request_", [
    frontend_pb2.GenerateRequest(),
    frontend_pb2.GenerateRequest(text=""),
    frontend_pb2.GenerateRequest(chat=tokenizer_pb2.ChatMessages()),
    frontend_pb2.GenerateRequest(token_ids=frontend_pb2.TokenIds()),
], ids=["missing", "empty-text", "no-messages", "no-ids"])
def test_validate_rejects_empty_prompt(request_):
    with pytest.raises(ValidationError, match=r"^prompt:"):
        validate_request(request_, LIMITS)


@pytest.mark.unit
def test_validate_rejects_bad_roles_and_ids():
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content="a"),
                                                tokenizer_pb2.ChatMessage(role="robot", content="b")])
    with pytest.raises(ValidationError, match=r"^prompt: chat.messages\[1\]: role"):
        validate_request(frontend_pb2.GenerateRequest(chat=chat), LIMITS)
    with pytest.raises(ValidationError, match=r"^request_id:"):
        validate_request(frontend_pb2.GenerateRequest(request_id="x" * 300, text="hi"), LIMITS)
    with pytest.raises(ValidationError, match=r"^request_id:"):
        validate_request(frontend_pb2.GenerateRequest(request_id="a\nb", text="hi"), LIMITS)


@pytest.mark.unit
def test_chat_roles_are_the_tokenizers():
    # One contract: every role the tokenizer's chat template takes passes the frontend, over gRPC
    # and HTTP, and no other does.
    from tessera.common.request_rules import CHAT_ROLES
    from tessera_frontend import openai_protocol, validation
    from tessera_tokenizer import server as tokenizer_server

    assert tokenizer_server.CHAT_ROLES is validation.CHAT_ROLES is openai_protocol.CHAT_ROLES is CHAT_ROLES
    messages = [tokenizer_pb2.ChatMessage(role=role, content=f"{role} text") for role in CHAT_ROLES]
    validate_request(frontend_pb2.GenerateRequest(chat=tokenizer_pb2.ChatMessages(messages=messages)), LIMITS)

    body = openai_protocol.ChatCompletionRequest(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Sunny"}]},
    ])
    assert body.messages[3].tool_call_id == "call_1"
    chat = openai_protocol.chat_messages(body)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Weather in Paris?"), ("assistant", ""), ("tool", "Sunny")]

    bad = openai_protocol.ChatCompletionRequest(messages=[{"role": "function", "content": "x"}])
    with pytest.raises(openai_protocol.ApiError) as info:
        openai_protocol.chat_messages(bad)
    assert info.value.status == 400 and info.value.param == "messages[0].role"
    assert "tool" in info.value.message
    with pytest.raises(openai_protocol.ApiError) as info:  # a tool message says what the tool answered
        openai_protocol.chat_messages(openai_protocol.ChatCompletionRequest(
            messages=[{"role": "tool", "tool_call_id": "call_1"}]))
    assert info.value.param == "messages[0].content"


def _expect_invalid(call, field: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in info.value.details()


@pytest.mark.integration
@pytest.mark.parametrize("field,params", BAD_PARAMS)
def test_stack_rejects_bad_field(stack, field, params):
    _expect_invalid(lambda: list(stack.frontend_stub.Generate(_request(**params), timeout=30)), field)


@pytest.mark.integration
def test_stack_complete_rejects_bad_field(stack):
    _expect_invalid(lambda: stack.frontend_stub.Complete(_request(top_p=2.0), timeout=30), "top_p")


@pytest.mark.integration
@pytest.mark.parametrize("request_", [
    frontend_pb2.GenerateRequest(),
    frontend_pb2.GenerateRequest(text=""),
    frontend_pb2.GenerateRequest(chat=tokenizer_pb2.ChatMessages()),
], ids=["missing", "empty-text", "no-messages"])
def test_stack_rejects_empty_prompt(stack, request_):
    _expect_invalid(lambda: list(stack.frontend_stub.Generate(request_, timeout=30)), "prompt")


@pytest.mark.integration
def test_stack_rejects_prompt_longer_than_model(stack):
    info = stack.engine_stub.GetInfo(engine_pb2.EngineInfoRequest(), timeout=10)
    assert info.max_model_len > 0
    _expect_invalid(lambda: list(stack.frontend_stub.Generate(
        _request(max_tokens=info.max_model_len), timeout=30)), "max_tokens")
    ids = frontend_pb2.GenerateRequest(token_ids=frontend_pb2.TokenIds(ids=[1] * info.max_model_len),
                                       sampling_params=common_pb2.SamplingParams(max_tokens=1))
    _expect_invalid(lambda: list(stack.frontend_stub.Generate(ids, timeout=30)), "max_tokens")


@pytest.mark.integration
def test_stack_rejects_token_ids_outside_vocab(stack):
    info = stack.tokenizer_stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest(), timeout=10)
    request = frontend_pb2.GenerateRequest(token_ids=frontend_pb2.TokenIds(ids=[1, info.vocab_size]))
    _expect_invalid(lambda: list(stack.frontend_stub.Generate(request, timeout=30)), "token_ids")
    _expect_invalid(lambda: list(stack.frontend_stub.Generate(
        _request(stop_token_ids=[info.vocab_size]), timeout=30)), "stop_token_ids")


@pytest.mark.integration
def test_stack_checks_min_tokens_against_the_default_max_tokens(stack):
    # max_tokens absent means 16 (vLLM's default): min_tokens 20 cannot be honoured.
    _expect_invalid(lambda: list(stack.frontend_stub.Generate(_request(min_tokens=20), timeout=30)),
                    "min_tokens")


@pytest.mark.integration
def test_stack_rejects_bad_roles_and_request_ids(stack):
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="robot", content="hi")])
    _expect_invalid(lambda: list(stack.frontend_stub.Generate(frontend_pb2.GenerateRequest(chat=chat),
                                                               timeout=30)), "role")
    _expect_invalid(lambda: stack.frontend_stub.Complete(_request(), timeout=30,
                                                         metadata=(("x-request-id", "x" * 300),)),
                    "x-request-id")


@pytest.mark.integration
def test_stack_answers_after_bad_requests(stack):
    responses = list(stack.frontend_stub.Generate(_request(temperature=0.0, max_tokens=8), timeout=120))
    assert responses and responses[-1].finish_reason in (common_pb2.FINISH_REASON_STOP,
                                                         common_pb2.FINISH_REASON_LENGTH)
    assert responses[-1].usage.completion_tokens == sum(len(r.token_ids) for r in responses)
