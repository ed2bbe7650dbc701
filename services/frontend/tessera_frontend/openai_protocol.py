"""OpenAI-compatible request bodies (pydantic) and their translation into tessera's terms.

`ChatCompletionRequest` and `CompletionRequest` follow OpenAI's API plus vLLM's
extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, skip_special_tokens, include_stop_str_in_output, prompt_logprobs,
priority, request_id). Unknown fields are ignored, as OpenAI clients send new
ones over time. Integer fields carried as int32 in the protos are bounded here,
so an out-of-range value is a 400 naming the field, not a server error.

`sampling_params()` builds the tessera.v1.SamplingParams and runs the shared
range checks (`validation`); features tessera does not have (echo, suffix,
non-text content) are refused with `ApiError` naming the parameter
rather than silently ignored. Output constraints come from response_format
(json_object, json_schema) or vLLM's guided_json / guided_regex / guided_grammar /
guided_choice / structured_outputs, at most one per request; a required or named
tool_choice is one too (`chat_tools()` validates tools and tool_choice; `tool_calls`
has the modes).
"""
from __future__ import annotations

import json
from typing import Annotated, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tessera.common import constraints
from tessera.common.constraints import StructuredOutputSpec
from tessera.common.request_rules import CHAT_ROLES
from tessera.v1 import common_pb2, tokenizer_pb2
from tessera_frontend.async_llm import Prompt
from tessera_frontend.tool_calls import Tool, ToolChoice, ToolSchemaError
from tessera_frontend.validation import Limits, ValidationError, validate_sampling_params

Int32 = Annotated[int, Field(ge=-(2 ** 31), le=2 ** 31 - 1)]
NonNegInt32 = Annotated[int, Field(ge=0, le=2 ** 31 - 1)]
Int64 = Annotated[int, Field(ge=-(2 ** 63), le=2 ** 63 - 1)]


