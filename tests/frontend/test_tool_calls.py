"""OpenAI tool calling in-process: tool_calls' parsers and schemas, openai_protocol's checks of
tools / tool_choice and tool-call messages, the chat formatter's tool_calls shapes (whole and
streamed), and the tokenizer's rendering of tools and tool calls into the chat template.
The stack tests (test_openai_tools.py) check the same through the real model and the openai client.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tessera.v1 import common_pb2, tokenizer_pb2
from tessera_frontend.openai_formatters import ChatFormatter, IndexedOutput
from tessera_frontend.openai_protocol import (ApiError, ChatCompletionRequest, chat_messages, chat_tools,
                                              sampling_params)
from tessera_frontend.output_processor import SampleOutput
from tessera_frontend.tool_calls import (AutoParser, Tool, ToolCall, ToolChoice, ToolSchemaError, make_parser,
                                         parse_reply, required_schema)
from tessera_frontend.validation import Limits

pytestmark = pytest.mark.unit

RUNNING = common_pb2.FINISH_REASON_UNSPECIFIED
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = (Tool("get_weather", WEATHER), Tool("get_time"))
AUTO = ToolChoice("auto", TOOLS)
REQUIRED = ToolChoice("required", TOOLS)
NAMED = ToolChoice("named", TOOLS, "get_weather")
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                  "parameters": WEATHER}},
                {"type": "function", "function": {"name": "get_time"}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def calls_of(result: tuple[str | None, list[ToolCall]]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in result[1]]


def streamed(choice: ToolChoice, text: str, step: int = 1) -> list:
    """The parser's events for `text` fed `step` characters at a time; calls as (name, arguments)."""
    parser = make_parser(choice)
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.finish()
    return events


def joined(events: list) -> tuple[str, list[tuple[str, dict]]]:
    return ("".join(e for e in events if isinstance(e, str)),
            [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)])


