"""Wire messages to typed results, with tool calls: a stream's deltas (`DeltaAssembler`, which
keeps each choice's text to parse its calls when it finishes) and Complete's answer
(`completion_with_tools`). Without tools these are types.delta / types.completion as they are."""
from __future__ import annotations

import dataclasses

from tessera.client import types
from tessera.client.tool_calls import ToolChoice, parse_reply
from tessera.v1 import frontend_pb2


class DeltaAssembler:
    def __init__(self, tool_choice: ToolChoice | None) -> None:
        self.tool_choice = tool_choice
        self.texts: dict[int, list[str]] = {}

    def delta(self, message: frontend_pb2.GenerateResponse) -> types.Delta:
        d = types.delta(message)
        if self.tool_choice is None:
            return d
        self.texts.setdefault(d.index, []).append(d.text)
        if not d.finished:
            return d
        content, calls = parse_reply(self.tool_choice, "".join(self.texts.pop(d.index)))
        return dataclasses.replace(d, tool_calls=tuple(calls), content=content)


def completion_with_tools(result: frontend_pb2.GenerateResult, tool_choice: ToolChoice | None) -> types.Completion:
    c = types.completion(result)
    if tool_choice is None:
        return c
    choices = []
    for choice in c.choices:
        content, calls = parse_reply(tool_choice, choice.text)
        choices.append(dataclasses.replace(choice, tool_calls=tuple(calls), content=content))
    return dataclasses.replace(c, choices=tuple(choices))
