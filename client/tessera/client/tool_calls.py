"""Tool calling, pure logic shared by the client and (may be) the frontend's HTTP API: the tools and
tool_choice of a request, the output constraint each mode asks for, and the parsing of the model's
reply into tool calls. (Moved here from tessera_frontend.tool_calls, which may import it: the same
parsers, so a gRPC client and the HTTP API read a reply alike.)

Modes (`ToolChoice.mode`):
  none      the tools are not shown to the model and the reply is plain content.
  auto      no constraint; calls are Hermes-style blocks, <tool_call>{"name", "arguments"}</tool_call>
            (what the tokenizer's fallback tools prompt asks for, and what Hermes / Qwen templates
            teach), or a reply that is entirely a JSON object or array of such calls.
  required  the reply is constrained to a JSON array (at least one item) of {"name", "arguments"}.
  named     the reply is constrained to that function's arguments object.

Parsers are incremental: `feed()` the text as it streams and `finish()` at the end; each returns
events, in order: content text (str) or a whole `ToolCall`. `parse_reply` runs the same parser over
a whole text, so a streamed and a whole answer agree. `tool_choice_of` reads OpenAI's tools list
and tool_choice value into a `ToolChoice`.
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Sequence, Union

MODES = ("none", "auto", "required", "named")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_DEFS_KEYS = ("$defs", "definitions")  # where JSON schemas keep the subschemas "$ref" points at


class ToolSchemaError(ValueError):
    """The tools' schemas cannot be combined into one (two define the same $defs name differently)."""


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict | None = None  # JSON schema of the arguments; None: any object


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """A request's validated tools and what its tool_choice asks of the reply."""
    mode: str                       # one of MODES
    tools: tuple[Tool, ...]
    name: str | None = None         # the function a named tool_choice names

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)

    def constraint_schema(self) -> dict | None:
        """The JSON schema the reply is held to: required and named only."""
        if self.mode == "required":
            return required_schema(self.tools)
        if self.mode == "named":
            return arguments_schema(self.tool(self.name))
        return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's shape)
    id: str = dataclasses.field(default_factory=new_call_id)

    def as_json(self) -> dict:
        """The call as OpenAI writes it in a message's tool_calls."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def as_delta(self, index: int) -> dict:
        """The call as one entry of a stream chunk's delta.tool_calls (sent whole, see ChatFormatter)."""
        return {"index": index, **self.as_json()}


Event = Union[str, ToolCall]


# -- the constraint ---------------------------------------------------------------------------
def arguments_schema(tool: Tool) -> dict:
    """What a call's arguments must be: the tool's parameters schema, or any object."""
    return tool.parameters or {"type": "object"}


