"""OpenAI tool calling on /v1/chat/completions, through the real stack and the real default model,
with the `openai` package as the client: tool_choice required / named (the output is held to the
tools' schemas, so the calls parse and validate), auto (a plain answer or a well-formed call),
none, a follow-up conversation with the assistant's tool calls and the tool's answer, and the
400s for bad tools / tool_choice. Greedy (temperature 0) where exact behaviour is asserted.
"""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from helpers.stack import client, model, stack  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 40},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = dict(temperature=0.0, max_tokens=120)



def check_calls(tool_calls, names=SCHEMAS) -> list[tuple[str, dict]]:
    """Each call well formed and its arguments valid against its tool's schema; (name, arguments)."""
    assert tool_calls, "no tool calls"
    out = []
    for call in tool_calls:
        assert CALL_ID.match(call.id) and call.type == "function", call
        assert call.function.name in names, call
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed(client, **request) -> tuple[str | None, list[dict], str, int]:
    """A streamed answer put together: (content or None, tool calls as dicts, finish_reason,
    content deltas)."""
    content, calls, finish, content_deltas = [], {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **request):
        (choice,) = chunk.choices
        delta = choice.delta
        if delta.content:
            content.append(delta.content)
            content_deltas += 1
        for entry in delta.tool_calls or []:
            # sent whole: one entry carries a call's id, name and all its arguments
            assert entry.index not in calls and entry.id and entry.function.name
            calls[entry.index] = entry
        if choice.finish_reason is not None:
            finish = choice.finish_reason
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish, content_deltas


# -- tool_choice required / named -------------------------------------------------------------------------
def test_required_calls_a_tool_with_valid_arguments(client, model):
    response = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                              **GREEDY)
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.role == "assistant" and choice.message.content is None
    calls = check_calls(choice.message.tool_calls)

    content, stream_calls, finish, _ = streamed(client, model=model, messages=QUESTION, tools=TOOLS,
                                                tool_choice="required", **GREEDY)
    assert finish == "tool_calls" and content is None
    assert check_calls(stream_calls) == calls  # greedy: the same calls (new ids)


def test_named_tool_choice_gives_that_functions_arguments(client, model):
    choice_param = {"type": "function", "function": {"name": "get_time"}}
    response = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice=choice_param,
                                              **GREEDY)
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    ((name, arguments),) = check_calls(choice.message.tool_calls)
    assert name == "get_time"

    content, stream_calls, finish, _ = streamed(client, model=model, messages=QUESTION, tools=TOOLS,
                                                tool_choice=choice_param, **GREEDY)
    assert finish == "tool_calls" and content is None
    assert check_calls(stream_calls) == [(name, arguments)]


# -- auto and none -------------------------------------------------------------------------------------------
def test_auto_answers_or_calls(client, model):
    request = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice="auto", **GREEDY)
    (choice,) = client.chat.completions.create(**request).choices
    content, stream_calls, finish, content_deltas = streamed(client, **request)
    if choice.message.tool_calls:
        check_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls" and finish == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in stream_calls] \
            == [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    else:
        assert isinstance(choice.message.content, str) and choice.message.content
        assert choice.finish_reason in ("stop", "length") and finish == choice.finish_reason
        assert not stream_calls and content == choice.message.content
        if not content.lstrip().startswith(("{", "[", "<")):
            assert content_deltas > 1  # a plain answer streams as it comes, not held back to the end


def test_auto_plain_answer_streams(client, model):
    # A question no tool fits, answered in text: it streams in pieces and matches the whole answer.
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    request = dict(model=model, messages=messages, tools=TOOLS, temperature=0.0, max_tokens=24)
    (choice,) = client.chat.completions.create(**request).choices
    content, stream_calls, finish, content_deltas = streamed(client, **request)
    if choice.message.tool_calls:  # the model may still call: then it must be well formed
        check_calls(choice.message.tool_calls)
        return
    assert content == choice.message.content and finish == choice.finish_reason and not stream_calls
    if not content.lstrip().startswith(("{", "[", "<")):
        assert content_deltas > 1


def test_tools_are_rendered_unless_tool_choice_is_none(client, model):
    def prompt_tokens(**fields) -> int:
        return client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1, temperature=0.0,
                                              **fields).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    assert prompt_tokens(tools=TOOLS) > plain + 50  # the tools' system prompt
    (choice,) = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                               max_tokens=8, temperature=0.0).choices
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")


# -- a follow-up conversation ------------------------------------------------------------------------------------
def test_follow_up_with_tool_result(client, model):
    first = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           **GREEDY).choices[0].message
    check_calls(first.tool_calls)
    answers = [{"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}
               for call in first.tool_calls]
    # the assistant turn as OpenAI gives it: content null, and the tool calls
    turn = {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in first.tool_calls]}
    messages = [*QUESTION, turn, *answers]
    response = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0.0,
                                              max_tokens=40)
    (choice,) = response.choices
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    if choice.message.tool_calls:
        check_calls(choice.message.tool_calls)

    # the call and its result are in the prompt: without them it is shorter
    without = client.chat.completions.create(model=model, messages=[*QUESTION, {"role": "assistant", "content": ""},
                                                                    {"role": "tool", "content": ""}],
                                             tools=TOOLS, temperature=0.0, max_tokens=1)
    assert response.usage.prompt_tokens > without.usage.prompt_tokens + 10


# -- errors -----------------------------------------------------------------------------------------------------
TOOL_ERRORS = [
    ("tools[0].type", dict(tools=[{"type": "code_interpreter", "function": {"name": "f"}}])),
    ("tools[1].function.name", dict(tools=[TOOLS[0], {"type": "function", "function": {"name": ""}}])),
    ("tools[1].function.name", dict(tools=[TOOLS[0], TOOLS[0]])),
    ("tools[0].function.parameters", dict(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/Nowhere"}}}}}])),
    ("tools[0].function.parameters", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": 3}}])),
    ("tool_choice", dict(tool_choice="required")),
    ("tool_choice", dict(tools=TOOLS, tool_choice="always")),
    ("tool_choice.function.name", dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}})),
    ("tool_choice", dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})),
    ("tool_choice", dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                         extra_body={"guided_regex": "[a-z]+"})),
    ("messages[1].tool_calls[0].function.name", dict(messages=[*QUESTION, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"arguments": "{}"}}]}])),
]


@pytest.mark.parametrize("param,kwargs", TOOL_ERRORS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(TOOL_ERRORS)])
def test_bad_tools_are_400_naming_the_param(client, model, param, kwargs):
    request = dict(model=model, messages=QUESTION, max_tokens=4)
    request.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    error = info.value.body
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"].startswith(param), error