# -- auto ---------------------------------------------------------------------------------------------
AUTO_CASES = [
    # (reply, content, calls)
    ("The weather is sunny.", "The weather is sunny.", []),
    ("  spaced out \n", "  spaced out \n", []),
    ("", "", []),
    (f"<tool_call>\n{call('get_weather', city='Paris')}\n</tool_call>", None, [("get_weather", {"city": "Paris"})]),
    (f"Let me check. <tool_call>{call('get_weather', city='Paris')}</tool_call>\n",
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>{call('get_weather', city='A')}</tool_call>\n<tool_call>{call('get_time')}</tool_call>",
     None, [("get_weather", {"city": "A"}), ("get_time", {})]),
    (f"<tool_call>{call('get_weather', city='Paris')}", None, [("get_weather", {"city": "Paris"})]),  # unclosed
    (f"<tool_call>[{call('get_time')}, {call('get_time')}]</tool_call>", None, [("get_time", {}), ("get_time", {})]),
    # not calls: an unknown tool, no arguments, not JSON -- the block stays content as written
    (f"<tool_call>{call('launch')}</tool_call>", f"<tool_call>{call('launch')}</tool_call>", []),
    ('<tool_call>{"name": "get_time"}</tool_call>', '<tool_call>{"name": "get_time"}</tool_call>', []),
    ("<tool_call>oops</tool_call> then", "<tool_call>oops</tool_call> then", []),
    ("a <tool_cal b", "a <tool_cal b", []),
    ("x < y and <tool", "x < y and <tool", []),
    # a reply that is entirely JSON calls (a model that skips the tags)
    (call("get_weather", city="Rome"), None, [("get_weather", {"city": "Rome"})]),
    (' [{"name": "get_time", "parameters": {}}, ' + call("get_weather", city="Oslo") + "]\n",
     None, [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    ('{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}', None, [("get_time", {"tz": "UTC"})]),
    # JSON that is not (only) calls is content
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    (call("get_time") + " and more", call("get_time") + " and more", []),
    ("[1, 2] are numbers", "[1, 2] are numbers", []),
    ("{Paris}", "{Paris}", []),
    ('{"name": "get_time", "arguments": {}', '{"name": "get_time", "arguments": {}', []),  # cut short
]


@pytest.mark.parametrize("reply,content,calls", AUTO_CASES)
def test_auto_parse(reply, content, calls):
    result = parse_reply(AUTO, reply)
    assert result[0] == content and calls_of(result) == calls
    for c in result[1]:
        assert CALL_ID.match(c.id)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("reply,content,calls", AUTO_CASES)
def test_auto_streamed_agrees_with_whole(reply, content, calls, step):
    assert joined(streamed(AUTO, reply, step)) == ((content or ""), calls)


def test_auto_streams_plain_text_as_it_comes():
    parser = AutoParser(AUTO.names)
    assert parser.feed("The") == ["The"]
    assert parser.feed(" weather") == [" weather"]
    assert parser.feed(" is ") == [" is"]          # trailing space waits for what follows
    assert parser.feed("<tool") == []              # may be a call: held
    assert parser.feed("s> here") == [" <tools> here"]
    assert parser.finish() == []


def test_auto_holds_back_only_what_may_be_a_call():
    parser = AutoParser(AUTO.names)
    assert parser.feed("{") == [] and parser.feed('"na') == []   # could be a JSON call
    assert parser.feed('me": "get_time", "arguments": {}}') == []  # a call, but more may follow ...
    assert parser.feed(" ok") == [call("get_time") + " ok"]      # ... and did: content from the start
    parser = AutoParser(AUTO.names)
    assert parser.feed('{"name": 1}') == ['{"name": 1}']         # complete and no call: content at once
    parser = AutoParser(AUTO.names)
    assert parser.feed("{P") == ["{P"]                           # no JSON call starts so
    parser = AutoParser(AUTO.names)
    assert parser.feed("<tool_call>" + call("get_time")) == []   # inside an open block
    (done,) = parser.feed("</tool_call>")
    assert isinstance(done, ToolCall) and done.name == "get_time"


# -- required and named ------------------------------------------------------------------------------------
def test_required_parse():
    reply = f"[{call('get_weather', city='Paris', unit='celsius')}, {call('get_time')}]"
    assert parse_reply(REQUIRED, reply)[0] is None
    assert calls_of(parse_reply(REQUIRED, reply)) == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                                      ("get_time", {})]
    assert parse_reply(REQUIRED, "not json") == ("not json", [])
    assert parse_reply(REQUIRED, "[]") == ("[]", [])
    # cut short by max_tokens: the complete calls, the rest as content
    content, calls = parse_reply(REQUIRED, f"[{call('get_time')}, " + '{"name": "get_w')
    assert [c.name for c in calls] == ["get_time"] and content == ', {"name": "get_w'


def test_required_streams_each_call_when_complete():
    parser = make_parser(REQUIRED)
    assert parser.feed("[" + call("get_time")[:-1]) == []
    (first,) = parser.feed("}, ")
    assert first.name == "get_time"
    (second,) = parser.feed(call("get_weather", city="Oslo") + "]")
    assert second.name == "get_weather" and json.loads(second.arguments) == {"city": "Oslo"}
    assert parser.finish() == [] and parser.calls == 2


def test_named_is_the_whole_reply():
    content, calls = parse_reply(NAMED, ' {"city": "Paris"}')
    assert content is None and calls_of((content, calls)) == [("get_weather", {"city": "Paris"})]
    assert joined(streamed(NAMED, '{"city": "Paris"}', 3)) == ("", [("get_weather", {"city": "Paris"})])


def test_none_is_plain_content():
    assert make_parser(ToolChoice("none", TOOLS)) is None
    assert parse_reply(ToolChoice("none", TOOLS), call("get_time")) == (call("get_time"), [])


# -- schemas ------------------------------------------------------------------------------------------------
def test_required_schema_accepts_calls_and_nothing_else():
    schema = REQUIRED.constraint_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}],
                [{"name": "get_time"}], [{"name": "get_time", "arguments": {}, "extra": 1}],
                {"name": "get_time", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_schema_is_the_parameters():
    assert NAMED.constraint_schema() == WEATHER
    assert ToolChoice("named", TOOLS, "get_time").constraint_schema() == {"type": "object"}
    assert AUTO.constraint_schema() is None and ToolChoice("none", TOOLS).constraint_schema() is None


def test_required_schema_moves_defs_to_the_top():
    with_ref = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
                "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}
    schema = required_schema([Tool("a", with_ref), Tool("b", with_ref)])
    assert schema["$defs"] == with_ref["$defs"] and "$defs" not in json.dumps(schema["items"]).replace("#/$defs", "")
    jsonschema.validate([{"name": "a", "arguments": {"p": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "arguments": {"p": {"x": "one"}}}], schema)
    other = {**with_ref, "$defs": {"Point": {"type": "string"}}}
    with pytest.raises(ToolSchemaError):
        required_schema([Tool("a", with_ref), Tool("b", other)])


# -- request checks -----------------------------------------------------------------------------------------
def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": USER, **fields})


def test_chat_tools_modes():
    assert chat_tools(request()) is None
    assert chat_tools(request(tool_choice="none")) is None
    assert chat_tools(request(tools=OPENAI_TOOLS)).mode == "auto"  # OpenAI's default with tools
    assert chat_tools(request(tools=OPENAI_TOOLS, tool_choice="none")).mode == "none"
    assert chat_tools(request(tools=OPENAI_TOOLS, tool_choice="required")).names == {"get_weather", "get_time"}
    named = chat_tools(request(tools=OPENAI_TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.mode == "named" and named.name == "get_time"


BAD_TOOLS = [
    ("tools[0].type", dict(tools=[{"type": "retrieval", "function": {"name": "f"}}])),
    ("tools[0].function", dict(tools=[{"type": "function"}])),
    ("tools[0].function.name", dict(tools=[{"type": "function", "function": {"name": ""}}])),
    ("tools[0].function.name", dict(tools=[{"type": "function", "function": {"description": "no name"}}])),
    ("tools[1].function.name", dict(tools=[OPENAI_TOOLS[1], OPENAI_TOOLS[1]])),
    ("tools[1].function.description", dict(tools=[OPENAI_TOOLS[0], {"type": "function", "function": {
        "name": "g", "description": 5}}])),
    ("tools[0].function.parameters", dict(tools=[{"type": "function", "function": {"name": "f",
                                                                                    "parameters": "object"}}])),
    ("tool_choice", dict(tool_choice="required")),
    ("tool_choice", dict(tool_choice="auto")),
    ("tool_choice", dict(tools=[], tool_choice="required")),
    ("tool_choice", dict(tools=OPENAI_TOOLS, tool_choice="sometimes")),
    ("tool_choice", dict(tools=OPENAI_TOOLS, tool_choice={"type": "function"})),
    ("tool_choice.function.name", dict(tools=OPENAI_TOOLS, tool_choice={"type": "function",
                                                                        "function": {"name": "launch"}})),
]


@pytest.mark.parametrize("param,fields", BAD_TOOLS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_TOOLS)])
def test_chat_tools_refuses(param, fields):
    with pytest.raises(ApiError) as info:
        chat_tools(request(**fields))
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(param + ":"), info.value.message


def test_conflicting_defs_are_refused():
    defs = lambda t: {"type": "object", "$defs": {"X": {"type": t}}}  # noqa: E731
    tools = [{"type": "function", "function": {"name": "a", "parameters": defs("string")}},
             {"type": "function", "function": {"name": "b", "parameters": defs("number")}}]
    with pytest.raises(ApiError) as info:
        chat_tools(request(tools=tools, tool_choice="required"))
    assert info.value.param == "tools"


def test_parameters_that_do_not_compile_are_refused():
    tools = [OPENAI_TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}]
    with pytest.raises(ApiError) as info:
        chat_tools(request(tools=tools))
    assert info.value.param == "tools[1].function.parameters"


def test_required_and_named_set_the_constraint():
    limits = Limits()
    for fields, schema in ((dict(tool_choice="required"), REQUIRED.constraint_schema()),
                           (dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}), WEATHER)):
        body = request(tools=OPENAI_TOOLS, **fields)
        params = sampling_params(body, limits, chat_tools(body))
        assert json.loads(params.structured_output.json_schema) == schema
    for choice in ("auto", "none"):
        body = request(tools=OPENAI_TOOLS, tool_choice=choice)
        assert not sampling_params(body, limits, chat_tools(body)).HasField("structured_output")
    # auto adds no constraint, so another one is fine; required / named plus another is refused
    body = request(tools=OPENAI_TOOLS, response_format={"type": "json_object"})
    assert sampling_params(body, limits, chat_tools(body)).structured_output.json_object
    for extra in (dict(response_format={"type": "json_object"}), dict(guided_regex="a+")):
        body = request(tools=OPENAI_TOOLS, tool_choice="required", **extra)
        with pytest.raises(ApiError) as info:
            sampling_params(body, limits, chat_tools(body))
        assert info.value.param == "tool_choice"


