"""A call's keyword arguments as a GenerateRequest (pure): the prompt, every SamplingParams
field, structured output (OpenAI's response_format, plus regex / grammar / choice) and tools.

Bad input is a ValueError (or TypeError) naming the argument, before anything is sent; what
only the server can judge (ranges against the model, a schema that does not compile) comes
back as InvalidArgumentError with the server's message.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence, TypedDict, Union

from tessera.client.tool_calls import ToolChoice, tool_choice_of
from tessera.v1 import common_pb2, frontend_pb2, tokenizer_pb2


class Message(TypedDict, total=False):
    """One chat turn, as OpenAI writes it: role, content; an assistant turn's tool_calls (OpenAI's
    list), a tool turn's tool_call_id."""
    role: str
    content: str
    tool_calls: list
    tool_call_id: str


ResponseFormat = Mapping[str, Any]
Prompt = Union[str, Sequence[int]]


class GenerateArgs(TypedDict, total=False):
    """The keyword arguments of generate() and complete(): the prompt (exactly one of `prompt`,
    text or token ids, and `messages`), tools, and SamplingParams' fields (common.proto)."""
    prompt: Prompt
    messages: Sequence[Message]
    tools: Sequence[dict]              # OpenAI's tools list (with messages)
    tool_choice: Union[str, dict]      # "auto" (default), "none", "required", {"type": "function", ...}
    response_format: ResponseFormat    # structured output (see structured_output)
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop: Union[str, Sequence[str]]
    stop_token_ids: Sequence[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    n: int
    logprobs: int                      # top alternatives per token (0: the chosen token's only)
    prompt_logprobs: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    logit_bias: Mapping[int, float]
    priority: int
    lora_name: str
    request_id: str

# SamplingParams fields taken as they are (proto3 `optional` scalars and the plain ones).
SCALAR_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "max_tokens", "min_tokens", "ignore_eos", "n", "prompt_logprobs",
                 "skip_special_tokens", "include_stop_str_in_output")


def build_request(*, prompt: Prompt | None = None, messages: Sequence[Message] | None = None,
                  tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
                  response_format: ResponseFormat | None = None, stop: str | Sequence[str] | None = None,
                  stop_token_ids: Sequence[int] | None = None, logprobs: int | bool | None = None,
                  logit_bias: Mapping[int, float] | None = None, priority: int = 0, lora_name: str = "",
                  request_id: str = "", **sampling: Any) -> tuple[frontend_pb2.GenerateRequest, ToolChoice | None]:
    """The request, and the tool choice its replies are parsed with (None: no tools)."""
    unknown = set(sampling) - set(SCALAR_FIELDS)
    if unknown:
        raise TypeError(f"unexpected argument(s): {', '.join(sorted(unknown))}")
    request = frontend_pb2.GenerateRequest(request_id=request_id, priority=priority, lora_name=lora_name)
    choice = _prompt(request, prompt, messages, tools, tool_choice)

    params = request.sampling_params
    for name, value in sampling.items():
        if value is not None:
            setattr(params, name, value)
    if stop is not None:
        params.stop.extend([stop] if isinstance(stop, str) else list(stop))
    if stop_token_ids:
        params.stop_token_ids.extend(stop_token_ids)
    if logprobs is not None and logprobs is not False:
        params.logprobs = 0 if logprobs is True else logprobs
    for token_id, bias in (logit_bias or {}).items():
        params.logit_bias[int(token_id)] = bias

    constraint = choice.constraint_schema() if choice is not None else None
    if constraint is not None:
        if response_format is not None:
            raise ValueError(f"response_format: cannot be combined with tool_choice={tool_choice!r} "
                             "(which constrains the reply itself)")
        params.structured_output.json_schema = json.dumps(constraint)
    elif response_format is not None:
        structured = structured_output(response_format)
        if structured is not None:
            params.structured_output.CopyFrom(structured)
    return request, choice


