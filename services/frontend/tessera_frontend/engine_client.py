"""Client of the engine replicas (the seed's EngineCoreClient, async mode).

Each replica gets one `EngineReplica`: a supervisor task waits until the engine is
SERVING, reads its EngineInfo, then opens the Session stream and keeps it open.
New requests and aborts are written on that stream; every EngineStepOutputs that
comes back is handed to the step handler (the OutputProcessor), which detokenizes
the step's new tokens and fans them out to the per-request queues.

If a Session stream breaks, the requests in flight on it are reported to the lost
handler (they fail with UNAVAILABLE rather than hang: the engine aborted them when
the stream closed) and the replica reconnects once it is SERVING again.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Iterable, Sequence

import grpc

from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tessera_frontend.grpc_util import drain, is_serving
from tessera_frontend.router import Router

log = logging.getLogger(__name__)

StepHandler = Callable[[engine_pb2.EngineStepOutputs], Awaitable[None]]
LostHandler = Callable[[list[str], str], None]

HEALTH_POLL_S = 0.5
RECONNECT_DELAY_S = 0.5
_RUNNING = common_pb2.FINISH_REASON_UNSPECIFIED


class NoReplicaError(Exception):
    """No engine replica has an open Session stream."""


class EngineReplica:
    """One engine replica: its channel, its Session stream and the requests in flight on it."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.channel = grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self.info: engine_pb2.EngineInfo | None = None
        # request id -> samples not yet finished (n of them at submit)
        self._in_flight: dict[str, int] = {}
        self._outbox: asyncio.Queue | None = None

    @property
    def ready(self) -> bool:
        """The Session stream is open: requests can be submitted."""
        return self._outbox is not None

    @property
    def outstanding(self) -> int:
        return len(self._in_flight)

    def submit(self, request: engine_pb2.EngineRequest, num_samples: int) -> None:
        if self._outbox is None:
            raise NoReplicaError(f"engine {self.addr} is not connected")
        self._in_flight[request.request_id] = num_samples
        self._outbox.put_nowait(engine_pb2.SessionInput(add=[request]))

    def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._in_flight.pop(request_id, None)
        if self._outbox is not None and request_ids:
            self._outbox.put_nowait(engine_pb2.SessionInput(
                abort=engine_pb2.AbortRequests(request_ids=request_ids)))

    def _note_finished(self, step: engine_pb2.EngineStepOutputs) -> list[str]:
        """Count finished samples; return the request ids that are now complete."""
        done = []
        for output in step.outputs:
            if output.finish_reason == _RUNNING or output.request_id not in self._in_flight:
                continue
            left = self._in_flight[output.request_id] - 1
            # An error or an abort ends the whole request whatever n is.
            if left <= 0 or output.finish_reason in (common_pb2.FINISH_REASON_ERROR,
                                                     common_pb2.FINISH_REASON_ABORT):
                del self._in_flight[output.request_id]
                done.append(output.request_id)
            else:
                self._in_flight[output.request_id] = left
        return done

    async def run(self, on_step: StepHandler, on_lost: LostHandler,
                  on_done: Callable[[Iterable[str]], None]) -> None:
        """Supervise the replica forever: wait for SERVING, open the session, reconnect on failure."""
        while True:
            while not await is_serving(self.channel):
                await asyncio.sleep(HEALTH_POLL_S)
            try:
                self.info = await self.stub.GetInfo(engine_pb2.EngineInfoRequest(), timeout=10)
                reason = await self._serve_session(on_step, on_done)
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except Exception as exc:  # a bug in step handling: fail this session's requests, go on
                log.exception("engine session handler failed", extra={"engine": self.addr})
                reason = f"internal error: {exc!r}"
            lost, self._in_flight = list(self._in_flight), {}
            log.warning("engine session closed; reconnecting",
                        extra={"engine": self.addr, "reason": reason, "lost_requests": len(lost)})
            if lost:
                on_lost(lost, f"engine {self.addr} went away: {reason}")
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _serve_session(self, on_step: StepHandler,
                             on_done: Callable[[Iterable[str]], None]) -> str:
        outbox: asyncio.Queue = asyncio.Queue()
        call = self.stub.Session(drain(outbox))
        self._outbox = outbox
        log.info("engine session open", extra={"engine": self.addr,
                                                "max_model_len": self.info.max_model_len})
        try:
            async for step in call:
                on_done(self._note_finished(step))
                await on_step(step)
            return "the engine closed the session"
        finally:
            self._outbox = None
            outbox.put_nowait(None)
            call.cancel()

    async def get_stats(self) -> engine_pb2.EngineStats:
        return await self.stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)

    async def close(self) -> None:
        await self.channel.close()


class EngineCoreClient:
    """All engine replicas behind one submit / abort interface."""

    def __init__(self, addrs: Sequence[str], router: Router | None = None) -> None:
        if not addrs:
            raise ValueError("at least one engine address is needed")
        self.replicas = [EngineReplica(a) for a in addrs]
        self._router = router or Router()
        self._where: dict[str, EngineReplica] = {}
        self._tasks: list[asyncio.Task] = []

    def start(self, on_step: StepHandler, on_lost: LostHandler) -> None:
        """Start one supervisor task per replica; steps go to `on_step`, broken streams to `on_lost`."""
        def lost(request_ids: list[str], reason: str) -> None:
            self._forget(request_ids)
            on_lost(request_ids, reason)

        self._tasks = [asyncio.create_task(r.run(on_step, lost, self._forget), name=f"engine-{r.addr}")
                       for r in self.replicas]

    @property
    def ready(self) -> bool:
        return any(r.ready for r in self.replicas)

    @property
    def max_model_len(self) -> int | None:
        """The smallest max_model_len among replicas that reported one."""
        lens = [r.info.max_model_len for r in self.replicas if r.info and r.info.max_model_len > 0]
        return min(lens) if lens else None

    def submit(self, request: engine_pb2.EngineRequest, num_samples: int) -> str:
        """Send the request to the chosen replica; return that replica's address."""
        replica = self._router.choose([r for r in self.replicas if r.ready])
        if replica is None:
            raise NoReplicaError("no engine replica is connected")
        replica.submit(request, num_samples)
        self._where[request.request_id] = replica
        return replica.addr

    def abort(self, request_ids: Iterable[str]) -> None:
        by_replica: dict[EngineReplica, list[str]] = {}
        for request_id in request_ids:
            replica = self._where.pop(request_id, None)
            if replica is not None:
                by_replica.setdefault(replica, []).append(request_id)
        for replica, ids in by_replica.items():
            replica.abort(ids)

    def _forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._where.pop(request_id, None)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in self.replicas:
            await replica.close()