# -- messages -------------------------------------------------------------------------------------------------
FOLLOW_UP = [*USER,
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]


def test_chat_messages_carry_tools_and_calls():
    chat = chat_messages(request(messages=FOLLOW_UP, tools=OPENAI_TOOLS))
    assert json.loads(chat.tools_json) == OPENAI_TOOLS
    assistant, tool = chat.messages[1], chat.messages[2]
    assert assistant.content == "" and json.loads(assistant.tool_calls_json) == FOLLOW_UP[1]["tool_calls"]
    assert tool.tool_call_id == "call_1" and tool.content == "Sunny, 21 C" and not tool.tool_calls_json
    assert chat_messages(request(messages=FOLLOW_UP, tools=OPENAI_TOOLS, tool_choice="none")).tools_json == ""
    assert chat_messages(request(messages=FOLLOW_UP)).tools_json == ""
    # arguments given as an object are taken as their JSON text
    as_object = [USER[0], {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}]
    (sent,) = json.loads(chat_messages(request(messages=as_object)).messages[1].tool_calls_json)
    assert sent == {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}


@pytest.mark.parametrize("param,message", [
    ("messages[1].tool_calls[0].function.name", {"role": "assistant", "tool_calls": [{"function": {}}]}),
    ("messages[1].tool_calls[0]", {"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}),
    ("messages[1].tool_calls", {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}),
    ("messages[1].content", {"role": "tool", "tool_call_id": "call_1"}),
])
def test_chat_messages_refuse_bad_tool_turns(param, message):
    with pytest.raises(ApiError) as info:
        chat_messages(request(messages=[*USER, message]))
    assert info.value.param == param


# -- formatter ------------------------------------------------------------------------------------------------
def out(text: str, finish: int = RUNNING, index: int = 0) -> SampleOutput:
    return SampleOutput("req", index, text, [1], [], finish, None)


def test_chat_response_with_tool_calls():
    formatter = ChatFormatter(request(tools=OPENAI_TOOLS), "abc", "m", AUTO)
    reply = f"Checking. <tool_call>{call('get_weather', city='Paris')}</tool_call>"
    (choice,) = formatter.response([IndexedOutput(0, out(reply, STOP))], 1)["choices"]
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] == "Checking."
    (tool_call,) = message["tool_calls"]
    assert CALL_ID.match(tool_call["id"]) and tool_call["type"] == "function"
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["finish_reason"] == "tool_calls"
    # no calls: a plain message, no tool_calls key
    (plain,) = formatter.response([IndexedOutput(0, out("Sunny.", STOP))], 1)["choices"]
    assert plain["message"] == {"role": "assistant", "content": "Sunny."} and plain["finish_reason"] == "stop"
    # cut short: the finish reason says so even where calls were made
    formatter = ChatFormatter(request(tools=OPENAI_TOOLS, tool_choice="required"), "abc", "m", REQUIRED)
    (cut,) = formatter.response([IndexedOutput(0, out(f"[{call('get_time')}, " + '{"na', LENGTH))], 1)["choices"]
    assert cut["finish_reason"] == "length" and [c["function"]["name"] for c in cut["message"]["tool_calls"]] \
        == ["get_time"]


def test_chat_stream_with_tool_calls():
    formatter = ChatFormatter(request(tools=OPENAI_TOOLS, n=2, stream=True), "abc", "m", AUTO)
    chunks = []
    for piece in ("Sure", ". <tool_", "call>" + call("get_weather", city="Oslo"), "</tool_call>\n<tool_call>",
                  call("get_time") + "</tool_call>"):
        chunks += formatter.stream_chunks(0, out(piece))
    chunks += formatter.stream_chunks(1, out("Plain", STOP, index=1))
    chunks += formatter.stream_chunks(0, out("", STOP))
    choices = [c["choices"][0] for c in chunks]
    zero = [c for c in choices if c["index"] == 0]
    assert [c["delta"] for c in zero[:2]] == [{"content": "Sure"}, {"content": "."}]
    calls = [d["tool_calls"][0] for c in zero if (d := c["delta"]).get("tool_calls")]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in calls] == [(0, "function", "get_weather"),
                                                                                (1, "function", "get_time")]
    assert all(CALL_ID.match(c["id"]) for c in calls) and json.loads(calls[0]["function"]["arguments"]) \
        == {"city": "Oslo"}
    assert [c["finish_reason"] for c in zero] == [None] * (len(zero) - 1) + ["tool_calls"]
    (one,) = [c for c in choices if c["index"] == 1]
    assert one["delta"] == {"content": "Plain"} and one["finish_reason"] == "stop"


