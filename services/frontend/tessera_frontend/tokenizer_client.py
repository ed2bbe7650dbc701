"""Client of the tokenizer service.

Three parts:

* `TokenizerClient`: tokenize() (on the tokenize stream), the unary calls
  (GetModelInfo, Detokenize), a readiness probe, and a cache of single-token texts
  (to fill TokenLogprob.token). It holds a channel to every tokenizer replica
  (`--tokenizer-addr`: one address or several, comma-separated; a DNS name resolving to
  several addresses is one replica each, as for engines); one replica at a time, the
  active one, carries the streams and the calls, the others stand by. When the active
  replica's streams break (a crash, a drain, a rollout), they reopen on the first
  replica answering SERVING, and the requests in flight resume there (see
  OutputProcessor): the same path as a restart of a lone tokenizer.
* `TokenizeStream`: the ONE long-lived TokenizeStream call for every request's
  prompt: no call set-up per request, and the prompts of a burst of requests
  travel as one message. Items carry ids; replies resolve them by id.
* `DetokenizeStream`: the ONE long-lived DetokenizeStream call the frontend keeps
  open. Each engine step's new tokens (for many requests) go out as one
  DetokenizeStreamRequest; the tokenizer answers each message with one
  DetokenizeStreamResponse in order, so replies are matched to requests by a FIFO
  of futures. If the stream breaks, every waiting future fails with
  `DetokenizeStreamError`, `generation` is bumped (the tokenizer forgot every open
  request) and the stream is reopened once the tokenizer is SERVING again. The
  tokenize stream reconnects the same way (its waiting prompts fail with
  `TokenizeStreamError`).

Every wait on the tokenizer has a bound (`--tokenizer-timeout-s`, default 30 s): a
prompt waits that long for its tokens (DEADLINE_EXCEEDED), and a stream whose oldest
message has had no answer for that long is broken off as if the tokenizer had closed
it (a process that hangs or stops answering keeps its TCP connection open): its
waiting requests fail with UNAVAILABLE, the frontend's health turns NOT_SERVING while
it is down, and the stream reopens once the tokenizer answers SERVING again.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from typing import Callable, Iterable, Sequence

import grpc

from tessera.common import tracing
from tessera.common.grpc_service import CLIENT_CHANNEL_OPTIONS
from tessera.common.tls import ClientTls
from tessera.common.tls import channel as tls_channel
from tessera.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tessera_frontend.discovery import EngineEntry, Resolver, parse_engine_addrs, resolve_entries, system_resolve
from tessera_frontend.grpc_util import StatusError, StreamStalled, drain, is_serving, status_code, watched

log = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.5
DEFAULT_TIMEOUT_S = 30.0  # --tokenizer-timeout-s: the longest any wait on the tokenizer may take
DEFAULT_TOKENIZER_PORT = 50052
RESOLVE_INTERVAL_S = 10.0  # how often the replicas' names are resolved again (at once when none serves)


# One prompt on the shared tokenize stream (the channel carries 64 MiB a message).
MAX_ITEM_BYTES = 32 << 20


class DetokenizeStreamError(Exception):
    """The detokenize stream is down (or broke while a message was in flight)."""


class TokenizeStreamError(Exception):
    """The tokenize stream is down (or broke while a prompt was in flight)."""


class TokenizeError(StatusError):
    """The tokenizer refused a prompt or could not be reached; `code` is the gRPC status to report."""


@dataclasses.dataclass
class _Replica:
    addr: str  # the resolved address
    channel: grpc.aio.Channel
    stub: tokenizer_pb2_grpc.TokenizerServiceStub


class TokenizerClient:
    """The tokenizer service at `addr` (one or several replicas, see the module doc): the
    shared tokenize and detokenize streams, unary calls."""

    def __init__(self, addr: str, timeout_s: float = DEFAULT_TIMEOUT_S, tls: ClientTls | None = None,
                 resolver: Resolver = system_resolve) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self.entries = parse_engine_addrs(addr, DEFAULT_TOKENIZER_PORT, "tokenizer")
        self._tls = tls
        self._resolver = resolver
        self._resolved: dict[EngineEntry, list[str]] = {}
        self._resolved_at = -float("inf")
        self._replicas: dict[str, _Replica] = {}
        self._choosing = asyncio.Lock()
        # Until the first resolution, the first entry as written (gRPC resolves a name itself).
        self.active = self._replica(str(self.entries[0]), self.entries[0])
        self.stream = DetokenizeStream(lambda: self.stub, self.wait_serving, timeout_s)
        self.tokenize_stream = TokenizeStream(lambda: self.stub, self.wait_serving, timeout_s)
        self.model_info: tokenizer_pb2.ModelInfo | None = None
        self._token_text: dict[int, str] = {}

    @property
    def stub(self) -> tokenizer_pb2_grpc.TokenizerServiceStub:
        return self.active.stub

    def _replica(self, addr: str, entry: EngineEntry) -> _Replica:
        replica = self._replicas.get(addr)
        if replica is None:
            # over TLS the certificate is checked against the configured host name
            server_name = entry.host if self._tls is not None else None
            channel = tls_channel(addr, self._tls, CLIENT_CHANNEL_OPTIONS, server_name)
            replica = self._replicas[addr] = _Replica(addr, channel, tokenizer_pb2_grpc.TokenizerServiceStub(channel))
        return replica

    async def _refresh(self, force: bool) -> None:
        """Resolve the entries again (at most every RESOLVE_INTERVAL_S unless `force`): a
        replica for each new address, none for an address that left the answer (the active
        one included: its streams break and reopen on another). Nothing resolved: as it was."""
        if not force and time.monotonic() - self._resolved_at < RESOLVE_INTERVAL_S:
            return
        self._resolved_at = time.monotonic()
        self._resolved = await resolve_entries(self.entries, self._resolver, self._resolved)
        wanted = {addr: entry for entry, addrs in self._resolved.items() for addr in addrs}
        if not wanted:
            return
        for addr, entry in wanted.items():
            self._replica(addr, entry)
        for addr in [a for a in self._replicas if a not in wanted]:
            gone = self._replicas.pop(addr)
            if gone is self.active:
                self.active = self._replicas[next(iter(wanted))]
            await gone.channel.close()

    async def _choose(self) -> bool:
        """Make the first replica answering SERVING the active one, the active one first (a
        replica keeps the streams while it serves); False when none answers."""
        async with self._choosing:  # both streams and the readiness watch ask at once
            return await self._choose_now()

    async def _choose_now(self) -> bool:
        await self._refresh(force=False)
        for attempt in (1, 2):
            replicas = list(self._replicas.values())
            start = replicas.index(self.active)
            for replica in replicas[start:] + replicas[:start]:
                if await is_serving(replica.channel):
                    if replica is not self.active:
                        log.info("tokenizer replica active", extra={"tokenizer": replica.addr,
                                                                    "previous": self.active.addr})
                        self.active = replica
                    return True
            if attempt == 1:
                await self._refresh(force=True)  # none answers: the names may point elsewhere now
        return False

    def start(self) -> None:
        """Open the two streams (each waits for SERVING and reconnects by itself)."""
        self.stream.start()
        self.tokenize_stream.start()

    @property
    def connected(self) -> bool:
        return self.stream.connected and self.tokenize_stream.connected

    async def is_serving(self) -> bool:
        """Whether a replica answers SERVING (the active one, else another, which becomes active)."""
        return await self._choose()

    async def wait_serving(self, poll_s: float = 0.5) -> None:
        """Return once a replica answers SERVING (it may still be loading its model); it is the active one."""
        while not await self._choose():
            await asyncio.sleep(poll_s)

    async def fetch_model_info(self) -> tokenizer_pb2.ModelInfo:
        self.model_info = await self.stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest(), timeout=10)
        return self.model_info

    async def tokenize(self, request: tokenizer_pb2.TokenizeRequest, request_id: str,
                       timeout: float | None = None) -> tokenizer_pb2.TokenizeResponse:
        """Tokenize on the tokenize stream; TokenizeError with the status the unary Tokenize
        would give (INVALID_ARGUMENT naming the field, UNAVAILABLE, DEADLINE_EXCEEDED)."""
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for attempt in (1, 2):  # a stream that broke under the prompt (a restart): once more on the next
            try:
                result = await asyncio.wait_for(self.tokenize_stream.submit(request, request_id),
                                                max(0.0, deadline - time.monotonic()))
                break
            except TokenizeStreamError as exc:
                if attempt == 2:
                    raise TokenizeError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
                while not self.tokenize_stream.connected and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            except asyncio.TimeoutError:
                raise TokenizeError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout:g} s") from None
        if result.HasField("error"):
            raise TokenizeError(status_code(result.error.code, grpc.StatusCode.INTERNAL), result.error.message)
        return result.response

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True,
                         timeout: float | None = None) -> str:
        timeout = self.timeout_s if timeout is None else timeout
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
        await self.tokenize_stream.close()
        for replica in self._replicas.values():
            await replica.channel.close()


class _TokenizerStream:
    """One long-lived streaming call to the tokenizer, reopened whenever it breaks (once the
    tokenizer is SERVING again). Subclasses say which call, how replies resolve waiting
    futures and how the futures fail when the stream breaks."""

    name = ""

    def __init__(self, stub: Callable[[], tokenizer_pb2_grpc.TokenizerServiceStub], wait_ready,
                 reply_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._stub = stub  # the active replica's stub, asked for each time a stream opens
        self._wait_ready = wait_ready
        self.reply_timeout_s = reply_timeout_s
        self._outbox: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        # Bumped each time a new stream opens: requests opened on an older one are lost.
        self.generation = 0
        self.on_open: list = []  # callables run each time a new stream is open (and generation bumped)

    @property
    def connected(self) -> bool:
        return self._outbox is not None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"{self.name}-stream")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _open(self, requests) -> grpc.aio.StreamStreamCall:
        raise NotImplementedError

    def _on_open(self) -> None:
        """A new stream is open: start its bookkeeping of waiting futures."""

    def _on_response(self, response) -> None:
        raise NotImplementedError

    def _fail_waiting(self, reason: str) -> None:
        raise NotImplementedError

    def _oldest_unanswered(self) -> float | None:
        """time.monotonic() when the oldest message still waiting for its answer was sent."""
        raise NotImplementedError

    async def _check_replies(self) -> str | None:
        """Why to break the stream off: its oldest message has waited past reply_timeout_s."""
        sent = self._oldest_unanswered()
        if sent is None or time.monotonic() - sent <= self.reply_timeout_s:
            return None
        reason = f"the tokenizer did not answer within {self.reply_timeout_s:g} s"
        log.error(f"{self.name} stream: no answer; breaking it off", extra={
            "reason": reason, "timeout_s": self.reply_timeout_s})
        return reason

    async def _run(self) -> None:
        """Keep one stream open: (re)connect whenever the tokenizer is SERVING."""
        while True:
            await self._wait_ready()
            reason = await self._serve_one_stream()
            log.warning(f"{self.name} stream closed; reconnecting", extra={"reason": reason})
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _serve_one_stream(self) -> str:
        outbox: asyncio.Queue = asyncio.Queue()
        call = self._open(outbox)
        self._outbox = outbox
        self._on_open()
        self.generation += 1
        log.info(f"{self.name} stream open", extra={"generation": self.generation})
        for listener in self.on_open:
            listener()
        reason = f"the tokenizer closed the {self.name} stream"
        try:
            async for response in watched(call, self._check_replies, min(1.0, self.reply_timeout_s / 4)):
                self._on_response(response)
        except StreamStalled as exc:
            reason = str(exc)
        except grpc.aio.AioRpcError as exc:
            reason = f"{self.name} stream failed: {exc.code().name}: {exc.details()}"
        except Exception as exc:  # a bug must not end the reconnect loop
            log.exception(f"{self.name} stream reader failed")
            reason = f"internal error: {exc!r}"
        finally:
            self._outbox = None
            outbox.put_nowait(None)
            call.cancel()
            self._fail_waiting(reason)
        return reason


class DetokenizeStream(_TokenizerStream):
    """The multiplexed DetokenizeStream call: send one message per engine step, get its results."""

    name = "detokenize"

    def __init__(self, stub: Callable[[], tokenizer_pb2_grpc.TokenizerServiceStub], wait_ready,
                 reply_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(stub, wait_ready, reply_timeout_s)
        self._pending: collections.deque[tuple[asyncio.Future, float]] = collections.deque()

    def send(self, items: Sequence[tokenizer_pb2.DetokenizeItem]) -> asyncio.Future:
        """Queue one message; the future resolves to its DetokenizeResults (same order as items)."""
        if self._outbox is None:
            raise DetokenizeStreamError("the detokenize stream to the tokenizer is down (tokenizer unavailable)")
        future = asyncio.get_running_loop().create_future()
        self._pending.append((future, time.monotonic()))
        self._outbox.put_nowait(tokenizer_pb2.DetokenizeStreamRequest(items=items))
        return future

    def cancel(self, keys: Iterable[str]) -> None:
        """Tell the tokenizer to forget these requests; fire and forget (no-op when disconnected)."""
        items = [tokenizer_pb2.DetokenizeItem(request_id=k, cancel=True) for k in keys]
        if not items or self._outbox is None:
            return
        future = self.send(items)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # result is not needed

    def _open(self, outbox: asyncio.Queue) -> grpc.aio.StreamStreamCall:
        return self._stub().DetokenizeStream(drain(outbox))

    def _on_open(self) -> None:
        self._pending = collections.deque()

    def _on_response(self, response: tokenizer_pb2.DetokenizeStreamResponse) -> None:
        if not self._pending:
            log.error("detokenize stream: reply without a request; ignored")
            return
        future, _ = self._pending.popleft()
        if not future.done():
            future.set_result(list(response.results))

    def _fail_waiting(self, reason: str) -> None:
        error = DetokenizeStreamError(reason)
        while self._pending:
            future, _ = self._pending.popleft()
            if not future.done():
                future.set_exception(error)

    def _oldest_unanswered(self) -> float | None:
        return self._pending[0][1] if self._pending else None


class TokenizeStream(_TokenizerStream):
    """The multiplexed TokenizeStream call: every prompt to tokenize goes out as an item tagged
    with an id; prompts queued together (a burst of requests) travel as one message."""

    name = "tokenize"

    def __init__(self, stub: Callable[[], tokenizer_pb2_grpc.TokenizerServiceStub], wait_ready,
                 reply_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(stub, wait_ready, reply_timeout_s)
        # item id -> (its future, when it was sent); in send order, so the first is the oldest
        self._waiting: dict[int, tuple[asyncio.Future, float]] = {}
        self._ids = itertools.count(1)

    def submit(self, request: tokenizer_pb2.TokenizeRequest, request_id: str) -> asyncio.Future:
        """Queue one prompt; the future resolves to its TokenizeResult (response or error), or
        fails with TokenizeStreamError when the stream is or goes down first."""
        if self._outbox is None:
            raise TokenizeStreamError("the tokenize stream to the tokenizer is down (tokenizer unavailable)")
        size = request.ByteSize()
        if size > MAX_ITEM_BYTES:  # would break the stream every other request shares: this one fails alone
            raise TokenizeError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the prompt is {size} bytes, more than the {MAX_ITEM_BYTES} a request may send "
                                f"to the tokenizer")
        item_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[item_id] = (future, time.monotonic())
        future.add_done_callback(lambda f: self._waiting.pop(item_id, None))  # also when the caller gives up
        self._outbox.put_nowait(tokenizer_pb2.TokenizeStreamRequest(
            items=[tokenizer_pb2.TokenizeItem(id=item_id, request_id=request_id, request=request,
                                              traceparent=tracing.current_traceparent())]))  # "" unless traced
        return future

    def _open(self, outbox: asyncio.Queue) -> grpc.aio.StreamStreamCall:
        return self._stub().TokenizeStream(drain(outbox, merge=lambda first, later: first.items.extend(later.items)))

    def _on_response(self, response: tokenizer_pb2.TokenizeStreamResponse) -> None:
        for result in response.results:
            future, _ = self._waiting.pop(result.id, (None, 0.0))
            if future is not None and not future.done():
                future.set_result(result)

    def _fail_waiting(self, reason: str) -> None:
        error = TokenizeStreamError(reason)
        waiting, self._waiting = self._waiting, {}
        for future, _ in waiting.values():
            if not future.done():
                future.set_exception(error)

    def _oldest_unanswered(self) -> float | None:
        return next((sent for _, sent in self._waiting.values()), None)
