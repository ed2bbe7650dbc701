"""tessera.client.types and results: wire messages to typed results, tool calls parsed (unit)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tessera.client import Completion, Delta, ToolCall
from tessera.client.results import DeltaAssembler, completion_with_tools
from tessera.client.tool_calls import parse_reply, tool_choice_of
from tessera.v1 import common_pb2, frontend_pb2

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _logprobs(token_id):
    return common_pb2.PositionLogprobs(chosen=common_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, rank=1, token="a"),
                                       top=[common_pb2.TokenLogprob(token_id=9, logprob=-1.0, rank=2, token="b")])


def test_a_delta_is_typed():
    message = frontend_pb2.GenerateResponse(request_id="r", index=1, text="Hi", token_ids=[5], logprobs=[_logprobs(5)],
                                            finish_reason=common_pb2.FINISH_REASON_STOP, stop_reason="\n",
                                            usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=4))
    d = DeltaAssembler(None).delta(message)
    assert isinstance(d, Delta) and dataclasses.is_dataclass(d)
    assert (d.request_id, d.index, d.text, d.token_ids, d.finish_reason, d.stop_reason) == ("r", 1, "Hi", (5,), "stop", "\n")
    assert d.finished and d.stop_token_id is None and d.usage.total_tokens == 7
    assert d.logprobs[0].chosen.token_id == 5 and d.logprobs[0].top[0].rank == 2
    running = DeltaAssembler(None).delta(frontend_pb2.GenerateResponse(text="x"))
    assert running.finish_reason is None and running.usage is None and not running.finished


def test_a_completion_is_typed():
    result = frontend_pb2.GenerateResult(request_id="r", choices=[
        frontend_pb2.Choice(index=0, text="Paris", token_ids=[1, 2], finish_reason=common_pb2.FINISH_REASON_LENGTH),
        frontend_pb2.Choice(index=1, text="Lyon", finish_reason=common_pb2.FINISH_REASON_STOP, stop_token_id=2)],
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=4, cached_prompt_tokens=1))
    c = completion_with_tools(result, None)
    assert isinstance(c, Completion) and c.text == "Paris" and c.usage.cached_prompt_tokens == 1
    assert [ch.finish_reason for ch in c.choices] == ["length", "stop"] and c.choices[1].stop_token_id == 2
    assert c.choices[0].content == "Paris" and c.choices[0].tool_calls == ()


def test_tool_calls_of_a_whole_answer():
    reply = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    result = frontend_pb2.GenerateResult(choices=[frontend_pb2.Choice(text=reply)])
    choice = completion_with_tools(result, tool_choice_of(TOOLS)).choices[0]
    assert choice.text == reply and choice.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in choice.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert isinstance(choice.tool_calls[0], ToolCall) and choice.tool_calls[0].id.startswith("call_")


def test_tool_calls_of_a_stream_come_on_the_choices_last_delta():
    assembler = DeltaAssembler(tool_choice_of(TOOLS))
    pieces = ['<tool_call>{"name": "get_', 'weather", "arguments": {}}', "</tool_call>"]
    deltas = [assembler.delta(frontend_pb2.GenerateResponse(text=t)) for t in pieces[:-1]]
    deltas.append(assembler.delta(frontend_pb2.GenerateResponse(text=pieces[-1], finish_reason=common_pb2.FINISH_REASON_STOP)))
    assert all(d.tool_calls == () for d in deltas[:-1])
    assert [c.name for c in deltas[-1].tool_calls] == ["get_weather"] and deltas[-1].content is None


def test_parsing_modes():
    required = tool_choice_of(TOOLS, "required")
    content, calls = parse_reply(required, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert content is None and json.loads(calls[0].arguments) == {"city": "Oslo"}
    named = tool_choice_of(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert parse_reply(named, '{"city": "Rome"}')[1][0].arguments == '{"city": "Rome"}'
    assert parse_reply(tool_choice_of(TOOLS), "no calls here") == ("no calls here", [])
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        tool_choice_of([{"type": "function"}])