def test_chat_stream_required_sends_calls_as_they_complete():
    formatter = ChatFormatter(request(tools=OPENAI_TOOLS, tool_choice="required", stream=True), "abc", "m", REQUIRED)
    assert formatter.stream_chunks(0, out("[" + call("get_time")[:-2])) == []
    (first,) = formatter.stream_chunks(0, out(call("get_time")[-2:] + ","))
    assert first["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_time"
    (last,) = formatter.stream_chunks(0, out(call("get_weather", city="Rome") + "]", STOP))
    choice = last["choices"][0]
    assert choice["delta"]["tool_calls"][0]["index"] == 1 and choice["finish_reason"] == "tool_calls"


def test_chat_without_tools_is_unchanged():
    formatter = ChatFormatter(request(tools=OPENAI_TOOLS, tool_choice="none"), "abc", "m",
                              ToolChoice("none", TOOLS))
    text = f"<tool_call>{call('get_time')}</tool_call>"
    (choice,) = formatter.response([IndexedOutput(0, out(text, STOP))], 1)["choices"]
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"
    (chunk,) = formatter.stream_chunks(0, out("<tool"))
    assert chunk["choices"][0]["delta"] == {"content": "<tool"}


# -- the tokenizer's template ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from tessera_tokenizer.tokenizer import Tokenizer
    return Tokenizer.load(None)


TEMPLATE_MESSAGES = [*USER, {"role": "assistant", "content": "", "tool_calls": FOLLOW_UP[1]["tool_calls"]},
                     {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call_1"}]


def test_template_without_tools_gets_a_tools_system_prompt(tokenizer):
    # SmolLM2's ChatML template mentions neither tools nor tool calls
    text = tokenizer.render_chat(TEMPLATE_MESSAGES, tools=OPENAI_TOOLS)
    system, user, assistant, tool, prompt = text.split("<|im_start|>")[1:]
    assert system.startswith("system\n# Tools") and json.dumps(OPENAI_TOOLS[0]) in system
    assert "<tool_call>" in system and "You are a helpful AI assistant" not in system
    assert assistant == ('assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                         '</tool_call><|im_end|>\n')
    assert tool == "tool\nSunny, 21 C<|im_end|>\n" and prompt == "assistant\n"
    # merged into a first system message
    merged = tokenizer.render_chat([{"role": "system", "content": "Be brief."}, *USER], tools=OPENAI_TOOLS)
    assert merged.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and merged.count("<|im_start|>system") == 1
    # no tools: as before
    assert "# Tools" not in tokenizer.render_chat(TEMPLATE_MESSAGES)


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}"
    "{% if m.tool_call_id is defined %} (for {{ m.tool_call_id }}){% endif %}{{ \"\\n\" }}{% endfor %}")


def test_template_with_tools_renders_them_itself(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer.hf, "chat_template", TOOL_TEMPLATE)
    text = tokenizer.render_chat(TEMPLATE_MESSAGES, add_generation_prompt=False, tools=OPENAI_TOOLS)
    first, *rest = text.splitlines()
    assert json.loads(first.removeprefix("TOOLS=")) == OPENAI_TOOLS
    # arguments become an object, as templates expect; tool_call_id reaches the template
    assert rest == ["[user]Weather in Paris?", '[assistant]CALL get_weather {"city": "Paris"}',
                    "[tool]Sunny, 21 C (for call_1)"]


def test_tokenizer_service_reads_the_json_fields():
    from tessera_tokenizer.server import InvalidInput, _chat_dicts

    chat = tokenizer_pb2.ChatMessages(tools_json=json.dumps(OPENAI_TOOLS), messages=[
        tokenizer_pb2.ChatMessage(role="user", content="hi"),
        tokenizer_pb2.ChatMessage(role="assistant", tool_calls_json=json.dumps(FOLLOW_UP[1]["tool_calls"])),
        tokenizer_pb2.ChatMessage(role="tool", content="Sunny", tool_call_id="call_1")])
    messages, tools = _chat_dicts(chat)
    assert tools == OPENAI_TOOLS
    assert messages == [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "", "tool_calls": FOLLOW_UP[1]["tool_calls"]},
                        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"}]
    assert _chat_dicts(tokenizer_pb2.ChatMessages(messages=chat.messages[:1]))[1] is None
    with pytest.raises(InvalidInput, match=r"^chat\.tools_json: not valid JSON"):
        _chat_dicts(tokenizer_pb2.ChatMessages(tools_json="[", messages=chat.messages[:1]))
    with pytest.raises(InvalidInput, match=r"^chat\.messages\[0\]\.tool_calls_json: must be a JSON list"):
        _chat_dicts(tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="assistant",
                                                                                  tool_calls_json="{}")]))
