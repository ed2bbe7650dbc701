"""FrontendService's calls that reach no engine: ListModels, Tokenize, Detokenize, GetServerInfo.

What a client that has only the gRPC API needs beside Generate: the models it may name (the
HTTP API's /v1/models), the tokenizer (its /tokenize and /detokenize: the same tokenizer client
calls, the same checks and messages) and the limits the frontend checks requests against. None
is admitted or counted as a generation request.

Errors are StatusError(code, message): INVALID_ARGUMENT with a message that starts with the
field's name, UNAVAILABLE while the frontend is not ready (no tokenizer or engine yet) or the
tokenizer is unreachable, DEADLINE_EXCEEDED when the tokenizer does not answer in time.
"""
from __future__ import annotations

import importlib.metadata
import uuid

import grpc

from tessera.v1 import frontend_pb2, tokenizer_pb2
from tessera_frontend.admission import AdmissionController
from tessera_frontend.async_llm import AsyncLLM
from tessera_frontend.grpc_util import StatusError
from tessera_frontend.lora import LoRARegistry
from tessera_frontend.tokenize_api import detokenize_ids_problem
from tessera_frontend.validation import MAX_REQUEST_ID_CHARS, Limits, chat_problem


def tessera_version() -> str:
    """The installed tessera-common package's version ("unknown" when it is not installed)."""
    try:
        return importlib.metadata.version("tessera-common")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def tokenizer_request(request: frontend_pb2.FrontendServiceTokenizeRequest) -> tokenizer_pb2.TokenizeRequest:
    """The tokenizer's request for a Tokenize call; StatusError(INVALID_ARGUMENT) naming the field
    otherwise (the checks of the HTTP /tokenize and of a Generate prompt)."""
    which = request.WhichOneof("input")
    if which is None:
        raise _invalid("input", "one of text or chat is required")
    if which == "text":
        if not request.text:
            raise _invalid("text", "must not be empty")
        if request.HasField("add_generation_prompt"):
            raise _invalid("add_generation_prompt", "applies to chat only")
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return tokenizer_pb2.TokenizeRequest(text=request.text, add_special_tokens=special,
                                             return_offsets=request.return_offsets)
    problem = chat_problem(request.chat)
    if problem is not None:
        raise _invalid("chat.messages" if problem.index is None else f"chat.messages[{problem.index}]",
                       problem.message)
    # The tokenizer renders the template as written, which writes the special tokens itself.
    if request.add_special_tokens:
        raise _invalid("add_special_tokens", "is not supported with chat (the chat template writes the "
                                             "special tokens)")
    generation_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
    return tokenizer_pb2.TokenizeRequest(chat=request.chat, add_generation_prompt=generation_prompt,
                                         return_offsets=request.return_offsets)


class InfoCalls:
    """The four calls' logic over the frontend's AsyncLLM, limits, admission and LoRA registry."""

    def __init__(self, llm: AsyncLLM, limits: Limits, admission: AdmissionController, lora: LoRARegistry,
                 served_model_name: str | None = None) -> None:
        self._llm = llm
        self._limits = limits
        self._admission = admission
        self._lora = lora
        self._served_model_name = served_model_name

    async def _model_name(self) -> str:
        await self._llm.wait_ready()  # GenerateError(UNAVAILABLE), a StatusError
        return self._served_model_name or self._llm.model_name or ""

    async def list_models(self) -> frontend_pb2.ListModelsResponse:
        name = await self._model_name()
        max_model_len = self._llm.max_model_len or 0
        models = [frontend_pb2.Model(id=name, root=self._llm.model_name or "", max_model_len=max_model_len)]
        for adapter in (await self._lora.list()).adapters:
            models.append(frontend_pb2.Model(id=adapter.name, root=adapter.path, parent=name,
                                             max_model_len=max_model_len))
        return frontend_pb2.ListModelsResponse(models=models)

    async def tokenize(self, request: frontend_pb2.FrontendServiceTokenizeRequest
                       ) -> frontend_pb2.FrontendServiceTokenizeResponse:
        asked = tokenizer_request(request)
        await self._llm.wait_ready()
        tokenizer = self._llm.tokenizer
        # a TokenizeError (a StatusError) keeps the tokenizer's status; the id is for logs only
        reply = await tokenizer.tokenize(asked, f"tok-{uuid.uuid4().hex}")
        answer = frontend_pb2.FrontendServiceTokenizeResponse(
            token_ids=reply.token_ids, text=reply.text, max_model_len=self._llm.max_model_len or 0,
            offsets=reply.offsets)
        if request.return_token_strs:
            texts = await _tokenizer_call(tokenizer.token_texts(reply.token_ids))
            answer.token_strs.extend(texts[t] for t in reply.token_ids)
        return answer

    async def detokenize(self, request: frontend_pb2.FrontendServiceDetokenizeRequest
                         ) -> frontend_pb2.FrontendServiceDetokenizeResponse:
        await self._llm.wait_ready()
        tokenizer = self._llm.tokenizer
        problem = detokenize_ids_problem("token_ids", request.token_ids, tokenizer.model_info.vocab_size)
        if problem is not None:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, problem.message)
        text = await _tokenizer_call(tokenizer.detokenize(list(request.token_ids),
                                                          skip_special_tokens=request.skip_special_tokens))
        return frontend_pb2.FrontendServiceDetokenizeResponse(text=text)

    async def server_info(self) -> frontend_pb2.GetServerInfoResponse:
        name = await self._model_name()
        info = self._llm.tokenizer.model_info
        limits = self._limits
        return frontend_pb2.GetServerInfoResponse(
            version=tessera_version(), model=name, max_model_len=self._llm.max_model_len or 0,
            vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids, has_chat_template=info.has_chat_template,
            max_inflight_requests=self._admission.max_inflight, max_n=limits.max_n,
            max_logprobs=limits.max_logprobs, max_stop=limits.max_stop, max_stop_chars=limits.max_stop_chars,
            max_stop_token_ids=limits.max_stop_token_ids, max_logit_bias=limits.max_logit_bias,
            max_request_id_chars=MAX_REQUEST_ID_CHARS, kv_cache_tokens=self._llm.engine.kv_cache_tokens or 0,
            allow_runtime_lora_updating=self._lora.allow_updates)


def _invalid(field: str, message: str) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


async def _tokenizer_call(work):
    """`work`'s result; the tokenizer's failed unary call as a StatusError with its status."""
    try:
        return await work
    except grpc.aio.AioRpcError as exc:
        raise StatusError(exc.code(), exc.details() or "the tokenizer failed") from None

