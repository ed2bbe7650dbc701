"""The frontend's public gRPC API beyond Generate / Complete: ListModels, Tokenize, Detokenize,
GetServerInfo (grpc_api, grpc_info), and how it names a refused request's field.

First the pure logic in process (the Tokenize request's checks, the field's path in a refusal),
then the calls on the real stack, checked against the tokenizer and engine behind it; and a
frontend whose tokenizer is not there, which answers UNAVAILABLE.
"""
from __future__ import annotations

import importlib.metadata
import re
import time

import grpc
import pytest

from helpers.stack import STARTUP_TIMEOUT_S, free_port, frontend_service, stack  # noqa: F401  (the session fixture)
from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import common_pb2, engine_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2
from tessera_frontend.grpc_api import public_message
from tessera_frontend.grpc_info import tessera_version, tokenizer_request
from tessera_frontend.grpc_util import StatusError

QUESTION = "What is the capital of France? Answer in one word."


def _chat(*turns: tuple[str, str], tools_json: str = "") -> tokenizer_pb2.ChatMessages:
    return tokenizer_pb2.ChatMessages(
        messages=[tokenizer_pb2.ChatMessage(role=role, content=content) for role, content in turns],
        tools_json=tools_json)


def _refused(request: frontend_pb2.FrontendServiceTokenizeRequest) -> str:
    with pytest.raises(StatusError) as info:
        tokenizer_request(request)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.message


# -- in process ----------------------------------------------------------------------------------

@pytest.mark.unit
def test_tokenizer_request_for_text_and_chat():
    text = tokenizer_request(frontend_pb2.FrontendServiceTokenizeRequest(text="hi", return_offsets=True))
    assert (text.text, text.add_special_tokens, text.return_offsets) == ("hi", True, True)
    plain = tokenizer_request(frontend_pb2.FrontendServiceTokenizeRequest(text="hi", add_special_tokens=False))
    assert plain.add_special_tokens is False
    chat = tokenizer_request(frontend_pb2.FrontendServiceTokenizeRequest(chat=_chat(("user", "hi"))))
    assert chat.WhichOneof("input") == "chat" and chat.add_generation_prompt is True
    assert chat.chat.messages[0].content == "hi"
    no_prompt = tokenizer_request(frontend_pb2.FrontendServiceTokenizeRequest(
        chat=_chat(("user", "hi")), add_generation_prompt=False, add_special_tokens=False))
    assert no_prompt.add_generation_prompt is False


@pytest.mark.unit
@pytest.mark.parametrize("request_,field", [
    (frontend_pb2.FrontendServiceTokenizeRequest(), "input"),
    (frontend_pb2.FrontendServiceTokenizeRequest(text=""), "text"),
    (frontend_pb2.FrontendServiceTokenizeRequest(text="hi", add_generation_prompt=True), "add_generation_prompt"),
    (frontend_pb2.FrontendServiceTokenizeRequest(chat=_chat()), "chat.messages"),
    (frontend_pb2.FrontendServiceTokenizeRequest(chat=_chat(("user", "a"), ("robot", "b"))), r"chat.messages\[1\]"),
    (frontend_pb2.FrontendServiceTokenizeRequest(chat=_chat(("user", "a")), add_special_tokens=True),
     "add_special_tokens"),
])
def test_tokenizer_request_refusals_name_the_field(request_, field):
    assert re.match(rf"^{field}: ", _refused(request_))


@pytest.mark.unit
@pytest.mark.parametrize("message,expected", [
    ("temperature: must be >= 0 (got -1.0)", "sampling_params.temperature: must be >= 0 (got -1.0)"),
    ("max_tokens: prompt (9 tokens) + max_tokens (9000) exceeds", "sampling_params.max_tokens: prompt (9 tokens) "
                                                                  "+ max_tokens (9000) exceeds"),
    ("logit_bias[7]: must be in [-100, 100]", "sampling_params.logit_bias[7]: must be in [-100, 100]"),
    ("structured_output: bad regex", "sampling_params.structured_output: bad regex"),
    ("prompt: text is empty", "prompt: text is empty"),
    ("request_id: at most 256 characters", "request_id: at most 256 characters"),
    ("lora_name: not served", "lora_name: not served"),
    ("the temperature: is odd", "the temperature: is odd"),
])
def test_public_message_names_sampling_fields_by_their_path(message, expected):
    assert public_message(message) == expected


@pytest.mark.unit
def test_version_is_the_installed_package():
    assert tessera_version() == importlib.metadata.version("tessera-common")


# -- on the stack ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_info(stack):
    return stack.tokenizer_stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest(), timeout=10)


@pytest.fixture(scope="module")
def engine_info(stack):
    return stack.engine_stub.GetInfo(engine_pb2.EngineInfoRequest(), timeout=10)


def _invalid(call, request) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details()