class ApiError(Exception):
    """An error answered as OpenAI's {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
             503: "service_unavailable_error", 504: "timeout_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or self.TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""
    model: Optional[str] = None
    n: Optional[Int32] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_tokens: Optional[Int32] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[Int64] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extra sampling parameters
    top_k: Optional[Int32] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: Optional[Int32] = None
    stop_token_ids: Optional[list[Int32]] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[Int32] = None
    priority: Int32 = 0
    request_id: Optional[str] = None
    # structured output: OpenAI's response_format, and vLLM's guided_* fields and their
    # newer structured_outputs object ({"json" | "regex" | "choice" | "grammar" | "json_object"})
    response_format: Optional[dict] = None
    guided_json: Optional[Union[dict, str]] = None
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    structured_outputs: Optional[dict] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None  # null on an assistant turn that calls tools
    name: Optional[str] = None
    # An assistant turn's tool calls ({"id", "type": "function", "function": {"name", "arguments"}}),
    # and a `tool` turn's answer to one of them: both go to the chat template.
    tool_calls: Optional[list[dict]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[Int32] = None
    logprobs: bool = False
    top_logprobs: Optional[Int32] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[NonNegInt32], list[list[NonNegInt32]]]
    logprobs: Optional[Int32] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[Int32] = None


# tessera field -> the OpenAI parameter a client set, per endpoint (for `param` in errors)
CHAT_PARAMS = {"logprobs": "top_logprobs", "prompt": "messages", "token_ids": "messages"}
COMPLETION_PARAMS = {"prompt": "prompt", "token_ids": "prompt"}


def sampling_params(body: ChatCompletionRequest | CompletionRequest, limits: Limits,
                    tools: ToolChoice | None = None) -> common_pb2.SamplingParams:
    """The request's SamplingParams, range-checked; ApiError(400) naming the parameter otherwise.
    `tools` (chat_tools'): a required or named tool_choice is the output constraint."""
    chat = isinstance(body, ChatCompletionRequest)
    _refuse_unsupported(body)
    p = common_pb2.SamplingParams()
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty", "min_tokens", "n", "skip_special_tokens", "prompt_logprobs"):
        value = getattr(body, name)
        if value is not None:
            setattr(p, name, value)
    max_tokens = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None:
        p.max_tokens = max_tokens
    if body.stop is not None:
        p.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        p.stop_token_ids.extend(body.stop_token_ids)
    p.ignore_eos = body.ignore_eos
    p.include_stop_str_in_output = body.include_stop_str_in_output
    if best_of_extra(body):
        # best_of samples, ranked by their tokens' summed logprobs (the sampled token's, which
        # logprobs=0 returns); the n best are answered (openai_api.best_of_choices)
        p.n = body.best_of
        if body.logprobs is None:
            p.logprobs = 0
    if chat:
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        if body.logprobs:
            p.logprobs = body.top_logprobs or 0
    elif body.logprobs is not None:
        p.logprobs = body.logprobs
    for token, bias in (body.logit_bias or {}).items():
        try:
            p.logit_bias[int(token)] = bias
        except (ValueError, OverflowError):
            raise ApiError(400, f"logit_bias: keys must be token ids (got {token!r})", param="logit_bias") from None
    spec = structured_output(body)
    if spec is not None:
        p.structured_output.CopyFrom(constraints.to_proto(spec))
    tool_schema = tools.constraint_schema() if tools is not None else None
    if tool_schema is not None:
        if spec is not None:
            other = openai_param("structured_output", body)
            raise _bad("tool_choice", f"only one output constraint per request: a {tools.mode} tool_choice "
                                      f"constrains the output, and so does {other}")
        p.structured_output.CopyFrom(constraints.to_proto(StructuredOutputSpec("json_schema", json.dumps(tool_schema))))
    try:
        validate_sampling_params(p, limits)
    except ValidationError as exc:
        raise invalid(exc, body) from None
    return p


def best_of_extra(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """True when the request asks for more samples (best_of) than it returns (n)."""
    return isinstance(body, CompletionRequest) and body.best_of is not None and body.best_of > (body.n or 1)


def structured_output(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutputSpec | None:
    """The request's output constraint, from whichever of the fields that carry one it set
    (at most one); its compile check is validate_sampling_params'."""
    found: list[tuple[str, StructuredOutputSpec]] = []

    def bad(param: str, message: str) -> ApiError:
        return ApiError(400, f"{param}: {message}", param=param)

    def schema_text(param: str, schema) -> str:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise bad(param, f"not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise bad(param, "must be a JSON schema object")
        return json.dumps(schema)

    rf = body.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            found.append(("response_format", StructuredOutputSpec("json_object")))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise bad("response_format.json_schema", "must be an object with the schema under `schema`")
            found.append(("response_format", StructuredOutputSpec(
                "json_schema", schema_text("response_format.json_schema.schema", js["schema"]))))
        elif kind != "text":
            raise bad("response_format.type", f"must be text, json_object or json_schema (got {kind!r})")
    if body.guided_json is not None:
        found.append(("guided_json", StructuredOutputSpec("json_schema", schema_text("guided_json", body.guided_json))))
    if body.guided_regex is not None:
        found.append(("guided_regex", StructuredOutputSpec("regex", body.guided_regex)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutputSpec("grammar", body.guided_grammar)))
    if body.guided_choice is not None:
        found.append(("guided_choice", StructuredOutputSpec("choice", tuple(body.guided_choice))))
    so = body.structured_outputs
    if so:
        keys = [k for k in ("json", "regex", "grammar", "choice", "json_object") if so.get(k) not in (None, False)]
        if len(keys) > 1:
            raise bad("structured_outputs", f"set one of json, regex, grammar, choice, json_object (got {keys})")
        for key in keys:
            value = so[key]
            param = f"structured_outputs.{key}"
            if key == "json":
                spec = StructuredOutputSpec("json_schema", schema_text(param, value))
            elif key == "json_object":
                spec = StructuredOutputSpec("json_object")
            elif key == "choice":
                if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                    raise bad(param, "must be a list of strings")
                spec = StructuredOutputSpec("choice", tuple(value))
            else:
                if not isinstance(value, str):
                    raise bad(param, "must be a string")
                spec = StructuredOutputSpec(key, value)
            found.append(("structured_outputs", spec))
    if len(found) > 1:
        raise ApiError(400, f"{found[1][0]}: only one output constraint per request "
                            f"(also set: {found[0][0]})", param=found[1][0])
    return found[0][1] if found else None


def invalid(exc: ValidationError, body: ChatCompletionRequest | CompletionRequest) -> ApiError:
    """A ValidationError as a 400 whose `param` is the OpenAI parameter the client used."""
    return ApiError(400, str(exc), param=openai_param(exc.field, body))


def openai_param(field: str, body: ChatCompletionRequest | CompletionRequest) -> str:
    if field == "structured_output":
        spec_field = next((f for f in ("response_format", "guided_json", "guided_regex", "guided_grammar",
                                       "guided_choice", "structured_outputs") if getattr(body, f) is not None), None)
        if spec_field is None and isinstance(body, ChatCompletionRequest) and body.tools:
            return "tool_choice"  # the constraint of a required or named tool_choice
        return spec_field or field
    if isinstance(body, ChatCompletionRequest):
        if field == "max_tokens" and body.max_completion_tokens is not None:
            return "max_completion_tokens"
        return CHAT_PARAMS.get(field, field)
    return COMPLETION_PARAMS.get(field, field)


def _refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    def refuse(param: str, what: str) -> None:
        raise ApiError(400, f"{param}: {what} is not supported by this server", param=param)

    if not isinstance(body, ChatCompletionRequest):
        if body.echo:
            refuse("echo", "echo (returning the prompt with the completion)")
        if body.suffix:
            refuse("suffix", "suffix (insertion)")
        if body.best_of is not None and body.best_of < (body.n or 1):
            raise ApiError(400, f"best_of: must be >= n ({body.n or 1}) (got {body.best_of})", param="best_of")
        if body.best_of is not None and body.best_of > (body.n or 1) and body.stream:
            raise ApiError(400, "best_of: a stream cannot choose the best samples before they finish; "
                                "set best_of = n or stream = false", param="best_of")


def chat_tools(body: ChatCompletionRequest) -> ToolChoice | None:
    """The request's tools and tool_choice, validated (ApiError(400) naming the parameter);
    None when it has neither. tool_choice defaults to auto with tools, as OpenAI's does."""
    tools = body.tools or []
    mode, named = _tool_choice_mode(body.tool_choice, bool(tools))
    if not tools:
        if mode != "none":
            raise _bad("tool_choice", f"{mode} needs tools (the request has none)")
        return None
    parsed: list[Tool] = []
    for i, tool in enumerate(tools):
        parsed.append(_checked_tool(f"tools[{i}]", tool, parsed))
    if named is not None and all(t.name != named for t in parsed):
        raise _bad("tool_choice.function.name", f"{named!r} is not one of the tools")
    result = ToolChoice(mode, tuple(parsed), named)
    try:
        result.constraint_schema()
    except ToolSchemaError as exc:
        raise _bad("tools", str(exc)) from None
    return result


def _tool_choice_mode(choice: str | dict | None, has_tools: bool) -> tuple[str, str | None]:
    """(tool_calls mode, the named function or None) of a tool_choice value."""
    if choice is None:
        return ("auto" if has_tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"must be none, auto, required or a function (got {choice!r})")
        return choice, None
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict):
        raise _bad("tool_choice", 'must be none, auto, required or {"type": "function", "function": {"name": ...}}')
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("tool_choice.function.name", "must be a non-empty string")
    return "named", name


def _checked_tool(where: str, tool: dict, earlier: list[Tool]) -> Tool:
    """One entry of `tools`: a function with a unique name and a parameters schema that compiles."""
    if tool.get("type") != "function":
        raise _bad(f"{where}.type", f"must be function (got {tool.get('type')!r})")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function", "must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.function.name", "must be a non-empty string")
    if any(t.name == name for t in earlier):
        raise _bad(f"{where}.function.name", f"{name!r} names an earlier tool too (names must be unique)")
    if not isinstance(function.get("description") or "", str):
        raise _bad(f"{where}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise _bad(f"{where}.function.parameters", "must be a JSON schema object")
        try:
            constraints.check_constraint(StructuredOutputSpec("json_schema", json.dumps(parameters)))
        except constraints.ConstraintError as exc:
            raise _bad(f"{where}.function.parameters", str(exc)) from None
    return Tool(name, parameters)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def chat_messages(body: ChatCompletionRequest) -> tokenizer_pb2.ChatMessages:
    """The messages as tessera ChatMessages: text content only; `developer` is a system message;
    roles are those the tokenizer's chat template takes (system, user, assistant, tool). An
    assistant's tool calls and a tool's tool_call_id go along; the tools too, unless tool_choice
    is none (then the model is not shown them)."""
    if not body.messages:
        raise ApiError(400, "messages: must contain at least one message", param="messages")
    out = tokenizer_pb2.ChatMessages()
    if body.tools and body.tool_choice != "none":
        out.tools_json = json.dumps(body.tools, ensure_ascii=False)
    for i, message in enumerate(body.messages):
        role = "system" if message.role == "developer" else message.role
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role: must be one of developer, {', '.join(CHAT_ROLES)} "
                                f"(got {message.role!r})", param=f"messages[{i}].role")
        tool_calls = _message_tool_calls(i, message) if message.tool_calls else None
        content = message.content
        if content is None:
            if role != "assistant":
                raise ApiError(400, f"messages[{i}].content: is required", param=f"messages[{i}].content")
            content = ""
        elif not isinstance(content, str):
            parts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{i}].content[{j}]: only text content is supported "
                                        f"(got type {part.type!r})", param=f"messages[{i}].content")
                parts.append(part.text)
            content = "".join(parts)
        pb = out.messages.add(role=role, content=content)
        if tool_calls:
            if role != "assistant":
                raise ApiError(400, f"messages[{i}].tool_calls: only an assistant message calls tools",
                               param=f"messages[{i}].tool_calls")
            pb.tool_calls_json = json.dumps(tool_calls, ensure_ascii=False)
        if role == "tool" and message.tool_call_id:
            pb.tool_call_id = message.tool_call_id
    return out


def _message_tool_calls(i: int, message: ChatMessage) -> list[dict]:
    """An assistant message's tool calls in OpenAI's shape (arguments as JSON text), checked."""
    calls = []
    for j, call in enumerate(message.tool_calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise ApiError(400, f'{where}: must be {{"type": "function", "function": {{"name", "arguments"}}}}',
                           param=where)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"{where}.function.name: must be a non-empty string", param=f"{where}.function.name")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):  # an object where OpenAI has its JSON text: taken as it is
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append({"id": str(call.get("id") or ""), "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    return calls


def completion_prompts(body: CompletionRequest, limits: Limits) -> list[Prompt]:
    """One prompt (text or token ids) per entry of `prompt`, a batch being a list of them."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [p if isinstance(p, str) else list(p) for p in prompt]
    if not prompts:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    if len(prompts) > limits.max_prompts:
        raise ApiError(400, f"prompt: at most {limits.max_prompts} prompts per request (got {len(prompts)})",
                       param="prompt")
    for i, p in enumerate(prompts):
        if not p:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise ApiError(400, f"{where}: must not be empty", param="prompt")
    return prompts


def validation_error_param(loc: tuple) -> str | None:
    """The parameter a pydantic error location points at: ("body", "messages", 0, "role") -> messages[0].role."""
    parts = list(loc[1:]) if loc and loc[0] == "body" else list(loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _UNION_TAGS:
            out += f".{part}" if out else part
        else:
            break  # a union member tag ("list[int]", "str") or anything else: stop here
    return out or None


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
