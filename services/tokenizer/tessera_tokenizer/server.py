"""The gRPC TokenizerService: Tokenize, Detokenize, the multiplexed TokenizeStream and
DetokenizeStream, GetModelInfo.

A thin adapter: validation and proto conversion here, the work in `tokenizer`,
`detokenizer` and `detokenize_stream` (one DetokenizeStream call's requests). The server
(`tessera.common.grpc_server`) starts first (health NOT_SERVING), loads the tokenizer in a
background thread, then turns SERVING; calls made before that get UNAVAILABLE. A tokenizer
that fails to load ends the process (exit 1).

SIGTERM: NOT_SERVING, then each open stream ends (OK) after the message in hand and the
process exits once unary calls in flight are answered (up to --drain-timeout-s). The
frontend reopens its streams on another (or the restarted) tokenizer and resumes every
request there (DetokenizeOpen.resumed_token_ids), so a rolling update fails none.

Run with `python -m tessera_tokenizer --port N` (flags below, each with an env fallback).
Prometheus metrics (see `metrics`) and an HTTP /health that agrees with grpc.health.v1 are
served on `--metrics-port`. Every request that ends on a DetokenizeStream gets one
structured log line ("detokenize request ended") tagged with the client's request id.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import threading
import time
from typing import Any, AsyncIterator, Callable, TypeVar

import grpc

from tessera.common import tls, tracing
from tessera.common.flags import add_common_flags, add_flag
from tessera.common.grpc_server import GrpcServer, run_service
from tessera.common.grpc_service import request_id_from
from tessera.common.heap import freeze_startup_heap
from tessera.common.metrics import add_metrics_flag
from tessera.common.request_rules import CHAT_ROLES
from tessera.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tessera_tokenizer import metrics
from tessera_tokenizer.chat_formats import read_chat_template
from tessera_tokenizer.detokenize_stream import DetokenizeSession
from tessera_tokenizer.tokenizer import Encoding, Tokenizer

log = logging.getLogger("tessera.tokenizer")

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name
# Work bigger than this (characters to encode, tokens to decode) runs in a worker
# thread, so that one large call does not hold up every other call on the event loop
# (the tokenizer releases the GIL for large inputs; see tokenizer.py).
_INLINE_CHARS = 4_096
_INLINE_TOKENS = 2_048

T = TypeVar("T")


class InvalidInput(ValueError):
    """Bad client input; the message names the field: "<field>: <what is wrong>"."""


def _counted(method: str):
    """Count a unary call in tessera:tokenizer_requests_total by its gRPC status code."""
    def wrap(handler):
        @functools.wraps(handler)
        async def counted(self, request, context):
            code = "OK"
            try:
                return await handler(self, request, context)
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except BaseException:
                status = context.code()
                code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
                raise
            finally:
                metrics.REQUESTS.labels(method, code).inc()
        return counted
    return wrap


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Implements tessera.v1.TokenizerService over a `Tokenizer` (set once it has loaded)."""

    def __init__(self, max_input_chars: int, max_messages: int) -> None:
        self.tokenizer: Tokenizer | None = None
        self.max_input_chars = max_input_chars
        self.max_messages = max_messages
        # Set on SIGTERM: the streams end (OK) after the message in hand, and the frontend
        # moves its requests to a new stream (resuming each one), so the process need not
        # wait the drain timeout for streams that stay open as long as the frontend runs.
        self.draining = asyncio.Event()

    async def _until_draining(self, request_iterator: AsyncIterator):
        """The stream's messages until the client ends it or the drain starts."""
        drained = asyncio.ensure_future(self.draining.wait())
        messages = request_iterator.__aiter__()
        following = None
        try:
            while True:
                following = asyncio.ensure_future(messages.__anext__())
                await asyncio.wait({following, drained}, return_when=asyncio.FIRST_COMPLETED)
                if not following.done():
                    return
                try:
                    yield following.result()
                except StopAsyncIteration:
                    return
        finally:
            drained.cancel()
            if following is not None:
                # cut short by the drain or by the client cancelling the stream, the read (done
                # or not) may end with the stream's StopAsyncIteration: taken here, so that
                # asyncio does not log it at ERROR as an exception nobody retrieved
                following.cancel()
                following.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _ready(self, context: grpc.aio.ServicerContext) -> Tokenizer:
        if self.tokenizer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "tokenizer is still loading")
        return self.tokenizer

    async def _invalid(self, context: grpc.aio.ServicerContext, method: str, exc: InvalidInput) -> None:
        log.info("%s rejected: %s", method, exc, extra={"request_id": request_id_from(context)})
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    @_counted("Tokenize")
    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest, context) -> tokenizer_pb2.TokenizeResponse:
        tokenizer = await self._ready(context)
        started = time.perf_counter()
        try:
            job, big = self._prepare(tokenizer, request)
            response = await _run(job, big)
        except InvalidInput as exc:
            await self._invalid(context, "Tokenize", exc)
        log.debug("tokenized", extra={"request_id": request_id_from(context), "tokens": len(response.token_ids),
                                      "ms": round((time.perf_counter() - started) * 1e3, 3)})
        return response

    async def TokenizeStream(
        self, request_iterator: AsyncIterator[tokenizer_pb2.TokenizeStreamRequest], context
    ) -> AsyncIterator[tokenizer_pb2.TokenizeStreamResponse]:
        """Many requests' prompts on one call. The items of a message that are small are
        answered together in one reply; a large one is tokenized on a worker thread and
        answered in a reply of its own when done. A bad item gets an error result; the
        stream goes on."""
        tokenizer = await self._ready(context)
        replies: asyncio.Queue = asyncio.Queue()
        jobs: set[asyncio.Task] = set()
        log.info("tokenize stream opened", extra={"peer": context.peer()})

        async def in_thread(item: tokenizer_pb2.TokenizeItem, job: Callable) -> None:
            result = await asyncio.to_thread(self._stream_result, item, job)
            replies.put_nowait(tokenizer_pb2.TokenizeStreamResponse(results=[result]))

        async def read() -> None:
            try:
                async for message in self._until_draining(request_iterator):
                    done = []
                    for item in message.items:
                        try:
                            job, big = self._prepare(tokenizer, item.request)
                        except InvalidInput as exc:
                            done.append(self._stream_refused(item, exc))
                            continue
                        if big:
                            task = asyncio.create_task(in_thread(item, job))
                            jobs.add(task)
                            task.add_done_callback(jobs.discard)
                        else:
                            done.append(self._stream_result(item, job))
                    if done:
                        replies.put_nowait(tokenizer_pb2.TokenizeStreamResponse(results=done))
                while jobs:  # the client closed its side: answer what is still running, then end
                    await asyncio.gather(*jobs)
            finally:
                replies.put_nowait(None)

        reader = asyncio.create_task(read(), name="tokenize-stream-reader")
        try:
            while (reply := await replies.get()) is not None:
                yield reply
            reader.result()  # re-raise a reader failure
        finally:
            reader.cancel()
            for task in list(jobs):
                task.cancel()
            log.info("tokenize stream closed", extra={"peer": context.peer()})

    def _stream_result(self, item: tokenizer_pb2.TokenizeItem, job: Callable) -> tokenizer_pb2.TokenizeResult:
        """Run one stream item's job; its result, or its error (the stream itself goes on)."""
        try:
            with tracing.remote_span("tokenize", item.traceparent, {"gen_ai.request.id": item.request_id}):
                response = job()
        except InvalidInput as exc:
            return self._stream_refused(item, exc)
        except Exception as exc:  # noqa: BLE001 (a bug in one item must not end the stream)
            log.exception("tokenize failed", extra={"request_id": item.request_id})
            metrics.REQUESTS.labels("TokenizeStream", "INTERNAL").inc()
            return tokenizer_pb2.TokenizeResult(id=item.id, error=common_pb2.RequestError(
                code="INTERNAL", message=f"tokenizer internal error: {exc!r}"))
        metrics.REQUESTS.labels("TokenizeStream", "OK").inc()
        log.debug("tokenized", extra={"request_id": item.request_id, "tokens": len(response.token_ids)})
        return tokenizer_pb2.TokenizeResult(id=item.id, response=response)

    def _stream_refused(self, item: tokenizer_pb2.TokenizeItem, exc: InvalidInput) -> tokenizer_pb2.TokenizeResult:
        log.info("TokenizeStream item rejected: %s", exc, extra={"request_id": item.request_id})
        metrics.REQUESTS.labels("TokenizeStream", "INVALID_ARGUMENT").inc()
        return tokenizer_pb2.TokenizeResult(id=item.id, error=common_pb2.RequestError(
            code="INVALID_ARGUMENT", message=str(exc)))

    def _prepare(self, tokenizer: Tokenizer, request: tokenizer_pb2.TokenizeRequest
                 ) -> tuple[Callable[[], tokenizer_pb2.TokenizeResponse], bool]:
        """Validate a TokenizeRequest (InvalidInput); return the work, observed in the tokenize
        metrics, and whether it is big enough for a worker thread."""
        encode, size = self._tokenize_job(tokenizer, request)
        timer = metrics.TOKENIZE_CHAT if request.WhichOneof("input") == "chat" else metrics.TOKENIZE_TEXT

        def job() -> tokenizer_pb2.TokenizeResponse:
            started = time.perf_counter()
            response = _tokenize_response(encode())
            timer.observe(time.perf_counter() - started)
            metrics.TOKENIZED.inc(len(response.token_ids))
            return response

        return job, size > _INLINE_CHARS

    def _tokenize_job(self, tokenizer: Tokenizer, request: tokenizer_pb2.TokenizeRequest) -> tuple[Callable, int]:
        """Validate a TokenizeRequest; return (the work to do, its size in characters)."""
        kind = request.WhichOneof("input")
        offsets = request.return_offsets
        if kind == "text":
            text = request.text
            if len(text) > self.max_input_chars:
                raise InvalidInput(f"text: {len(text)} characters is over the limit of "
                                   f"{self.max_input_chars} (--max-input-chars)")
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            return (lambda: tokenizer.encode(text, special, offsets)), len(text)
        if kind == "chat":
            messages = request.chat.messages
            if not messages:
                raise InvalidInput("chat.messages: must not be empty")
            if len(messages) > self.max_messages:
                raise InvalidInput(f"chat.messages: {len(messages)} messages is over the limit of "
                                   f"{self.max_messages} (--max-messages)")
            for i, m in enumerate(messages):
                if m.role not in CHAT_ROLES:
                    raise InvalidInput(f"chat.messages[{i}].role: unknown role {m.role!r} "
                                       f"(allowed: {', '.join(CHAT_ROLES)})")
            size = len(request.chat.tools_json) + sum(len(m.content) + len(m.tool_calls_json) for m in messages)
            if size > self.max_input_chars:
                raise InvalidInput(f"chat.messages: {size} characters of content is over the limit of "
                                   f"{self.max_input_chars} (--max-input-chars)")
            plain, tools = _chat_dicts(request.chat)
            generation_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True

            def encode_chat():
                try:
                    with tracing.child_span("chat_template"):  # a traced item's template (and encode)
                        return tokenizer.encode_chat(plain, generation_prompt, offsets, tools)
                except ValueError as exc:
                    raise InvalidInput(f"chat: {exc}") from exc

            return encode_chat, size + 64 * len(messages)  # template work grows with the count
        raise InvalidInput("input: set either text or chat")

    @_counted("Detokenize")
    async def Detokenize(self, request: tokenizer_pb2.DetokenizeRequest, context) -> tokenizer_pb2.DetokenizeResponse:
        tokenizer = await self._ready(context)
        started = time.perf_counter()
        ids = list(request.token_ids)
        bad = tokenizer.first_invalid_id(ids)
        if bad is not None:
            await self._invalid(context, "Detokenize", InvalidInput(
                f"token_ids: token id {bad} is out of range [0, {tokenizer.vocab_size})"))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await _run(lambda: tokenizer.decode(ids, skip), len(ids) > _INLINE_TOKENS)
        metrics.DETOKENIZE_UNARY.observe(time.perf_counter() - started)
        metrics.DETOKENIZED.inc(len(ids))
        log.debug("detokenized", extra={"request_id": request_id_from(context), "tokens": len(ids)})
        return tokenizer_pb2.DetokenizeResponse(text=text)

    async def DetokenizeStream(
        self, request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest], context
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeStreamResponse]:
        tokenizer = await self._ready(context)
        session = DetokenizeSession(tokenizer)
        stream_id = request_id_from(context)
        log.info("detokenize stream opened", extra={"stream_id": stream_id, "peer": context.peer()})
        metrics.STREAMS_ACTIVE.inc()
        try:
            async for message in self._until_draining(request_iterator):
                tokens = sum(len(item.new_token_ids) for item in message.items)
                before = len(session.requests)
                started = time.perf_counter()
                reply = await _run(lambda: session.process(message), tokens > _INLINE_TOKENS)
                metrics.DETOKENIZE_STREAM.observe(time.perf_counter() - started)
                metrics.DETOKENIZED.inc(tokens)
                if len(session.requests) != before:
                    metrics.STREAM_REQUESTS_ACTIVE.inc(len(session.requests) - before)
                yield reply
        finally:
            metrics.STREAMS_ACTIVE.dec()
            metrics.STREAM_REQUESTS_ACTIVE.dec(len(session.requests))
            log.info("detokenize stream closed", extra={"stream_id": stream_id,
                                                        "open_requests": len(session.requests)})
            session.close()

    @_counted("GetModelInfo")
    async def GetModelInfo(self, request: tokenizer_pb2.ModelInfoRequest, context) -> tokenizer_pb2.ModelInfo:
        tokenizer = await self._ready(context)
        info = tokenizer.info
        return tokenizer_pb2.ModelInfo(
            model_name=info.model_name,
            vocab_size=info.vocab_size,
            bos_token_id=info.bos_token_id,
            eos_token_ids=info.eos_token_ids,
            max_model_len=info.max_model_len,
            has_chat_template=info.has_chat_template,
            special_tokens=info.special_tokens,
        )


