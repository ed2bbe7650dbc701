"""The OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions, /v1/models, /health
(and, with --allow-runtime-lora-updating, vLLM's LoRA load / unload routes: `lora_api`).

This module is the HTTP side: routes, admission, generation plumbing, server-sent
events, disconnects and error statuses. The response bodies and stream chunks are
built by `openai_formatters`.

A request goes: body parsed (pydantic; a bad body is 400 naming the field) ->
messages / prompts and sampling parameters translated and range-checked (400) ->
frontend ready (else 503 after AsyncLLM's short wait) and model known (else 404:
the base model's name, or a LoRA adapter the engines serve, which the request then runs
with, as vLLM) -> admitted (429 past --max-inflight-requests) -> AsyncLLM.generate, once per
prompt (a completions batch runs its prompts concurrently; choice index =
prompt * n + sample).

Chat with tools: tools and tool_choice are checked with the rest (`chat_tools`), the tools
go to the chat template, a required or named tool_choice constrains the output, and the
formatter parses the reply's tool calls out (`tool_calls`).

The first output is awaited before the response starts, so failures found before
generation (tokenizer or engine refusals) still get a proper status. Streams are
server-sent events: one chunk per choice per engine step, a final usage chunk
when stream_options.include_usage, then `data: [DONE]`; a failure after the
stream started is sent as an {"error": ...} event before [DONE]. When the client
disconnects, the request's generators are closed, which aborts it in the engine
(for a stream, Starlette cancels the body on http.disconnect; before the stream
or for a whole response, a watcher on the ASGI receive channel does).

Every error body is OpenAI's {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.v1 import common_pb2
from tessera_frontend.admission import AdmissionController, Overloaded, Ticket
from tessera_frontend.async_llm import AsyncLLM, GenerateError, Prompt
from tessera_frontend.http_limits import BodyLimit, check_unicode
from tessera_frontend.lora import LoRARegistry
from tessera_frontend.lora_api import add_lora_routes
from tessera_frontend.metrics import REQUESTS, RequestTracker, record_rejected
from tessera_frontend.openai_formatters import (ChatFormatter, CompletionFormatter, Formatter, IndexedOutput,
                                                Usage)
from tessera_frontend.openai_protocol import (ApiError, ChatCompletionRequest, CompletionRequest, best_of_extra,
                                              chat_messages, chat_tools, completion_prompts, openai_param,
                                              sampling_params, validation_error_param)
from tessera_frontend.tokenize_api import add_tokenize_routes
from tessera_frontend.validation import Limits, ValidationError, validate_request_id

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # seconds, on 429 answers

REQUEST_ID_HEADER = "x-request-id"

_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
                grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


def create_app(llm: AsyncLLM, limits: Limits, admission: AdmissionController,
               served_model_name: str | None = None, lora: LoRARegistry | None = None) -> FastAPI:
    """The FastAPI application serving the OpenAI-compatible API over `llm`; with `lora`, its
    adapters are models too, and its load / unload routes exist when it allows updates."""
    api = OpenAIApi(llm, limits, admission, served_model_name, lora)
    app = FastAPI(title="tessera", description="OpenAI-compatible API of the tessera frontend",
                  docs_url=None, redoc_url=None)
    app.state.api = api
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        # 429 (the frontend's in-flight cap, the engine's waiting cap) is load that passes:
        # Retry-After tells clients and proxies when to try again instead of at once
        headers = {"retry-after": str(RETRY_AFTER_S)} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client went away

    @app.exception_handler(RequestValidationError)
    async def body_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = validation_error_param(tuple(first.get("loc", ())))
        message = first.get("msg", "invalid request body")
        REQUESTS.labels("http", "400").inc()
        if first.get("type") == "json_invalid":
            param, message = None, f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}"
        return JSONResponse(ApiError(400, f"{param}: {message}" if param else message, param=param).body(),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), code=code).body(),
                            status_code=exc.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not llm.ready:
            raise ApiError(503, "not ready: waiting for the tokenizer and an engine")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": await api.model_cards()})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> JSONResponse:
        name, adapter = await api.served_model(model)
        return JSONResponse(api.model_card(name) if adapter is None else api.adapter_card(adapter, name))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.completions(body, request)

    add_tokenize_routes(app, api)
    if lora is not None and lora.allow_updates:
        add_lora_routes(app, lora)
    return app


class OpenAIApi:
    """The endpoints' logic, apart from FastAPI's routing."""

    def __init__(self, llm: AsyncLLM, limits: Limits, admission: AdmissionController,
                 served_model_name: str | None, lora: LoRARegistry | None = None) -> None:
        self.llm = llm
        self.limits = limits
        self.admission = admission
        self.served_model_name = served_model_name
        self.lora = lora
        self.created = int(time.time())

    # -- models ---------------------------------------------------------------------------
    async def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        await _api_call(self.llm.wait_ready())
        return self.llm.model_name

    async def check_model(self, model: str | None) -> str:
        """The name a request's answer carries (the base model's, or the adapter's); 404 when
        it names neither the base model nor a served LoRA adapter."""
        return (await self.resolve_model(model))[0]

    async def resolve_model(self, model: str | None) -> tuple[str, str]:
        """(the name the answer carries, the LoRA adapter to run with: "" for the base model) of a
        request's `model`; 404 naming it when it is neither the base model nor a served adapter."""
        name, adapter = await self.served_model(model)
        return (name, "") if adapter is None else (adapter.name, adapter.name)

    async def served_model(self, model: str | None) -> tuple[str, common_pb2.LoRAAdapter | None]:
        """(the base model's name, the served LoRA adapter `model` names, or None: omitted or the
        base model's name is the base model); 404 naming `model` when it is neither."""
        name = await self.model_name()
        if not model or model == name:
            return name, None
        if self.lora is not None:
            if not self.lora.known:  # the engines' lists come in with readiness
                await _api_call(self.llm.wait_ready())
            adapter = await self.lora.find(model)
            if adapter is not None:
                return name, adapter
        adapters = [a.name for a in self.lora.served().adapters] if self.lora is not None else []
        served = f"`{name}`" + (f" and the LoRA adapters {', '.join(f'`{a}`' for a in adapters)}" if adapters else "")
        raise ApiError(404, f"The model `{model}` does not exist (this server serves {served}).",
                       param="model", code="model_not_found")

    async def model_cards(self) -> list[dict]:
        """/v1/models: the base model's card, then one per served LoRA adapter (vLLM's fields)."""
        name = await self.model_name()
        adapters = (await self.lora.list()).adapters if self.lora is not None else []
        return [self.model_card(name), *(self.adapter_card(a, name) for a in adapters)]

    def model_card(self, name: str) -> dict:
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "tessera"}
        if self.llm.max_model_len:
            card["max_model_len"] = self.llm.max_model_len
        return card

    def adapter_card(self, adapter: common_pb2.LoRAAdapter, base: str) -> dict:
        """A LoRA adapter's card: vLLM's, `root` its directory and `parent` the base model."""
        return {**self.model_card(adapter.name), "root": adapter.path, "parent": base}

    # -- endpoints -----------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request):
        async with _tracked(RequestTracker("http")) as tracker:
            check_unicode(body)
            request_id = _request_id(body, request)
            tracker.set_request_id(request_id)
            tools = chat_tools(body)
            messages = chat_messages(body)
            params = sampling_params(body, self.limits, tools)
            model, lora_name = await self.resolve_model(body.model)
            return await self._serve(request, body, request_id, model, [messages], params, default_max_tokens=None,
                                     formatter=ChatFormatter(body, request_id, model, tools), tracker=tracker,
                                     lora_name=lora_name)

    async def completions(self, body: CompletionRequest, request: Request):
        async with _tracked(RequestTracker("http")) as tracker:
            check_unicode(body)
            request_id = _request_id(body, request)
            tracker.set_request_id(request_id)
            prompts = completion_prompts(body, self.limits)
            params = sampling_params(body, self.limits)
            model, lora_name = await self.resolve_model(body.model)
            return await self._serve(request, body, request_id, model, prompts, params, default_max_tokens=16,
                                     formatter=CompletionFormatter(body, request_id, model), tracker=tracker,
                                     keep=(body.n or 1) if best_of_extra(body) else None, lora_name=lora_name)

    async def _serve(self, request: Request, body, request_id: str, model: str, prompts: Sequence[Prompt],
                     params: common_pb2.SamplingParams, default_max_tokens: int | None, formatter: Formatter,
                     tracker: RequestTracker, keep: int | None = None, lora_name: str = ""):
        """Answer the request; `tracker` is finished here for a whole response, by the stream's close for a stream.
        keep: answer only this many of each prompt's samples, the best (best_of; not streamed).
        lora_name: the LoRA adapter to run with ("": the base model)."""
        try:
            ticket = self.admission.admit(len(prompts))
        except Overloaded as exc:
            record_rejected("http", "max_inflight_requests")
            log.warning("request refused: overloaded", extra={"request_id": request_id,
                                                              "in_flight": self.admission.in_flight})
            raise ApiError(429, str(exc), code="rate_limit_exceeded") from None
        n = params.n if params.HasField("n") else 1
        outputs = _generate_all(self.llm, request_id, prompts, params, body.priority, default_max_tokens, n, tracker,
                                lora_name)
        headers = {REQUEST_ID_HEADER: request_id}
        if body.stream:
            try:
                first = await _unless_disconnected(request, _first_output(outputs, body))
            except BaseException:
                await _close(outputs, ticket)
                raise
            status = {"code": 499}  # what the stream ended with; 499 (client closed) unless it ran to the end

            async def on_close() -> None:
                try:
                    await _close(outputs, ticket)
                finally:
                    tracker.finish(status["code"])
            return _EventStream(event_stream(formatter, first, outputs, body, status), on_close=on_close,
                                headers=headers)
        try:
            collected = await _unless_disconnected(request, _collect(outputs, body))
        finally:
            await _close(outputs, ticket)
        if keep is not None:
            collected, n = best_of_choices(collected, n, keep, strip_logprobs=body.logprobs is None), keep
        response = JSONResponse(formatter.response(collected, n * len(prompts)), headers=headers)
        tracker.finish(200)
        return response


