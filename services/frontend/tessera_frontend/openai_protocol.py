"""OpenAI-compatible request bodies (pydantic) and their translation into tessera's terms.

`ChatCompletionRequest` and `CompletionRequest` follow OpenAI's API plus vLLM's
extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, skip_special_tokens, include_stop_str_in_output, prompt_logprobs,
priority, request_id). Unknown fields are ignored, as OpenAI clients send new
ones over time. Integer fields carried as int32 in the protos are bounded here,
so an out-of-range value is a 400 naming the field, not a server error.

`sampling_params()` builds the tessera.v1.SamplingParams and runs the shared
range checks (`validation`); features tessera does not have (tools, logit_bias,
echo, suffix, non-text content, best_of > n, JSON response formats) are refused
with `ApiError` naming the parameter rather than silently ignored.
"""
from __future__ import annotations

from typing import Annotated, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tessera.v1 import common_pb2, tokenizer_pb2
from tessera_frontend.async_llm import Prompt
from tessera_frontend.validation import CHAT_ROLES, Limits, ValidationError, validate_sampling_params

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

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    # A `tool` message's answer to an assistant tool call. Accepted as OpenAI's schema has it;
    # the chat template gets role and content only (tessera.v1.ChatMessage carries no more).
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[Int32] = None
    logprobs: bool = False
    top_logprobs: Optional[Int32] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    response_format: Optional[dict] = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[NonNegInt32], list[list[NonNegInt32]]]
    logprobs: Optional[Int32] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[Int32] = None


# tessera field -> the OpenAI parameter a client set, per endpoint (for `param` in errors)
CHAT_PARAMS = {"logprobs": "top_logprobs", "prompt": "messages", "token_ids": "messages"}
COMPLETION_PARAMS = {"prompt": "prompt", "token_ids": "prompt"}


def sampling_params(body: ChatCompletionRequest | CompletionRequest, limits: Limits) -> common_pb2.SamplingParams:
    """The request's SamplingParams, range-checked; ApiError(400) naming the parameter otherwise."""
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
    if chat:
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        if body.logprobs:
            p.logprobs = body.top_logprobs or 0
    elif body.logprobs is not None:
        p.logprobs = body.logprobs
    try:
        validate_sampling_params(p, limits)
    except ValidationError as exc:
        raise invalid(exc, body) from None
    return p


def invalid(exc: ValidationError, body: ChatCompletionRequest | CompletionRequest) -> ApiError:
    """A ValidationError as a 400 whose `param` is the OpenAI parameter the client used."""
    return ApiError(400, str(exc), param=openai_param(exc.field, body))


def openai_param(field: str, body: ChatCompletionRequest | CompletionRequest) -> str:
    if isinstance(body, ChatCompletionRequest):
        if field == "max_tokens" and body.max_completion_tokens is not None:
            return "max_completion_tokens"
        return CHAT_PARAMS.get(field, field)
    return COMPLETION_PARAMS.get(field, field)


def _refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    def refuse(param: str, what: str) -> None:
        raise ApiError(400, f"{param}: {what} is not supported by this server", param=param)

    if body.logit_bias:
        refuse("logit_bias", "logit_bias")
    if isinstance(body, ChatCompletionRequest):
        if body.tools:
            refuse("tools", "tool calling")
        if body.tool_choice not in (None, "none", "auto"):
            refuse("tool_choice", "tool calling")
        if body.response_format and body.response_format.get("type", "text") != "text":
            refuse("response_format", f"response_format {body.response_format.get('type')!r}")
    else:
        if body.echo:
            refuse("echo", "echo (returning the prompt with the completion)")
        if body.suffix:
            refuse("suffix", "suffix (insertion)")
        if body.best_of is not None and body.best_of != (body.n or 1):
            refuse("best_of", "best_of other than n")


def chat_messages(body: ChatCompletionRequest) -> tokenizer_pb2.ChatMessages:
    """The messages as tessera ChatMessages: text content only; `developer` is a system message;
    roles are those the tokenizer's chat template takes (system, user, assistant, tool)."""
    if not body.messages:
        raise ApiError(400, "messages: must contain at least one message", param="messages")
    out = tokenizer_pb2.ChatMessages()
    for i, message in enumerate(body.messages):
        role = "system" if message.role == "developer" else message.role
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role: must be one of developer, {', '.join(CHAT_ROLES)} "
                                f"(got {message.role!r})", param=f"messages[{i}].role")
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
        out.messages.add(role=role, content=content)
    return out


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
