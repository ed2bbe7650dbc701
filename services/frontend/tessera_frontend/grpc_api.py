"""The public gRPC API: FrontendService (Generate streams, Complete returns whole; the LoRA
adapters: ListLoRAAdapters, and LoadLoRAAdapter / UnloadLoRAAdapter on every engine replica
when --allow-runtime-lora-updating, else FAILED_PRECONDITION; `lora`), and the calls that reach
no engine (ListModels, Tokenize, Detokenize, GetServerInfo: `grpc_info`).

Every request is validated first (`validation.validate_request`): a bad field is
answered INVALID_ARGUMENT with a message that starts with the field's path in the
request ("sampling_params.temperature: ...", `public_message`). A
`lora_name` the engines' lists do not have is NOT_FOUND naming it. Then
it is admitted (`admission`): past the in-flight cap it is answered
RESOURCE_EXHAUSTED at once. The request id is the client's (field, else
`x-request-id` metadata) or a fresh uuid, and is echoed on every message.
Failures from the tokenizer or the engine keep their status code
(INVALID_ARGUMENT, UNAVAILABLE, ...). When the client cancels the call the
handler is cancelled, which closes the generate() iterator and aborts the
request in the engine.
"""
from __future__ import annotations

import contextlib
import logging
import uuid

import grpc

from tessera.common.grpc_service import request_id_from
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tessera_frontend.admission import AdmissionController, Overloaded, Ticket
from tessera_frontend.async_llm import AsyncLLM, GenerateError, Prompt
from tessera_frontend.grpc_info import InfoCalls
from tessera_frontend.grpc_util import StatusError
from tessera_frontend.lora import LoRAError, LoRARegistry
from tessera_frontend.metrics import RequestTracker, grpc_tracker, record_rejected
from tessera_frontend.output_processor import SampleOutput
from tessera_frontend.validation import Limits, ValidationError, validate_request, validate_request_id

log = logging.getLogger(__name__)

# The fields of a GenerateRequest's sampling_params: the rules (validation, request_rules, the
# engine) name them bare, the gRPC answer by their path in the request.
_SAMPLING_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def _prompt_of(request: frontend_pb2.GenerateRequest) -> Prompt:
    which = request.WhichOneof("prompt")
    if which == "text":
        return request.text
    if which == "chat":
        return request.chat
    return list(request.token_ids.ids)


