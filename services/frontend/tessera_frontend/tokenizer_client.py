"""Client of the tokenizer service.

Two parts:

* `TokenizerClient`: the unary calls (Tokenize, GetModelInfo, Detokenize), a
  readiness probe, and a cache of single-token texts (to fill TokenLogprob.token).
* `DetokenizeStream`: the ONE long-lived DetokenizeStream call the frontend keeps
  open. Each engine step's new tokens (for many requests) go out as one
  DetokenizeStreamRequest; the tokenizer answers each message with one
  DetokenizeStreamResponse in order, so replies are matched to requests by a FIFO
  of futures. If the stream breaks, every waiting future fails with
  `DetokenizeStreamError`, `generation` is bumped (the tokenizer forgot every open
  request) and the stream is reopened once the tokenizer is SERVING again.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import Iterable, Sequence

import grpc

from tessera.common.grpc_service import CLIENT_CHANNEL_OPTIONS, REQUEST_ID_KEY
from tessera.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tessera_frontend.grpc_util import drain, is_serving

log = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.5


class DetokenizeStreamError(Exception):
    """The detokenize stream is down (or broke while a message was in flight)."""


class TokenizerClient:
    """Unary calls to the tokenizer service at `addr`, plus the shared detokenize stream."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.channel = grpc.aio.insecure_channel(addr, options=CLIENT_CHANNEL_OPTIONS)
        self.stub = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel)
        self.stream = DetokenizeStream(self.stub, self.wait_serving)
        self.model_info: tokenizer_pb2.ModelInfo | None = None
        self._token_text: dict[int, str] = {}

    async def is_serving(self) -> bool:
        return await is_serving(self.channel)

    async def wait_serving(self, poll_s: float = 0.5) -> None:
        """Return once the tokenizer answers SERVING (it may still be loading its model)."""
        while not await self.is_serving():
            await asyncio.sleep(poll_s)

    async def fetch_model_info(self) -> tokenizer_pb2.ModelInfo:
        self.model_info = await self.stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest(), timeout=10)
        return self.model_info

    async def tokenize(self, request: tokenizer_pb2.TokenizeRequest, request_id: str,
                       timeout: float = 30.0) -> tokenizer_pb2.TokenizeResponse:
        return await self.stub.Tokenize(request, timeout=timeout,
                                        metadata=((REQUEST_ID_KEY, request_id),))

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True,
                         timeout: float = 10.0) -> str:
        reply = await self.stub.Detokenize(
            tokenizer_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens),
            timeout=timeout)
        return reply.text

    async def token_texts(self, token_ids: Iterable[int]) -> dict[int, str]:
        """Text of each single token (special tokens kept), cached for the process' life."""
        missing = sorted({t for t in token_ids if t not in self._token_text})
        if missing:
            texts = await asyncio.gather(*(self.detokenize([t], skip_special_tokens=False)
                                           for t in missing))
            self._token_text.update(zip(missing, texts))
        return self._token_text

    async def close(self) -> None:
        await self.stream.close()
        await self.channel.close()


class DetokenizeStream:
    """The multiplexed DetokenizeStream call: send one message per engine step, get its results."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerServiceStub, wait_ready) -> None:
        self._stub = stub
        self._wait_ready = wait_ready
        self._outbox: asyncio.Queue | None = None
        self._pending: collections.deque[asyncio.Future] = collections.deque()
        self._task: asyncio.Task | None = None
        # Bumped each time a new stream opens: requests opened on an older one are lost.
        self.generation = 0

    @property
    def connected(self) -> bool:
        return self._outbox is not None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="detokenize-stream")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def send(self, items: Sequence[tokenizer_pb2.DetokenizeItem]) -> asyncio.Future:
        """Queue one message; the future resolves to its DetokenizeResults (same order as items)."""
        if self._outbox is None:
            raise DetokenizeStreamError("the detokenize stream to the tokenizer is down (tokenizer unavailable)")
        future = asyncio.get_running_loop().create_future()
        self._pending.append(future)
        self._outbox.put_nowait(tokenizer_pb2.DetokenizeStreamRequest(items=items))
        return future

    def cancel(self, keys: Iterable[str]) -> None:
        """Tell the tokenizer to forget these requests; fire and forget (no-op when disconnected)."""
        items = [tokenizer_pb2.DetokenizeItem(request_id=k, cancel=True) for k in keys]
        if not items or self._outbox is None:
            return
        future = self.send(items)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # result is not needed

    async def _run(self) -> None:
        """Keep one stream open: (re)connect whenever the tokenizer is SERVING."""
        while True:
            await self._wait_ready()
            reason = await self._serve_one_stream()
            log.warning("detokenize stream closed; reconnecting", extra={"reason": reason})
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _serve_one_stream(self) -> str:
        outbox: asyncio.Queue = asyncio.Queue()
        pending: collections.deque[asyncio.Future] = collections.deque()
        call = self._stub.DetokenizeStream(drain(outbox))
        self._outbox, self._pending = outbox, pending
        self.generation += 1
        log.info("detokenize stream open", extra={"generation": self.generation})
        reason = "the tokenizer closed the detokenize stream"
        try:
            async for response in call:
                if not pending:
                    log.error("detokenize stream: reply without a request; ignored")
                    continue
                future = pending.popleft()
                if not future.done():
                    future.set_result(list(response.results))
        except grpc.aio.AioRpcError as exc:
            reason = f"detokenize stream failed: {exc.code().name}: {exc.details()}"
        except Exception as exc:  # a bug must not end the reconnect loop
            log.exception("detokenize stream reader failed")
            reason = f"internal error: {exc!r}"
        finally:
            self._outbox = None
            outbox.put_nowait(None)
            call.cancel()
            error = DetokenizeStreamError(reason)
            while pending:
                future = pending.popleft()
                if not future.done():
                    future.set_exception(error)
        return reason

