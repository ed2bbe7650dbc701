"""vLLM's /tokenize and /detokenize HTTP endpoints (its serving_tokenization), over the tokenizer service.

POST /tokenize takes one of vLLM's two forms:
  completion: {"model"?, "prompt": str, "add_special_tokens"?: true}
  chat:       {"model"?, "messages": [...], "add_generation_prompt"?: true, "add_special_tokens"?: false}
and answers {"count", "max_model_len", "tokens"}, plus "token_strs" when "return_token_strs" is
true: each token's text with special tokens kept (TokenizerClient.token_texts; vLLM gives the
vocabulary's raw pieces, e.g. "Ġword", which the tokenizer service does not expose).

POST /detokenize takes {"model"?, "tokens": [int]} and answers {"prompt": str}, special tokens
kept (vLLM's tokenizer.decode does not skip them), so a /tokenize result round-trips.

"model" is checked as the other endpoints check it (404 for another name); bad input is a 400
naming the parameter. Neither endpoint reaches an engine, so neither is admitted nor counted
as a generation request.
"""
from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Awaitable, NamedTuple, Optional, Sequence, TypeVar

import grpc
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tessera.v1 import tokenizer_pb2
from tessera_frontend.async_llm import GenerateError
from tessera_frontend.http_limits import check_unicode
from tessera_frontend.openai_protocol import ApiError, ChatCompletionRequest, ChatMessage, chat_messages
from tessera_frontend.tokenizer_client import TokenizeError

if TYPE_CHECKING:  # openai_api imports this module
    from tessera_frontend.openai_api import OpenAIApi

T = TypeVar("T")

# What the tokenizer and the readiness wait can answer; anything else is a server error.
_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAVAILABLE: 503,
                grpc.StatusCode.DEADLINE_EXCEEDED: 504}


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`) as one body:
    exactly one of the two is set."""
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # None: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: Optional[bool] = False
    # vLLM's chat-form fields this server does not have: refused when set, not ignored
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict] = None
    tools: Optional[list[dict]] = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, api: OpenAIApi) -> None:
    """Register POST /tokenize and POST /detokenize on `app`, answered over `api`'s AsyncLLM."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(await tokenize_prompt(api, body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(await detokenize_tokens(api, body))


async def tokenize_prompt(api: OpenAIApi, body: TokenizeRequest) -> dict:
    """The /tokenize answer: {"count", "max_model_len", "tokens"[, "token_strs"]}."""
    check_unicode(body)
    request = tokenize_request(body)
    await api.check_model(body.model)
    llm = api.llm
    await _call(llm.wait_ready(), param=None)
    param = "prompt" if body.prompt is not None else "messages"
    try:
        reply = await llm.tokenizer.tokenize(request, f"tok-{uuid.uuid4().hex}")  # the id is for logs only
    except TokenizeError as exc:
        raise _api_error(exc.code, exc.message, param) from None
    ids = list(reply.token_ids)
    answer = {"count": len(ids), "max_model_len": llm.max_model_len or 0, "tokens": ids}
    if body.return_token_strs:
        texts = await _call(llm.tokenizer.token_texts(ids), param)
        answer["token_strs"] = [texts[t] for t in ids]
    return answer


async def detokenize_tokens(api: OpenAIApi, body: DetokenizeRequest) -> dict:
    """The /detokenize answer: {"prompt": the tokens' text, special tokens kept}."""
    check_unicode(body)
    await api.check_model(body.model)
    llm = api.llm
    await _call(llm.wait_ready(), param=None)
    # Checked here so that the message names the entry (the tokenizer would refuse it too), and
    # so that an id past int32 is a 400 rather than a failure to build the gRPC request.
    problem = detokenize_ids_problem("tokens", body.tokens, llm.tokenizer.model_info.vocab_size)
    if problem is not None:
        raise ApiError(400, problem.message, param=problem.param)
    text = await _call(llm.tokenizer.detokenize(body.tokens, skip_special_tokens=False), "tokens")
    return {"prompt": text}


class IdProblem(NamedTuple):
    param: str    # the entry, e.g. "tokens[3]"
    message: str  # "<param>: <id> is outside the vocabulary [0, V)"


def detokenize_ids_problem(field: str, ids: Sequence[int], vocab_size: int) -> IdProblem | None:
    """The first id to detokenize outside the vocabulary [0, vocab_size) (not known: [0, 2^31)),
    named by its entry: checked before the tokenizer (which would not say which) for /detokenize
    and gRPC Detokenize alike, so that an id past int32 is refused rather than failing to build
    the gRPC request."""
    vocab = vocab_size or 2 ** 31
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            return IdProblem(f"{field}[{i}]", f"{field}[{i}]: {token} is outside the vocabulary [0, {vocab})")
    return None


def tokenize_request(body: TokenizeRequest) -> tokenizer_pb2.TokenizeRequest:
    """The tokenizer's request for either form; ApiError(400) naming the parameter otherwise."""
    if body.prompt is not None and body.messages is not None:
        raise ApiError(400, "messages: set either prompt or messages, not both", param="messages")
    if body.messages is None:
        if body.prompt is None:
            raise ApiError(400, "prompt: either prompt or messages is required", param="prompt")
        if not body.prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return tokenizer_pb2.TokenizeRequest(text=body.prompt, add_special_tokens=special)
    for name in ("chat_template", "chat_template_kwargs", "tools"):
        if getattr(body, name):
            raise ApiError(400, f"{name}: is not supported by this server", param=name)
    # The tokenizer renders the template as given, ending with a generation prompt or not, and
    # adds no special tokens of its own to it (the template writes them): neither can be asked for.
    if body.continue_final_message:
        raise ApiError(400, "continue_final_message: is not supported by this server",
                       param="continue_final_message")
    if body.add_special_tokens:
        raise ApiError(400, "add_special_tokens: is not supported with messages (the chat template "
                            "writes the special tokens)", param="add_special_tokens")
    messages = chat_messages(ChatCompletionRequest.model_construct(messages=body.messages))
    return tokenizer_pb2.TokenizeRequest(chat=messages, add_generation_prompt=body.add_generation_prompt)


async def _call(work: Awaitable[T], param: str | None) -> T:
    """`work`'s result; a failure of the tokenizer or of the readiness wait as an ApiError."""
    try:
        return await work
    except GenerateError as exc:
        raise _api_error(exc.code, exc.message, param) from None
    except grpc.aio.AioRpcError as exc:
        raise _api_error(exc.code(), exc.details() or "", param) from None


def _api_error(code: grpc.StatusCode, message: str, param: str | None) -> ApiError:
    """The tokenizer's status as an HTTP error; a refusal (INVALID_ARGUMENT) names `param`, the
    client's parameter, in place of the tokenizer's own field name ("text: ..." -> "prompt: ...")."""
    status = _HTTP_STATUS.get(code, 500)
    if status != 400 or param is None:
        return ApiError(status, message)
    field, sep, rest = message.partition(": ")
    if sep and " " not in field:
        message = rest
    return ApiError(400, f"{param}: {message}", param=param)
