"""The public gRPC API: FrontendService (Generate streams, Complete returns whole).

Every request is validated first (`validate_request`): a bad field is answered
INVALID_ARGUMENT with a message that starts with the field's name. The request id
is the client's (field, else `x-request-id` metadata) or a fresh uuid, and is
echoed on every message. Failures from the tokenizer or the engine keep their
status code (INVALID_ARGUMENT, UNAVAILABLE, ...). When the client cancels the call
the handler is cancelled, which closes the generate() iterator and aborts the
request in the engine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import uuid

import grpc

from tessera.common.grpc_service import request_id_from
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tessera_frontend.async_llm import AsyncLLM, GenerateError, GenerationOutput, Prompt

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Server-side caps on what a request may ask for (from flags)."""
    max_n: int = 16
    max_logprobs: int = 20
    max_stop: int = 16


class ValidationError(ValueError):
    """A request field is out of range; the message starts with the field name."""


def validate_request(request: frontend_pb2.GenerateRequest, limits: Limits) -> None:
    """Raise ValidationError naming the first bad field of `request`."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise ValidationError("prompt: one of text, chat or token_ids is required")
    if which == "text" and not request.text:
        raise ValidationError("prompt: text is empty")
    if which == "chat":
        if not request.chat.messages:
            raise ValidationError("prompt: chat has no messages")
        for i, message in enumerate(request.chat.messages):
            if message.role not in ("system", "user", "assistant"):
                raise ValidationError(
                    f"prompt: chat.messages[{i}].role must be system, user or assistant (got {message.role!r})")
    if which == "token_ids" and not request.token_ids.ids:
        raise ValidationError("prompt: token_ids is empty")
    validate_sampling_params(request.sampling_params, limits)


def validate_sampling_params(p: common_pb2.SamplingParams, limits: Limits) -> None:
    """Raise ValidationError naming the first out-of-range field of `p` (absent fields are fine)."""
    def check(field: str, ok, rule: str) -> None:
        if p.HasField(field):
            value = getattr(p, field)
            if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
                raise ValidationError(f"{field}: must be {rule} (got {value})")

    check("temperature", lambda v: v >= 0, ">= 0")
    check("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
    check("top_k", lambda v: v >= -1, ">= -1 (-1 or 0 disables)")
    check("min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
    check("repetition_penalty", lambda v: v > 0, "> 0")
    check("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
    check("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
    check("max_tokens", lambda v: v >= 1, ">= 1")
    max_tokens = p.max_tokens if p.HasField("max_tokens") else None
    check("min_tokens", lambda v: v >= 0 and (max_tokens is None or v <= max_tokens),
          ">= 0 and <= max_tokens")
    check("n", lambda v: 1 <= v <= limits.max_n, f"in [1, {limits.max_n}]")
    check("logprobs", lambda v: 0 <= v <= limits.max_logprobs, f"in [0, {limits.max_logprobs}]")
    check("prompt_logprobs", lambda v: 0 <= v <= limits.max_logprobs, f"in [0, {limits.max_logprobs}]")
    if len(p.stop) > limits.max_stop:
        raise ValidationError(f"stop: at most {limits.max_stop} stop strings (got {len(p.stop)})")
    if any(not s for s in p.stop):
        raise ValidationError("stop: stop strings must not be empty")
    if any(t < 0 for t in p.stop_token_ids):
        raise ValidationError("stop_token_ids: token ids must be >= 0")


def _prompt_of(request: frontend_pb2.GenerateRequest) -> Prompt:
    which = request.WhichOneof("prompt")
    if which == "text":
        return request.text
    if which == "chat":
        return request.chat
    return list(request.token_ids.ids)


class FrontendServicer(frontend_pb2_grpc.FrontendServiceServicer):
    def __init__(self, llm: AsyncLLM, limits: Limits) -> None:
        self._llm = llm
        self._limits = limits

    async def Generate(self, request: frontend_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        request_id = await self._admit(request, context)
        async with self._outputs(request, request_id, context) as outputs:
            async for out in outputs:
                await context.write(_response(out))

    async def Complete(self, request: frontend_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> frontend_pb2.GenerateResult:
        request_id = await self._admit(request, context)
        n = request.sampling_params.n if request.sampling_params.HasField("n") else 1
        choices = [frontend_pb2.Choice(index=i) for i in range(n)]
        result = frontend_pb2.GenerateResult(request_id=request_id)
        async with self._outputs(request, request_id, context) as outputs:
            async for out in outputs:
                choice = choices[out.index]
                choice.text += out.text
                choice.token_ids.extend(out.token_ids)
                choice.logprobs.extend(out.logprobs)
                if out.finished:
                    choice.finish_reason = out.finish_reason
                    if out.stop_reason is not None:
                        choice.stop_reason = out.stop_reason
                if out.usage is not None:
                    result.usage.CopyFrom(out.usage)
        result.choices.extend(choices)
        return result

    async def _admit(self, request: frontend_pb2.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> str:
        """Validate; return the request id to use (the caller's when given)."""
        request_id = request.request_id or request_id_from(context) or uuid.uuid4().hex
        try:
            validate_request(request, self._limits)
        except ValidationError as exc:
            log.info("request rejected", extra={"request_id": request_id, "error": str(exc)})
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return request_id

    @contextlib.asynccontextmanager
    async def _outputs(self, request: frontend_pb2.GenerateRequest, request_id: str,
                       context: grpc.aio.ServicerContext):
        """generate()'s iterator, closed on exit (which aborts an unfinished request);
        a GenerateError becomes the call's status."""
        outputs = self._llm.generate(request_id, _prompt_of(request), request.sampling_params,
                                     request.priority)
        try:
            async with contextlib.aclosing(outputs):
                yield outputs
        except GenerateError as exc:
            log.info("request failed", extra={"request_id": request_id, "code": exc.code.name,
                                              "error": exc.message})
            await context.abort(exc.code, exc.message)


def _response(out: GenerationOutput) -> frontend_pb2.GenerateResponse:
    response = frontend_pb2.GenerateResponse(
        request_id=out.request_id, index=out.index, text=out.text, token_ids=out.token_ids,
        logprobs=out.logprobs, finish_reason=out.finish_reason)
    if out.stop_reason is not None:
        response.stop_reason = out.stop_reason
    if out.usage is not None:
        response.usage.CopyFrom(out.usage)
    return response