def _chat_dicts(chat: tokenizer_pb2.ChatMessages) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """The messages as the chat template takes them (tool_calls and tool_call_id only where set),
    and the tools; InvalidInput where the JSON fields are not JSON lists."""
    def json_list(field: str, text: str) -> list[Any]:
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise InvalidInput(f"{field}: not valid JSON ({exc})") from None
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise InvalidInput(f"{field}: must be a JSON list of objects")
        return value

    messages = []
    for i, m in enumerate(chat.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls_json:
            message["tool_calls"] = json_list(f"chat.messages[{i}].tool_calls_json", m.tool_calls_json)
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    tools = json_list("chat.tools_json", chat.tools_json) if chat.tools_json else None
    return messages, tools


def _tokenize_response(encoding: Encoding) -> tokenizer_pb2.TokenizeResponse:
    response = tokenizer_pb2.TokenizeResponse(token_ids=encoding.ids, text=encoding.text)
    if encoding.offsets is not None:
        response.offsets.extend([x for pair in encoding.offsets for x in pair])
    return response


async def _run(job: Callable[[], T], in_thread: bool) -> T:
    """Run `job` here, or in a worker thread when it is big."""
    return await asyncio.to_thread(job) if in_thread else job()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tessera-tokenizer", description="tessera tokenizer service")
    add_common_flags(parser, 50052, "TESSERA_TOKENIZER_PORT")
    add_flag(parser, "--model", "TESSERA_MODEL", None,
             help="HF model directory or .gguf file (unset: the embedded SmolLM2-135M-Instruct)")
    add_flag(parser, "--chat-template", "TESSERA_CHAT_TEMPLATE", None,
             help="the chat template instead of the model's: a file, or the Jinja template itself (as vLLM's "
                  "flag; unset: the model's, else its family's built-in format, e.g. Gemma's)")
    add_flag(parser, "--max-input-chars", "TESSERA_MAX_INPUT_CHARS", 1_000_000, type=int,
             help="longest text (or total chat content) Tokenize accepts, in characters")
    add_flag(parser, "--max-messages", "TESSERA_MAX_MESSAGES", 1024, type=int,
             help="most chat messages Tokenize accepts")
    add_metrics_flag(parser, "tokenizer")
    args = parser.parse_args(argv)
    tls.check_flags(parser, args)
    if args.chat_template:
        try:  # a usage error at once, not a failed load after the server started
            read_chat_template(args.chat_template)
        except ValueError as exc:
            parser.error(str(exc))
    return args


# Test-only: seconds the load waits before it starts (the health tests watch the service refuse
# calls while it loads, which a fast load leaves too little time to see).
LOAD_DELAY_ENV = "TESSERA_TOKENIZER_TEST_LOAD_DELAY_S"


def _load_in_background(model: str | None, chat_template: str | None) -> asyncio.Future:
    """Load the tokenizer in a daemon thread (so a signal during loading can exit at once)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def load() -> None:
        try:
            delay = float(os.environ.get(LOAD_DELAY_ENV) or 0)
            if delay > 0:  # test-only: a load slow enough to be seen from outside
                time.sleep(delay)
            result: Any = Tokenizer.load(model, chat_template)
            loop.call_soon_threadsafe(_settle, future, result, None)
        except BaseException as exc:  # reported through the future
            loop.call_soon_threadsafe(_settle, future, None, exc)

    threading.Thread(target=load, name="load-tokenizer", daemon=True).start()
    return future


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


async def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit code (1: the model did
    not load, or the port cannot be bound)."""
    grpc_server = GrpcServer([SERVICE_NAME], log, grace_s=args.drain_timeout_s)
    servicer = TokenizerServicer(args.max_input_chars, args.max_messages)
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, grpc_server.server)
    if await grpc_server.try_start(args.host, args.port, args.metrics_port, tls=tls.server_tls(args)) is None:
        return 1

    started = time.perf_counter()
    loading = _load_in_background(args.model, args.chat_template)
    stop_wait = asyncio.ensure_future(grpc_server.wait_for_stop())
    await asyncio.wait([loading, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if loading.done():
        try:
            servicer.tokenizer = loading.result()
        except Exception:
            log.exception("loading the tokenizer failed", extra={"model": args.model})
            code = 1
        else:
            info = servicer.tokenizer.info
            log.info("tokenizer loaded", extra={
                "model": info.model_name, "vocab_size": info.vocab_size,
                "max_model_len": info.max_model_len, "eos_token_ids": list(info.eos_token_ids),
                "chat_template": servicer.tokenizer.chat_template_source,
                "load_s": round(time.perf_counter() - started, 3)})
            freeze_startup_heap(log)
            await grpc_server.health.set(True)
            await stop_wait
    stop_wait.cancel()
    loading.cancel()

    async def drain() -> None:  # the streams end; unary calls in flight get the drain timeout
        servicer.draining.set()

    await grpc_server.stop(drain=drain)
    log.info("stopped")
    return code


def main(argv: list[str] | None = None) -> int:
    return run_service("tokenizer", serve, parse_args(argv))