def _prompt(request: frontend_pb2.GenerateRequest, prompt: Prompt | None, messages: Sequence[Message] | None,
            tools: Sequence[dict] | None, tool_choice: str | dict | None) -> ToolChoice | None:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt (text or token ids) and messages")
    if messages is None:
        if tools:
            raise ValueError("tools: only with messages (the chat template shows the model its tools)")
        if isinstance(prompt, str):
            request.text = prompt
        elif isinstance(prompt, (bytes, bytearray)) or not all(isinstance(t, int) for t in prompt):
            raise TypeError("prompt: must be text (str) or token ids (a sequence of int)")
        else:
            request.token_ids.ids.extend(prompt)
        return None
    chat = request.chat
    chat.messages.extend(chat_message(m, i) for i, m in enumerate(messages))
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice: {tool_choice!r} needs tools")
        return None
    choice = tool_choice_of(tools, tool_choice)
    if choice.mode != "none":
        chat.tools_json = json.dumps(list(tools))
        return choice
    return None


def chat_message(message: Message | Mapping[str, Any], i: int = 0) -> tokenizer_pb2.ChatMessage:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"messages[{i}]: must be a dict with a 'role' (and 'content')")
    content = message.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content: must be text")
    out = tokenizer_pb2.ChatMessage(role=message["role"], content=content,
                                    tool_call_id=message.get("tool_call_id") or "")
    calls = message.get("tool_calls")
    if calls:
        out.tool_calls_json = calls if isinstance(calls, str) else json.dumps(
            [c.as_json() if hasattr(c, "as_json") else c for c in calls])
    return out


def structured_output(response_format: ResponseFormat) -> common_pb2.StructuredOutput | None:
    """OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", "json_schema":
    {"schema": ...}}), or tessera's other constraints: {"type": "regex", "regex": ...},
    {"type": "grammar", "grammar": ...}, {"type": "choice", "choice": [...]}. None: free text."""
    if not isinstance(response_format, Mapping):
        raise TypeError("response_format: must be a dict such as {'type': 'json_object'}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema", response_format)
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if schema is None:
            raise ValueError("response_format.json_schema.schema: a JSON schema is required")
        return common_pb2.StructuredOutput(json_schema=schema if isinstance(schema, str) else json.dumps(schema))
    if kind in ("regex", "grammar"):
        value = response_format.get(kind)
        if not isinstance(value, str) or not value:
            raise ValueError(f"response_format.{kind}: must be a non-empty string")
        return common_pb2.StructuredOutput(**{kind: value})
    if kind == "choice":
        choices = response_format.get("choice")
        if not choices or isinstance(choices, str) or not all(isinstance(c, str) for c in choices):
            raise ValueError("response_format.choice: must be a non-empty list of strings")
        return common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=list(choices)))
    raise ValueError(f"response_format.type: must be text, json_object, json_schema, regex, grammar or choice "
                     f"(got {kind!r})")


def tokenize_request(*, text: str | None = None, messages: Sequence[Message] | None = None,
                     tools: Sequence[dict] | None = None, add_special_tokens: bool | None = None,
                     add_generation_prompt: bool | None = None, return_token_strs: bool = False,
                     return_offsets: bool = False) -> frontend_pb2.FrontendServiceTokenizeRequest:
    """Tokenize's request: exactly one of text and messages (with their tools)."""
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text and messages")
    request = frontend_pb2.FrontendServiceTokenizeRequest(return_token_strs=return_token_strs,
                                                          return_offsets=return_offsets)
    if text is not None:
        if tools:
            raise ValueError("tools: only with messages")
        request.text = text
    else:
        request.chat.messages.extend(chat_message(m, i) for i, m in enumerate(messages))
        if tools:
            tool_choice_of(tools)  # checks them
            request.chat.tools_json = json.dumps(list(tools))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    if add_generation_prompt is not None:
        request.add_generation_prompt = add_generation_prompt
    return request