class FrontendServicer(frontend_pb2_grpc.FrontendServiceServicer):
    def __init__(self, llm: AsyncLLM, limits: Limits, admission: AdmissionController,
                 lora: LoRARegistry | None = None, served_model_name: str | None = None) -> None:
        self._llm = llm
        self._limits = limits
        self._admission = admission
        self._lora = lora or LoRARegistry(llm.engine)
        self._info = InfoCalls(llm, limits, admission, self._lora, served_model_name)

    async def Generate(self, request: frontend_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        with grpc_tracker(context) as tracker:
            request_id, ticket = await self._admit(request, context, tracker)
            with ticket:
                async with self._outputs(request, request_id, context) as outputs:
                    async for out in outputs:
                        tracker.on_output(out.index, len(out.token_ids), out.usage)
                        await context.write(_response(out))

    async def Complete(self, request: frontend_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> frontend_pb2.GenerateResult:
        with grpc_tracker(context) as tracker:
            request_id, ticket = await self._admit(request, context, tracker)
            with ticket:
                return await self._complete(request, request_id, context, tracker)

    async def _complete(self, request: frontend_pb2.GenerateRequest, request_id: str,
                        context: grpc.aio.ServicerContext, tracker: RequestTracker) -> frontend_pb2.GenerateResult:
        n = request.sampling_params.n if request.sampling_params.HasField("n") else 1
        choices = [frontend_pb2.Choice(index=i) for i in range(n)]
        result = frontend_pb2.GenerateResult(request_id=request_id)
        async with self._outputs(request, request_id, context) as outputs:
            async for out in outputs:
                tracker.on_output(out.index, len(out.token_ids), out.usage)
                if out.prompt_logprobs:
                    result.prompt_logprobs.extend(out.prompt_logprobs)
                choice = choices[out.index]
                choice.text += out.text
                choice.token_ids.extend(out.token_ids)
                choice.logprobs.extend(out.logprobs)
                if out.finished:
                    choice.finish_reason = out.finish_reason
                    if out.stop_reason is not None:
                        choice.stop_reason = out.stop_reason
                    if out.stop_token_id is not None:
                        choice.stop_token_id = out.stop_token_id
                if out.usage is not None:
                    result.usage.CopyFrom(out.usage)
        result.choices.extend(choices)
        return result

    async def _admit(self, request: frontend_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                     tracker: RequestTracker) -> tuple[str, Ticket]:
        """Validate and admit; return the request id to use (the caller's when given) and the ticket."""
        request_id = request.request_id or request_id_from(context) or uuid.uuid4().hex
        tracker.set_request_id(request_id[:64])
        try:
            validate_request(request, self._limits)
            if not request.request_id:
                validate_request_id_metadata(request_id)
            await self._check_lora(request.lora_name, request_id, context)
            ticket = self._admission.admit()
        except ValidationError as exc:
            message = public_message(str(exc))
            log.info("request rejected", extra={"request_id": request_id[:64], "error": message})
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        except Overloaded as exc:
            record_rejected("grpc", "max_inflight_requests")
            log.warning("request refused: overloaded", extra={"request_id": request_id,
                                                              "in_flight": self._admission.in_flight})
            # the client's hint, as HTTP's Retry-After: 1 (tessera.client waits this long before its retry)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), trailing_metadata=(("retry-after", "1"),))
        return request_id, ticket

    async def _check_lora(self, lora_name: str, request_id: str, context: grpc.aio.ServicerContext) -> None:
        """NOT_FOUND for an adapter the engines' lists do not have (no list yet: the engine decides)."""
        if not lora_name or not self._lora.known or await self._lora.find(lora_name) is not None:
            return
        served = [a.name for a in self._lora.served().adapters]
        message = (f"lora_name: the LoRA adapter {lora_name!r} is not served ("
                   + (f"served: {', '.join(served)})" if served else "no adapter is served)"))
        log.info("request rejected", extra={"request_id": request_id[:64], "error": message})
        await context.abort(grpc.StatusCode.NOT_FOUND, message)

    async def ListLoRAAdapters(self, request: common_pb2.ListLoRAAdaptersRequest,
                               context: grpc.aio.ServicerContext) -> common_pb2.LoRAAdapters:
        return await self._lora.list()

    async def LoadLoRAAdapter(self, request: common_pb2.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext) -> common_pb2.LoRAAdapter:
        try:
            return await self._lora.load(request.lora_name, request.lora_path)
        except LoRAError as exc:
            await context.abort(exc.code, exc.message)

    async def UnloadLoRAAdapter(self, request: common_pb2.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext) -> common_pb2.LoRAAdapter:
        try:
            return await self._lora.unload(request.lora_name)
        except LoRAError as exc:
            await context.abort(exc.code, exc.message)

    async def ListModels(self, request: frontend_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> frontend_pb2.ListModelsResponse:
        async with _status_of(context, "ListModels"):
            return await self._info.list_models()

    async def Tokenize(self, request: frontend_pb2.FrontendServiceTokenizeRequest,
                       context: grpc.aio.ServicerContext) -> frontend_pb2.FrontendServiceTokenizeResponse:
        async with _status_of(context, "Tokenize"):
            return await self._info.tokenize(request)

    async def Detokenize(self, request: frontend_pb2.FrontendServiceDetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> frontend_pb2.FrontendServiceDetokenizeResponse:
        async with _status_of(context, "Detokenize"):
            return await self._info.detokenize(request)

    async def GetServerInfo(self, request: frontend_pb2.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> frontend_pb2.GetServerInfoResponse:
        async with _status_of(context, "GetServerInfo"):
            return await self._info.server_info()

    @contextlib.asynccontextmanager
    async def _outputs(self, request: frontend_pb2.GenerateRequest, request_id: str,
                       context: grpc.aio.ServicerContext):
        """generate()'s iterator, closed on exit (which aborts an unfinished request);
        a GenerateError becomes the call's status."""
        outputs = self._llm.generate(request_id, _prompt_of(request), request.sampling_params,
                                     request.priority, lora_name=request.lora_name)
        try:
            async with contextlib.aclosing(outputs):
                yield outputs
        except GenerateError as exc:
            message = public_message(exc.message) if exc.code == grpc.StatusCode.INVALID_ARGUMENT else exc.message
            log.info("request failed", extra={"request_id": request_id, "code": exc.code.name,
                                              "error": message})
            await context.abort(exc.code, message)


@contextlib.asynccontextmanager
async def _status_of(context: grpc.aio.ServicerContext, call: str):
    """A StatusError raised inside becomes the call's status."""
    try:
        yield
    except StatusError as exc:
        log.info("call failed", extra={"call": call, "code": exc.code.name, "error": exc.message})
        await context.abort(exc.code, exc.message)


def public_message(message: str) -> str:
    """A refusal's message as the gRPC API words it: one that starts with a SamplingParams field
    ("temperature: ...", "logit_bias[5]: ...") names it by its path in the GenerateRequest
    ("sampling_params.temperature: ..."); any other message is left as it is."""
    field, sep, _ = message.partition(": ")
    root = field.split("[", 1)[0].split(".", 1)[0]
    if sep and " " not in field and root in _SAMPLING_FIELDS:
        return f"sampling_params.{message}"
    return message


def _response(out: SampleOutput) -> frontend_pb2.GenerateResponse:
    response = frontend_pb2.GenerateResponse(
        request_id=out.request_id, index=out.index, text=out.text, token_ids=out.token_ids,
        logprobs=out.logprobs, finish_reason=out.finish_reason)
    if out.stop_reason is not None:
        response.stop_reason = out.stop_reason
    if out.usage is not None:
        response.usage.CopyFrom(out.usage)
    if out.prompt_logprobs:
        response.prompt_logprobs.extend(out.prompt_logprobs)
    if out.stop_token_id is not None:
        response.stop_token_id = out.stop_token_id
    return response


def validate_request_id_metadata(request_id: str) -> None:
    """The x-request-id metadata obeys the request_id field's rules (named as the header)."""
    try:
        validate_request_id(request_id)
    except ValidationError as exc:
        raise ValidationError("x-request-id", exc.message) from None