def required_schema(tools: tuple[Tool, ...] | list[Tool]) -> dict:
    """A JSON array of one or more calls, each {"name": one of the tools, "arguments": that tool's
    parameters}. The tools' $defs move to the top (a "$ref" is resolved from the root schema)."""
    defs: dict[str, dict] = {key: {} for key in _DEFS_KEYS}
    items = []
    for tool in tools:
        params = dict(arguments_schema(tool))
        for key in _DEFS_KEYS:
            for name, sub in (params.pop(key, None) or {}).items():
                if name in defs[key] and defs[key][name] != sub:
                    raise ToolSchemaError(f"two tools define {key}/{name} differently (tool {tool.name!r})")
                defs[key][name] = sub
        items.append({"type": "object",
                      "properties": {"name": {"const": tool.name}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    schema.update({key: value for key, value in defs.items() if value})
    return schema


# -- parsing ----------------------------------------------------------------------------------
def as_call(obj: Any, names: frozenset[str]) -> ToolCall | None:
    """`obj` as a call when it is {"name": a known tool, "arguments": an object} (Llama-style
    "parameters" is taken too, and arguments given as JSON text of an object); else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def as_calls(value: Any, names: frozenset[str]) -> list[ToolCall] | None:
    """A JSON value that is one call or a non-empty array of calls, as calls; else None."""
    items = value if isinstance(value, list) else [value]
    calls = [as_call(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls


class ToolCallParser:
    """Splits one choice's reply into content and tool calls as it streams."""

    def __init__(self) -> None:
        self.buf = ""
        self.calls = 0  # calls found so far

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Event]:
        raise NotImplementedError

    def _call(self, call: ToolCall, events: list[Event]) -> None:
        self.calls += 1
        events.append(call)


class NamedParser(ToolCallParser):
    """The whole reply is the named function's arguments (held to its schema): one call at the end."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _advance(self, final: bool) -> list[Event]:
        events: list[Event] = []
        if final:
            self._call(ToolCall(self.name, self.buf.strip()), events)
        return events


class RequiredParser(ToolCallParser):
    """A JSON array of calls: each call is sent as soon as its object is complete. Text that does
    not fit (an array cut short by max_tokens, or a reply with no constraint on it) is content."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__()
        self.names = names
        self.pos = 0            # parsed up to here
        self.sent_to = 0        # the text up to here went out as calls
        self.state = "open"     # open ('[' next), item, after (',' or ']'), closed, failed

    def _advance(self, final: bool) -> list[Event]:
        events: list[Event] = []
        buf = self.buf
        decoder = json.JSONDecoder()
        while self.state != "failed":
            while self.pos < len(buf) and buf[self.pos].isspace():
                self.pos += 1
            if self.pos == len(buf):
                break
            c = buf[self.pos]
            if self.state == "open" and c == "[":
                self.pos, self.state = self.pos + 1, "item"
            elif self.state in ("item", "after") and c == "]":
                self.pos, self.state = self.pos + 1, "closed"
                if self.calls:
                    self.sent_to = self.pos
            elif self.state == "after" and c == ",":
                self.pos, self.state = self.pos + 1, "item"
            elif self.state == "item":
                try:
                    obj, end = decoder.raw_decode(buf, self.pos)
                except ValueError:
                    if final:
                        self.state = "failed"
                    break  # an object still streaming (or broken: told at the end)
                call = as_call(obj, self.names)
                if call is None:
                    self.state = "failed"
                    break
                self._call(call, events)
                self.pos = self.sent_to = end
                self.state = "after"
            else:
                self.state = "failed"
        if self.state == "failed" or (final and (self.state != "closed" or not self.calls)):
            self.state = "failed"
            if self.sent_to < len(buf):
                events.append(buf[self.sent_to:])
                self.sent_to = self.pos = len(buf)
        return events


class AutoParser(ToolCallParser):
    """The model's free reply: content, with <tool_call>{...}</tool_call> blocks that name a known
    tool taken out as calls, or, when the reply is entirely a JSON call or array of calls, those.

    Held back while streaming, only as long as it could still be (the start of) a call: a partial
    "<tool_call>" at the end, an open block, a reply that so far is one unfinished JSON value, and
    whitespace (sent with the next content; dropped at the end once calls were made, so that the
    content is the text outside the calls)."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__()
        self.names = names
        self.pos = 0
        self.state = "start"  # start (only whitespace so far), json, text, block
        self.ws = ""          # trailing whitespace of the content, not sent yet

    def _content(self, text: str, events: list[Event]) -> None:
        text = self.ws + text
        body = text.rstrip()
        self.ws = text[len(body):]
        if body:
            events.append(body)

    def _advance(self, final: bool) -> list[Event]:
        events: list[Event] = []
        buf = self.buf
        while True:
            if self.state == "start":
                stripped = buf.lstrip()
                if not stripped and not final:
                    break
                self.state = "json" if _may_be_call_json(stripped) else "text"
            elif self.state == "json":
                if not self._json(final, events):
                    break
            elif self.state == "text":
                i = buf.find(OPEN, self.pos)
                if i >= 0:
                    self._content(buf[self.pos:i], events)
                    self.pos, self.state = i + len(OPEN), "block"
                    continue
                keep = 0 if final else _partial_suffix(buf, self.pos, OPEN)
                self._content(buf[self.pos:len(buf) - keep], events)
                self.pos = len(buf) - keep
                break
            else:  # block: inside <tool_call>
                j = buf.find(CLOSE, self.pos)
                if j < 0 and not final:
                    break
                inner = buf[self.pos:] if j < 0 else buf[self.pos:j]
                end = len(buf) if j < 0 else j + len(CLOSE)
                calls = _calls_in(inner, self.names)
                if calls is None:  # not a call after all: the block is content as written
                    self._content(buf[self.pos - len(OPEN):end], events)
                else:
                    for call in calls:
                        self._call(call, events)
                self.pos, self.state = end, "text"
        if final and not self.calls and self.ws:
            events.append(self.ws)
            self.ws = ""
        return events

    def _json(self, final: bool, events: list[Event]) -> bool:
        """The reply so far is one JSON value (from its first non-space character): calls once it
        is complete and nothing follows; otherwise text from the start. False: wait for more."""
        buf = self.buf
        start = len(buf) - len(buf.lstrip())
        try:
            value, end = json.JSONDecoder().raw_decode(buf, start)
        except ValueError:
            if not final and _may_be_call_json(buf[start:]):
                return False  # unfinished
            self.state = "text"
            return True
        calls = as_calls(value, self.names)
        if calls is None or buf[end:].strip():
            self.state = "text"  # JSON that is no call, or more than the value: content
            return True
        if not final:
            return False  # complete, but more could follow
        for call in calls:
            self._call(call, events)
        self.pos, self.state = len(buf), "text"
        return True


def _may_be_call_json(text: str) -> bool:
    """Whether `text` (no leading space) could still become a JSON call or an array of calls:
    it is a beginning of `{"` or `[{"` (a call object's first thing is a key)."""
    head = "".join(text[:64].split())  # whitespace between the first tokens does not matter
    if head.startswith("["):
        head = head[1:]
        if not head:
            return True
    return head == "{" or head.startswith('{"')


def _calls_in(inner: str, names: frozenset[str]) -> list[ToolCall] | None:
    try:
        return as_calls(json.loads(inner), names)
    except ValueError:
        return None


def _partial_suffix(buf: str, start: int, tag: str) -> int:
    """The length of the longest end of buf[start:] that begins `tag` (a tag that may be arriving)."""
    for k in range(min(len(tag) - 1, len(buf) - start), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


def make_parser(choice: ToolChoice) -> ToolCallParser | None:
    """The parser for a choice's reply; None when tool_choice is none (the reply is plain content)."""
    if choice.mode == "named":
        return NamedParser(choice.name)
    if choice.mode == "required":
        return RequiredParser(choice.names)
    if choice.mode == "auto":
        return AutoParser(choice.names)
    return None


def parse_reply(choice: ToolChoice, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply as (content, calls); content is None when there are calls and no other text."""
    parser = make_parser(choice)
    if parser is None:
        return text, []
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, ToolCall)]
    return (content or None) if calls else content, calls


def tool_choice_of(tools: Sequence[dict], tool_choice: str | dict | None = None) -> ToolChoice:
    """OpenAI's `tools` list and `tool_choice` ("auto" (default), "none", "required" or
    {"type": "function", "function": {"name": ...}}) as a ToolChoice; ValueError naming the field."""
    parsed = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name: must be a non-empty string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
        parsed.append(Tool(name, parameters))
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        mode = tool_choice or "auto"
        if mode == "required" and not parsed:
            raise ValueError("tool_choice: 'required' needs tools")
        return ToolChoice(mode, tuple(parsed))
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name is None:
        raise ValueError("tool_choice: must be 'auto', 'none', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    if name not in {t.name for t in parsed}:
        raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools")
    return ToolChoice("named", tuple(parsed), name)