@pytest.mark.integration
def test_list_models(stack, model_info, engine_info):
    models = stack.frontend_stub.ListModels(frontend_pb2.ListModelsRequest(), timeout=30).models
    base = models[0]
    assert (base.id, base.root, base.parent) == (model_info.model_name, model_info.model_name, "")
    assert base.max_model_len == engine_info.max_model_len > 0
    # the adapters, if the stack serves any, as the LoRA list has them, children of the base model
    adapters = stack.frontend_stub.ListLoRAAdapters(common_pb2.ListLoRAAdaptersRequest(), timeout=30).adapters
    assert [(m.id, m.root, m.parent) for m in models[1:]] == [(a.name, a.path, base.id) for a in adapters]


@pytest.mark.integration
def test_tokenize_text_as_the_tokenizer_does(stack, engine_info):
    reply = stack.frontend_stub.Tokenize(frontend_pb2.FrontendServiceTokenizeRequest(
        text=QUESTION, return_token_strs=True, return_offsets=True), timeout=30)
    expected = stack.tokenizer_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=QUESTION, return_offsets=True),
                                             timeout=30)
    assert list(reply.token_ids) == list(expected.token_ids) and len(reply.token_ids) > 5
    assert list(reply.offsets) == list(expected.offsets) and len(reply.offsets) == 2 * len(reply.token_ids)
    assert reply.text == QUESTION
    assert reply.max_model_len == engine_info.max_model_len
    assert len(reply.token_strs) == len(reply.token_ids)
    assert "France" in "".join(reply.token_strs)


@pytest.mark.integration
def test_tokenize_chat_applies_the_template_as_generate_does(stack):
    chat = _chat(("system", "You are terse."), ("user", QUESTION))
    reply = stack.frontend_stub.Tokenize(frontend_pb2.FrontendServiceTokenizeRequest(chat=chat), timeout=30)
    # the rendered prompt: both turns, in the template's markup, ending with the assistant's header
    assert "You are terse." in reply.text and QUESTION in reply.text
    assert reply.text.index("You are terse.") < reply.text.index(QUESTION)
    without = stack.frontend_stub.Tokenize(frontend_pb2.FrontendServiceTokenizeRequest(
        chat=chat, add_generation_prompt=False), timeout=30)
    assert reply.text.startswith(without.text) and len(reply.text) > len(without.text)
    # the same prompt Generate runs: its usage counts exactly these tokens
    result = stack.frontend_stub.Complete(frontend_pb2.GenerateRequest(
        chat=chat, sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=2)), timeout=120)
    assert result.usage.prompt_tokens == len(reply.token_ids)
    again = stack.frontend_stub.Tokenize(frontend_pb2.FrontendServiceTokenizeRequest(text=reply.text,
                                                                                     add_special_tokens=False),
                                         timeout=30)
    assert list(again.token_ids) == list(reply.token_ids)


@pytest.mark.integration
def test_tokenize_chat_with_tools(stack):
    tools = ('[{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",'
             ' "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]')
    plain = stack.frontend_stub.Tokenize(frontend_pb2.FrontendServiceTokenizeRequest(
        chat=_chat(("user", "Weather in Paris?"))), timeout=30)
    with_tools = stack.frontend_stub.Tokenize(frontend_pb2.FrontendServiceTokenizeRequest(
        chat=_chat(("user", "Weather in Paris?"), tools_json=tools)), timeout=30)
    assert "get_weather" in with_tools.text and "get_weather" not in plain.text
    assert len(with_tools.token_ids) > len(plain.token_ids)


@pytest.mark.integration
def test_tokenize_refusals_name_the_field(stack):
    tokenize = stack.frontend_stub.Tokenize
    assert _invalid(tokenize, frontend_pb2.FrontendServiceTokenizeRequest(text="")).startswith("text: ")
    assert _invalid(tokenize, frontend_pb2.FrontendServiceTokenizeRequest()).startswith("input: ")
    assert _invalid(tokenize, frontend_pb2.FrontendServiceTokenizeRequest(
        chat=_chat(("user", "a"), ("robot", "b")))).startswith("chat.messages[1]: role")
    assert _invalid(tokenize, frontend_pb2.FrontendServiceTokenizeRequest(
        chat=_chat(("user", "a")), add_special_tokens=True)).startswith("add_special_tokens: ")
    # a malformed tools list is the tokenizer's refusal, passed on with its field
    details = _invalid(tokenize, frontend_pb2.FrontendServiceTokenizeRequest(
        chat=_chat(("user", "a"), tools_json="{not json")))
    assert "tools" in details.split(":", 1)[0], details


@pytest.mark.integration
def test_detokenize_round_trips_tokenize(stack, model_info):
    text = "The capital of France is Paris."
    ids = stack.frontend_stub.Tokenize(frontend_pb2.FrontendServiceTokenizeRequest(
        text=text, add_special_tokens=False), timeout=30).token_ids
    reply = stack.frontend_stub.Detokenize(frontend_pb2.FrontendServiceDetokenizeRequest(token_ids=ids), timeout=30)
    assert reply.text == text
    # special tokens: kept unless skipped
    eos = model_info.eos_token_ids[0]
    kept = stack.frontend_stub.Detokenize(frontend_pb2.FrontendServiceDetokenizeRequest(
        token_ids=[*ids, eos]), timeout=30).text
    skipped = stack.frontend_stub.Detokenize(frontend_pb2.FrontendServiceDetokenizeRequest(
        token_ids=[*ids, eos], skip_special_tokens=True), timeout=30).text
    assert skipped == text and kept.startswith(text) and len(kept) > len(text)


