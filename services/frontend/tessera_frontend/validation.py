"""Request validation shared by the two public protocols (gRPC and OpenAI HTTP).

Everything that can be checked without the model is checked here, before a
request is admitted: each SamplingParams field's range, the caps configured on
the server (`Limits`), the prompt's shape and the chat messages. What needs the
model (token ids inside the vocabulary, prompt + max_tokens within the model's
length and the engines' KV cache) is checked by AsyncLLM once the prompt is
tokenized. The ranges, caps and chat roles are tessera.common.request_rules', which
the engine checks too.

A bad field raises `ValidationError(field, message)`; str() of it starts with
the field name ("top_p: must be in (0, 1] (got 1.5)"), which the gRPC API sends
as the INVALID_ARGUMENT details and the HTTP API maps to OpenAI's `param`.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from tessera.common.constraints import ConstraintError, StructuredOutputSpec, check_constraint
from tessera.common.request_rules import CHAT_ROLES, SamplingCaps, sampling_problem
from tessera.v1 import common_pb2, frontend_pb2, tokenizer_pb2

MAX_REQUEST_ID_CHARS = 256


@dataclasses.dataclass(frozen=True)
class Limits(SamplingCaps):
    """Server-side caps on what a request may ask for (the first three come from flags): the
    sampling caps request_rules checks, and the frontend's own."""
    max_n: int = 16
    max_logprobs: int = 20
    max_stop: int = 16
    max_stop_chars: int = 1024          # length of one stop string
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024          # tokens in one logit_bias map
    max_prompts: int = 64               # prompts in one OpenAI /v1/completions request
    max_body_bytes: int = 8 << 20       # an HTTP request body (413 past it; 0: no cap)


class ValidationError(ValueError):
    """A request field is out of range; `field` names it and str() starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def validate_request(request: frontend_pb2.GenerateRequest, limits: Limits) -> None:
    """Raise ValidationError naming the first bad field of a gRPC GenerateRequest."""
    validate_request_id(request.request_id)
    which = request.WhichOneof("prompt")
    if which is None:
        raise ValidationError("prompt", "one of text, chat or token_ids is required")
    if which == "text" and not request.text:
        raise ValidationError("prompt", "text is empty")
    if which == "chat":
        problem = chat_problem(request.chat)
        if problem is not None:
            where = "chat.messages" if problem.index is None else f"chat.messages[{problem.index}]"
            raise ValidationError("prompt", f"{where}: {problem.message}")
    if which == "token_ids" and not request.token_ids.ids:
        raise ValidationError("prompt", "token_ids is empty")
    validate_sampling_params(request.sampling_params, limits)


def validate_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValidationError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters "
                                            f"(got {len(request_id)})")
    if any(not c.isprintable() for c in request_id):
        raise ValidationError("request_id", "must be printable characters")


class ChatProblem(NamedTuple):
    """What is wrong with chat messages: the message's index (None: the list as a whole) and why."""
    index: int | None
    message: str


def chat_problem(chat: tokenizer_pb2.ChatMessages) -> ChatProblem | None:
    """What is wrong with the chat messages, if anything."""
    if not chat.messages:
        return ChatProblem(None, "must contain at least one message")
    for i, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            return ChatProblem(i, f"role must be one of {', '.join(CHAT_ROLES)} (got {message.role!r})")
    return None


def validate_sampling_params(p: common_pb2.SamplingParams, limits: Limits) -> None:
    """Raise ValidationError naming the first out-of-range field of `p` (absent fields are fine):
    the ranges and caps of request_rules.sampling_problem, then the output constraint's compile check."""
    problem = sampling_problem(p, limits)
    if problem is not None:
        raise ValidationError(problem.field, problem.detail)
    if p.HasField("structured_output"):
        spec = StructuredOutputSpec.from_proto(p.structured_output)
        if spec is not None:
            try:
                check_constraint(spec)
            except ConstraintError as exc:
                raise ValidationError("structured_output", str(exc)) from None