@contextlib.asynccontextmanager
async def _tracked(tracker: RequestTracker):
    """Finish `tracker` with the HTTP status of an error that ends the handler (a success is finished
    where the answer is complete: the whole response, or the end of the event stream)."""
    try:
        yield tracker
    except ApiError as exc:
        tracker.finish(exc.status)
        raise
    except (ClientGone, asyncio.CancelledError):
        tracker.finish(499)
        raise
    except Exception as exc:
        tracker.finish(500, error=repr(exc))
        raise


# -- generation plumbing ------------------------------------------------------------------------
async def _generate_all(llm: AsyncLLM, request_id: str, prompts: Sequence[Prompt],
                        params: common_pb2.SamplingParams, priority: int, default_max_tokens: int | None,
                        n: int, tracker: RequestTracker, lora_name: str = "") -> AsyncIterator[IndexedOutput]:
    """Every prompt's outputs, interleaved as they come, each with its choice index (and told to `tracker`)."""
    if len(prompts) == 1:
        async with contextlib.aclosing(llm.generate(request_id, prompts[0], params, priority,
                                                    default_max_tokens, lora_name)) as outputs:
            async for out in outputs:
                tracker.on_output(out.index, len(out.token_ids), out.usage)
                yield IndexedOutput(out.index, out)
        return
    # Bounded: a client that reads slowly holds the pumps back, and each prompt's outputs
    # then merge in its request's OutputCollector instead of piling up here.
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(prompts))
    done = object()

    async def pump(i: int, prompt: Prompt) -> None:
        try:
            async with contextlib.aclosing(llm.generate(f"{request_id}-{i}", prompt, params, priority,
                                                        default_max_tokens, lora_name)) as outputs:
                async for out in outputs:
                    await queue.put(IndexedOutput(i * n + out.index, out))
            await queue.put(done)
        except Exception as exc:  # GenerateError and anything else ends the whole request
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                tracker.on_output(item.index, len(item.output.token_ids), item.output.usage)
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def best_of_choices(collected: list[IndexedOutput], n: int, keep: int, strip_logprobs: bool) -> list[IndexedOutput]:
    """best_of: of each prompt's n samples, the `keep` whose tokens have the highest summed
    logprob (ties: the lower index), renumbered prompt * keep + rank; their logprobs dropped
    where the client did not ask for them (they were asked of the engine to rank by)."""
    score: dict[int, float] = {}
    for item in collected:
        score[item.index] = score.get(item.index, 0.0) + sum(p.chosen.logprob for p in item.output.logprobs)
    new_index: dict[int, int] = {}
    for prompt in sorted({i // n for i in score}):
        ranked = sorted((i for i in score if i // n == prompt), key=lambda i: (-score[i], i))
        for rank, i in enumerate(ranked[:keep]):
            new_index[i] = prompt * keep + rank
    out = []
    for item in collected:
        if item.index in new_index:
            output = dataclasses.replace(item.output, logprobs=[]) if strip_logprobs else item.output
            out.append(IndexedOutput(new_index[item.index], output))
        elif item.output.usage is not None:  # the prompt's usage (all samples) rides on its last output
            carrier = dataclasses.replace(item.output, text="", token_ids=[], logprobs=[], prompt_logprobs=None,
                                          finish_reason=common_pb2.FINISH_REASON_UNSPECIFIED)
            out.append(IndexedOutput((item.index // n) * keep, carrier))
    return out


async def _first_output(outputs: AsyncIterator[IndexedOutput], body) -> IndexedOutput:
    try:
        return await outputs.__anext__()
    except GenerateError as exc:
        raise _from_generate_error(exc, body) from None
    except StopAsyncIteration:
        raise ApiError(500, "the request produced no output") from None


async def _collect(outputs: AsyncIterator[IndexedOutput], body) -> list[IndexedOutput]:
    try:
        return [item async for item in outputs]
    except GenerateError as exc:
        raise _from_generate_error(exc, body) from None


async def _close(outputs: AsyncIterator[IndexedOutput], ticket: Ticket) -> None:
    """Close the generators (aborting whatever still runs) and give the admission slots back."""
    try:
        await outputs.aclose()
    finally:
        ticket.release()


async def _unless_disconnected(request: Request, work: Awaitable):
    """`work`'s result, unless the client disconnects first: then `work` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    log.info("client disconnected before the answer was ready")
    raise ClientGone()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _api_call(work: Awaitable):
    try:
        return await work
    except GenerateError as exc:
        raise _from_generate_error(exc, None) from None


def _from_generate_error(exc: GenerateError, body) -> ApiError:
    status = _HTTP_STATUS.get(exc.code, 500)
    param = None
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
        field, sep, _ = exc.message.partition(":")
        if field == "tokenizer":  # the tokenizer refused the prompt
            field = "prompt"
        if sep and body is not None:
            param = openai_param(field.strip(), body)
    code = "rate_limit_exceeded" if status == 429 else None
    return ApiError(status, exc.message, param=param, code=code)


def _request_id(body, request: Request) -> str:
    request_id = body.request_id or request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    try:
        validate_request_id(request_id)
    except ValidationError as exc:
        raise ApiError(400, str(exc), param="request_id") from None
    return request_id


# -- streaming ---------------------------------------------------------------------------------
class _EventStream(StreamingResponse):
    """A server-sent-event response that runs `on_close` however it ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={**headers, "cache-control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def event_stream(formatter: Formatter, first: IndexedOutput, outputs: AsyncIterator[IndexedOutput],
                       body, status: dict) -> AsyncIterator[str]:
    """The server-sent events of a streamed response: the formatter's chunks for `first` and every
    later output, the usage chunk when asked, `data: [DONE]`; a failure is sent as an error event
    before [DONE]. `status["code"]` is set to how it ended (200, or the error's HTTP status)."""
    usage = Usage()
    try:
        for chunk in formatter.stream_start():
            yield _sse(chunk)
        item: IndexedOutput | None = first
        while item is not None:
            usage.add(item.output)
            for chunk in formatter.stream_chunks(item.index, item.output):
                yield _sse(chunk)
            item = await anext(outputs, None)
        if body.include_usage:
            yield _sse(formatter.usage_chunk(usage.as_dict()))
        status["code"] = 200
    except GenerateError as exc:
        error = _from_generate_error(exc, body)
        status["code"] = error.status
        yield _sse(error.body())
    yield "data: [DONE]\n\n"