@pytest.mark.integration
def test_detokenize_refuses_an_id_outside_the_vocabulary(stack, model_info):
    details = _invalid(stack.frontend_stub.Detokenize,
                       frontend_pb2.FrontendServiceDetokenizeRequest(token_ids=[1, model_info.vocab_size, 2]))
    assert details.startswith("token_ids[1]: ") and str(model_info.vocab_size) in details
    assert _invalid(stack.frontend_stub.Detokenize,
                    frontend_pb2.FrontendServiceDetokenizeRequest(token_ids=[-1])).startswith("token_ids[0]: ")


@pytest.mark.integration
def test_server_info(stack, model_info, engine_info):
    info = stack.frontend_stub.GetServerInfo(frontend_pb2.GetServerInfoRequest(), timeout=30)
    assert info.version == importlib.metadata.version("tessera-common")
    assert info.model == model_info.model_name
    assert info.max_model_len == engine_info.max_model_len
    assert info.vocab_size == model_info.vocab_size
    assert list(info.eos_token_ids) == list(model_info.eos_token_ids)
    assert info.has_chat_template == model_info.has_chat_template
    assert info.kv_cache_tokens == engine_info.num_blocks * engine_info.block_size > 0
    # the stack's frontend runs with the defaults (server.py's flags, validation.Limits)
    assert (info.max_inflight_requests, info.max_n, info.max_logprobs, info.max_stop) == (256, 16, 20, 16)
    assert (info.max_stop_chars, info.max_stop_token_ids, info.max_logit_bias, info.max_request_id_chars) == (
        1024, 1024, 1024, 256)
    assert info.allow_runtime_lora_updating is False


@pytest.mark.integration
def test_server_info_limits_are_the_ones_enforced(stack):
    """A request just past a limit GetServerInfo states is refused naming that field."""
    info = stack.frontend_stub.GetServerInfo(frontend_pb2.GetServerInfoRequest(), timeout=30)

    def refused(**params) -> str:
        return _invalid(stack.frontend_stub.Complete, frontend_pb2.GenerateRequest(
            text=QUESTION, sampling_params=common_pb2.SamplingParams(**params)))

    assert refused(n=info.max_n + 1).startswith("sampling_params.n: ")
    assert refused(logprobs=info.max_logprobs + 1).startswith("sampling_params.logprobs: ")
    assert refused(stop=["x"] * (info.max_stop + 1)).startswith("sampling_params.stop: ")
    assert refused(max_tokens=info.max_model_len).startswith("sampling_params.max_tokens: ")
    assert refused(temperature=-1.0).startswith("sampling_params.temperature: ")


@pytest.mark.integration
def test_reflection_describes_the_new_calls(stack):
    """A client with only the server (grpcurl) finds the calls and their messages by reflection."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(stack.frontend_channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="tessera.v1.FrontendService")]), timeout=10)
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for reply in replies for raw in reply.file_descriptor_response.file_descriptor_proto]
    frontend = next(f for f in files if f.name == "tessera/v1/frontend.proto")
    methods = {m.name: (m.input_type, m.output_type) for m in frontend.service[0].method}
    assert methods["ListModels"] == (".tessera.v1.ListModelsRequest", ".tessera.v1.ListModelsResponse")
    assert methods["Tokenize"] == (".tessera.v1.FrontendServiceTokenizeRequest",
                                   ".tessera.v1.FrontendServiceTokenizeResponse")
    assert methods["Detokenize"] == (".tessera.v1.FrontendServiceDetokenizeRequest",
                                     ".tessera.v1.FrontendServiceDetokenizeResponse")
    assert methods["GetServerInfo"] == (".tessera.v1.GetServerInfoRequest", ".tessera.v1.GetServerInfoResponse")


@pytest.mark.integration
def test_unavailable_without_a_tokenizer(stack, tmp_path):
    """A frontend whose tokenizer is not there: every call that needs it answers UNAVAILABLE."""
    frontend = frontend_service("frontend-no-tokenizer", f"127.0.0.1:{free_port()}", stack.engine.addr,
                                tmp_path, "--http-port", "0")
    frontend.start()
    try:
        with grpc.insecure_channel(frontend.addr, options=CHANNEL_OPTIONS) as channel:
            grpc.channel_ready_future(channel).result(timeout=STARTUP_TIMEOUT_S)
            stub = frontend_pb2_grpc.FrontendServiceStub(channel)
            for call, request in [
                    (stub.Tokenize, frontend_pb2.FrontendServiceTokenizeRequest(text="hi")),
                    (stub.Detokenize, frontend_pb2.FrontendServiceDetokenizeRequest(token_ids=[1])),
                    (stub.ListModels, frontend_pb2.ListModelsRequest()),
                    (stub.GetServerInfo, frontend_pb2.GetServerInfoRequest())]:
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as info:
                    call(request, timeout=60)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
                assert "not ready" in info.value.details()
                assert time.monotonic() - started < 30
    finally:
        frontend.stop()
