"""tessera.client.requests: keyword arguments to a GenerateRequest (unit)."""
from __future__ import annotations

import json

import pytest

from tessera.client.requests import build_request, structured_output

pytestmark = pytest.mark.unit


def test_text_token_ids_and_chat_prompts():
    request, tools = build_request(prompt="Hello")
    assert request.WhichOneof("prompt") == "text" and request.text == "Hello" and tools is None
    request, _ = build_request(prompt=[1, 2, 3])
    assert list(request.token_ids.ids) == [1, 2, 3]
    request, _ = build_request(messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi"}])
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "Be brief."), ("user", "Hi")]


def test_exactly_one_prompt():
    with pytest.raises(ValueError, match="exactly one of prompt"):
        build_request()
    with pytest.raises(ValueError, match="exactly one of prompt"):
        build_request(prompt="a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(TypeError, match="prompt"):
        build_request(prompt=[1, "x"])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        build_request(messages=["hi"])


def test_every_sampling_field():
    request, _ = build_request(
        prompt="x", temperature=0.5, top_k=5, top_p=0.9, min_p=0.1, seed=7, repetition_penalty=1.1,
        presence_penalty=0.2, frequency_penalty=0.3, stop=["\n", "END"], stop_token_ids=[2], max_tokens=9,
        min_tokens=1, ignore_eos=True, n=2, logprobs=3, prompt_logprobs=1, skip_special_tokens=False,
        include_stop_str_in_output=True, logit_bias={5: -100.0}, priority=3, lora_name="a", request_id="rid")
    p = request.sampling_params
    assert (p.temperature, p.top_k, p.seed, p.max_tokens, p.n, p.logprobs, p.prompt_logprobs) == (0.5, 5, 7, 9, 2, 3, 1)
    assert list(p.stop) == ["\n", "END"] and list(p.stop_token_ids) == [2] and dict(p.logit_bias) == {5: -100.0}
    assert p.ignore_eos and p.include_stop_str_in_output and p.HasField("skip_special_tokens") and not p.skip_special_tokens
    assert (request.priority, request.lora_name, request.request_id) == (3, "a", "rid")
    # unset fields stay unset (the server's defaults), 0 stays a value
    request, _ = build_request(prompt="x", temperature=0.0, stop="END")
    assert request.sampling_params.HasField("temperature") and not request.sampling_params.HasField("max_tokens")
    assert list(request.sampling_params.stop) == ["END"]
    with pytest.raises(TypeError, match="max_token"):
        build_request(prompt="x", max_token=3)


def test_response_formats():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(structured_output({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
                      .json_schema) == schema
    assert structured_output({"type": "json_object"}).json_object
    assert structured_output({"type": "text"}) is None
    assert structured_output({"type": "regex", "regex": "[0-9]+"}).regex == "[0-9]+"
    assert structured_output({"type": "grammar", "grammar": "root ::= \"a\""}).grammar
    assert list(structured_output({"type": "choice", "choice": ["yes", "no"]}).choice.choices) == ["yes", "no"]
    with pytest.raises(ValueError, match="response_format.type"):
        structured_output({"type": "xml"})
    with pytest.raises(ValueError, match="json_schema.schema"):
        structured_output({"type": "json_schema", "json_schema": {"name": "x"}})


TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tools_go_with_the_chat_and_choose_the_parser():
    request, choice = build_request(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    assert json.loads(request.chat.tools_json) == TOOLS and choice.mode == "auto"
    assert not request.sampling_params.HasField("structured_output")
    request, choice = build_request(messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required")
    assert choice.mode == "required" and json.loads(request.sampling_params.structured_output.json_schema)["type"] == "array"
    request, choice = build_request(messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert choice.mode == "named" and "city" in request.sampling_params.structured_output.json_schema
    request, choice = build_request(messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none")
    assert choice is None and not request.chat.tools_json
    with pytest.raises(ValueError, match="tools: only with messages"):
        build_request(prompt="x", tools=TOOLS)
    with pytest.raises(ValueError, match="tool_choice.function.name"):
        build_request(messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                      tool_choice={"type": "function", "function": {"name": "other"}})


def test_an_assistant_turns_tool_calls_and_a_tool_result():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
    request, _ = build_request(messages=[{"role": "user", "content": "Weather?"},
                                         {"role": "assistant", "content": None, "tool_calls": calls},
                                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=TOOLS)
    assistant, tool = request.chat.messages[1], request.chat.messages[2]
    assert json.loads(assistant.tool_calls_json) == calls and assistant.content == ""
    assert tool.tool_call_id == "call_1" and tool.content == "sunny"
