"""Small gRPC helpers shared by the two backend clients."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class StatusError(Exception):
    """A call failed with a gRPC status: `code` (a grpc.StatusCode) and `message` for the client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_code(name: str, default: grpc.StatusCode) -> grpc.StatusCode:
    """The gRPC status a RequestError.code names; `default` when it is empty, unknown or OK
    (an error is never reported as OK)."""
    code = getattr(grpc.StatusCode, name, None) if name else None
    return code if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK else default


async def health_status(channel: grpc.aio.Channel, timeout: float = 2.0) -> int | None:
    """The grpc.health.v1 status of the service behind `channel` (overall service ""); None
    when it does not answer."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.aio.AioRpcError:
        return None
    return reply.status


async def is_serving(channel: grpc.aio.Channel, timeout: float = 2.0) -> bool:
    """True when the service behind `channel` answers SERVING; False otherwise."""
    return await health_status(channel, timeout) == health_pb2.HealthCheckResponse.SERVING


class StreamStalled(Exception):
    """`watched` broke a stream off; str() says why."""


async def watched(call, check: Callable[[], Awaitable[str | None]], interval_s: float) -> AsyncIterator:
    """The responses of the streaming `call` while `check()`, awaited every `interval_s`,
    returns None. Once it returns a reason the call is cancelled and StreamStalled(reason) is
    raised: for a peer that hangs with its connection open, which gRPC itself never notices."""
    reason: str | None = None

    async def watch() -> None:
        nonlocal reason
        while reason is None:
            await asyncio.sleep(interval_s)
            reason = await check()
        call.cancel()

    watcher = asyncio.create_task(watch(), name="stream-watch")
    try:
        async for response in call:
            yield response
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        if reason is None or asyncio.current_task().cancelling():
            raise  # not the watcher's doing (or the consumer itself is being cancelled)
        raise StreamStalled(reason) from None
    finally:
        watcher.cancel()


# Merged messages stay under this size, far below the channels' 64 MiB limit: a burst of
# large prompts goes out as several messages instead of one the stream cannot carry.
MERGE_MAX_BYTES = 4 << 20


async def drain(queue: asyncio.Queue, merge: Callable | None = None,
                max_bytes: int = MERGE_MAX_BYTES) -> AsyncIterator:
    """Yield the queue's messages until a None arrives: the request side of a streaming call.

    Writers put messages with put_nowait, so submitting never waits on the network. With
    `merge(first, later)`, the messages that queued up meanwhile are folded into one before
    it is sent (many requests arriving together travel as one message), up to max_bytes.
    """
    pending = None  # a message that did not fit the last merge: the next one starts with it
    while True:
        message = pending if pending is not None else await queue.get()
        pending = None
        if message is None:
            return
        if merge is not None and not queue.empty():
            size = message.ByteSize()  # sized only when there is something to merge
            while not queue.empty():
                later = queue.get_nowait()
                if later is None:
                    yield message
                    return
                later_size = later.ByteSize()
                if size + later_size > max_bytes:
                    pending = later
                    break
                merge(message, later)
                size += later_size
        yield message
