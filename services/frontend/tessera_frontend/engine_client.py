"""Client of the engine replicas (vLLM v1's EngineCoreClient, async mode): one Session stream per replica.

Each replica gets one `EngineReplica`: a supervisor task waits until the engine is
SERVING, reads its EngineInfo, then opens the Session stream and keeps it open.
New requests and aborts are written on that stream; every EngineStepOutputs that
comes back is handed to the step handler (AsyncLLM's, through the OutputProcessor),
which sends the step's new tokens to the tokenizer and fans the text out to the
per-request queues.
While the session is open the replica's health is checked every
HEALTH_CHECK_INTERVAL_S; a replica that does not answer SERVING gets no new
requests until it does again (its running requests go on). One that stops answering
altogether (no health answer and no step for `stall_timeout_s`, `--engine-timeout-s`,
while it has requests: a hung or partitioned process keeps its connection open) has its
session broken off, so that its requests fail (or are retried, if they have no token
yet) instead of waiting for ever.

If a Session stream breaks, the requests in flight on it are reported to the lost
handler (AsyncLLM migrates them to another replica: the engine aborted them when the
stream closed) and the replica reconnects once it is SERVING again; the router
forgets its prefix-cache affinity, since a restarted engine starts cold. A replica that
says it drains with handoff (EngineStepOutputs.handoff) gets no new requests, and its
requests in flight are offered to the handoff handler: those it takes (another replica
serves) are aborted there. Only the outputs of requests still in flight on a replica
are passed on, so a request that moved never gets a late output from where it was.

`EngineCoreClient` holds the replica set: it resolves the configured entries (see
`discovery`) at start and every `resolve_interval_s`, adds a replica for each new
address and retires one whose address went away (no new requests; it is closed
once its requests are done). `submit` asks the router for a replica.

LoRA adapters: each replica's list (ListLoRAAdapters) is read before its session opens and
again whenever `refresh_lora` is called (the `lora` module does, after a load or unload and
when a request names an adapter it has not seen). A request for an adapter goes only to
replicas whose list has it (a replica restarted since a run-time load lacks it); when none
has it, to any, whose engine refuses it NOT_FOUND.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Collection, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2

from tessera.common.grpc_service import CLIENT_CHANNEL_OPTIONS
from tessera.common.samples import OpenSamples
from tessera.common.tls import ClientTls
from tessera.common.tls import channel as tls_channel
from tessera.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tessera_frontend.discovery import (EngineEntry, Resolver, parse_engine_addr, parse_engine_addrs,
                                        resolve_entries, system_resolve)
from tessera_frontend.grpc_util import StreamStalled, drain, health_status, is_serving, watched
from tessera_frontend.router import Router

log = logging.getLogger(__name__)

StepHandler = Callable[[engine_pb2.EngineStepOutputs], Awaitable[None]]
LostHandler = Callable[[list[str], str], None]
HandoffHandler = Callable[[list[str], str], bool]  # True: the requests were taken elsewhere

HEALTH_POLL_S = 0.5            # while disconnected: how often to ask whether the engine is back
HEALTH_CHECK_INTERVAL_S = 1.0  # while connected: how often to check the engine's health
HEALTH_CHECK_TIMEOUT_S = 3.0
LORA_LIST_TIMEOUT_S = 10.0
LORA_LOAD_TIMEOUT_S = 120.0    # a load reads and checks the adapter's weights
DEFAULT_STALL_TIMEOUT_S = 30.0  # --engine-timeout-s
RECONNECT_DELAY_S = 0.5
DEFAULT_RESOLVE_INTERVAL_S = 5.0
RESOLVE_RETRY_S = 1.0          # re-resolve this often while no replica is known
_RUNNING = common_pb2.FINISH_REASON_UNSPECIFIED


class NoReplicaError(Exception):
    """No engine replica has an open Session stream."""


def _merge_inputs(first: engine_pb2.SessionInput, later: engine_pb2.SessionInput) -> None:
    """Fold `later` into `first`. The engine takes a message's adds before its aborts, and an
    abort always follows its request's add, so the merged message means the same. The
    more_coming hint is the latest add's."""
    first.add.extend(later.add)
    first.abort.request_ids.extend(later.abort.request_ids)
    first.abort.samples.extend(later.abort.samples)
    if later.add:
        first.more_coming = later.more_coming


class EngineReplica:
    """One engine replica: its channel, its Session stream, its health and the requests in flight on it."""

    def __init__(self, addr: str, entry: str = "", stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                 tls: ClientTls | None = None) -> None:
        self.addr = addr
        self.entry = entry or addr  # the configured name it was resolved from
        self.stall_timeout_s = stall_timeout_s
        self.last_heard = 0.0  # time.monotonic() of its last step or health answer
        # over TLS the certificate is checked against the configured name, not the pod's IP
        self.channel = tls_channel(addr, tls, CLIENT_CHANNEL_OPTIONS, parse_engine_addr(self.entry).host)
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self.info: engine_pb2.EngineInfo | None = None
        self.healthy = False
        self.retired = False  # its address left the resolved set: no new requests
        self.draining = False  # it said it drains (handoff), until its next session: no new requests
        self.sessions_opened = 0
        # its LoRA adapters as it last listed them; None until it answered (then it may serve any)
        self.lora: common_pb2.LoRAAdapters | None = None
        self._in_flight: OpenSamples[str] = OpenSamples()  # by request id
        self._outbox: asyncio.Queue | None = None

    @property
    def connected(self) -> bool:
        """The Session stream is open: requests can be submitted."""
        return self._outbox is not None

    @property
    def ready(self) -> bool:
        return self.connected and not self.retired and not self.draining

    @property
    def available(self) -> bool:
        """Connected, healthy and not retired: the router's first choice."""
        return self.ready and self.healthy

    @property
    def outstanding(self) -> int:
        return len(self._in_flight)

    def serves(self, lora_name: str) -> bool:
        """Whether it may take a request for this adapter ("": the base model, always)."""
        return not lora_name or self.lora is None or any(a.name == lora_name for a in self.lora.adapters)

    async def refresh_lora(self) -> common_pb2.LoRAAdapters:
        """Read its adapter list again (an engine without the RPC serves none)."""
        try:
            self.lora = await self.stub.ListLoRAAdapters(common_pb2.ListLoRAAdaptersRequest(),
                                                         timeout=LORA_LIST_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self.lora = common_pb2.LoRAAdapters()
        return self.lora

    async def load_lora(self, name: str, path: str) -> common_pb2.LoRAAdapter:
        """LoadLoRAAdapter on this engine (its errors raised as they come: AioRpcError)."""
        return await self.stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path),
                                               timeout=LORA_LOAD_TIMEOUT_S)

    async def unload_lora(self, name: str) -> common_pb2.LoRAAdapter:
        return await self.stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name=name),
                                                 timeout=LORA_LIST_TIMEOUT_S)

    def submit(self, request: engine_pb2.EngineRequest, num_samples: int, more_coming: bool = False) -> None:
        if self._outbox is None:
            raise NoReplicaError(f"engine {self.addr} is not connected")
        self._in_flight.add(request.request_id, num_samples)
        self._outbox.put_nowait(engine_pb2.SessionInput(add=[request], more_coming=more_coming))

    def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._in_flight.discard(request_id)
        if self._outbox is not None and request_ids:
            self._outbox.put_nowait(engine_pb2.SessionInput(
                abort=engine_pb2.AbortRequests(request_ids=request_ids)))

    def abort_samples(self, samples: Sequence[engine_pb2.SampleRef]) -> None:
        """Abort single samples; their requests' other samples run on."""
        if self._outbox is not None and samples:
            self._outbox.put_nowait(engine_pb2.SessionInput(abort=engine_pb2.AbortRequests(samples=samples)))

    def _note_finished(self, step: engine_pb2.EngineStepOutputs) -> list[str]:
        """Count finished samples; return the request ids that are now complete."""
        return [output.request_id for output in step.outputs
                if output.finish_reason != _RUNNING
                and self._in_flight.finish(output.request_id, output.finish_reason == common_pb2.FINISH_REASON_ERROR)]

    def _in_flight_only(self, step: engine_pb2.EngineStepOutputs) -> engine_pb2.EngineStepOutputs:
        """The step's outputs of requests in flight here (a request handed off is not)."""
        if all(o.request_id in self._in_flight for o in step.outputs):
            return step
        return engine_pb2.EngineStepOutputs(outputs=[o for o in step.outputs if o.request_id in self._in_flight])

    def _hand_off(self, on_handoff: HandoffHandler) -> None:
        self.draining = True
        ids = list(self._in_flight)
        log.info("engine replica drains with handoff", extra={"engine": self.addr, "in_flight": len(ids)})
        if ids and on_handoff(ids, f"engine {self.addr} is draining"):
            self.abort(ids)

    async def run(self, on_step: StepHandler, on_lost: LostHandler,
                  on_done: Callable[[Iterable[str]], None],
                  on_session_open: Callable[["EngineReplica"], None] = lambda r: None,
                  on_handoff: HandoffHandler = lambda ids, reason: False) -> None:
        """Supervise the replica until cancelled: wait for SERVING, open the session, reconnect on failure."""
        while True:
            while not await is_serving(self.channel):
                await asyncio.sleep(HEALTH_POLL_S)
            try:
                self.info = await self.stub.GetInfo(engine_pb2.EngineInfoRequest(), timeout=10)
                await self.refresh_lora()  # before the session opens: requests for its adapters find it
                reason = await self._serve_session(on_step, on_done, on_session_open, on_handoff)
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except Exception as exc:  # a bug in step handling: fail this session's requests, go on
                log.exception("engine session handler failed", extra={"engine": self.addr})
                reason = f"internal error: {exc!r}"
            lost = self._in_flight.clear()
            log.warning("engine session closed; reconnecting",
                        extra={"engine": self.addr, "reason": reason, "lost_requests": len(lost)})
            if lost:
                on_lost(lost, f"engine {self.addr} went away: {reason}")
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _serve_session(self, on_step: StepHandler, on_done: Callable[[Iterable[str]], None],
                             on_session_open: Callable[["EngineReplica"], None], on_handoff: HandoffHandler) -> str:
        outbox: asyncio.Queue = asyncio.Queue()
        call = self.stub.Session(drain(outbox, merge=_merge_inputs))
        self._outbox = outbox
        self.healthy = True
        self.draining = False
        self.sessions_opened += 1
        on_session_open(self)
        self.last_heard = time.monotonic()
        log.info("engine session open", extra={"engine": self.addr, "engine_entry": self.entry,
                                                "max_model_len": self.info.max_model_len})
        try:
            async for step in watched(call, self._check_health, HEALTH_CHECK_INTERVAL_S):
                self.last_heard = time.monotonic()
                if step.handoff:
                    self._hand_off(on_handoff)
                    continue
                step = self._in_flight_only(step)
                on_done(self._note_finished(step))
                await on_step(step)
            return "the engine closed the session"
        except StreamStalled as exc:
            return str(exc)
        finally:
            self._outbox = None
            self.healthy = False
            outbox.put_nowait(None)
            call.cancel()

    async def _check_health(self) -> str | None:
        """While the session is open: keep `healthy` in step with the engine's grpc.health.v1
        answer; say why to break the session off once the engine has stopped answering (see
        the module doc)."""
        status = await health_status(self.channel, timeout=HEALTH_CHECK_TIMEOUT_S)
        now = time.monotonic()
        if status is not None:
            self.last_heard = now
        elif self._in_flight and now - self.last_heard > self.stall_timeout_s:
            log.error("engine stopped answering; breaking its session off",
                      extra={"engine": self.addr, "in_flight": len(self._in_flight),
                             "timeout_s": self.stall_timeout_s})
            return f"engine {self.addr} stopped answering (nothing for {self.stall_timeout_s:g} s)"
        serving = status == health_pb2.HealthCheckResponse.SERVING
        if serving != self.healthy:
            log.warning("engine health changed", extra={"engine": self.addr, "serving": serving})
            self.healthy = serving
        return None

    async def close(self) -> None:
        await self.channel.close()


class EngineCoreClient:
    """All engine replicas behind one submit / abort interface."""

    def __init__(self, addrs: str | Sequence[str | EngineEntry], router: Router | None = None,
                 resolver: Resolver = system_resolve,
                 resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, tls: ClientTls | None = None) -> None:
        if isinstance(addrs, str) or any(not isinstance(a, EngineEntry) for a in addrs):
            addrs = parse_engine_addrs(addrs if isinstance(addrs, str) else [str(a) for a in addrs])
        self.entries: list[EngineEntry] = list(addrs)
        self.router = router or Router()
        self._resolver = resolver
        self._resolve_interval_s = resolve_interval_s
        self._stall_timeout_s = stall_timeout_s
        self._tls = tls
        self._resolved: dict[EngineEntry, list[str]] = {}
        self._replicas: dict[str, EngineReplica] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._where: dict[str, EngineReplica] = {}
        self._handlers: tuple[StepHandler, LostHandler, HandoffHandler] | None = None
        self._discovery: asyncio.Task | None = None

    @property
    def replicas(self) -> list[EngineReplica]:
        return list(self._replicas.values())

    def start(self, on_step: StepHandler, on_lost: LostHandler,
              on_handoff: HandoffHandler = lambda ids, reason: False) -> None:
        """Resolve the entries and supervise each replica; steps go to `on_step`, broken streams to
        `on_lost`, a draining replica's requests to `on_handoff`."""
        self._handlers = (on_step, on_lost, on_handoff)
        self._discovery = asyncio.create_task(self._discover(), name="engine-discovery")

    @property
    def ready(self) -> bool:
        """Some replica is connected and answers SERVING (the frontend's own health follows this)."""
        return any(r.available for r in self._replicas.values())

    @property
    def timeout_s(self) -> float:
        """--engine-timeout-s: how long a replica may stay silent, and a migrating request may wait for one."""
        return self._stall_timeout_s

    def _limit(self, value: Callable[[engine_pb2.EngineInfo], int]) -> int | None:
        values = [value(r.info) for r in self._replicas.values() if r.info and not r.retired]
        values = [v for v in values if v > 0]
        return min(values) if values else None

    @property
    def max_model_len(self) -> int | None:
        """The smallest max_model_len among replicas that reported one."""
        return self._limit(lambda info: info.max_model_len)

    @property
    def kv_cache_tokens(self) -> int | None:
        """The smallest KV cache (in tokens) among replicas: one sequence can never be longer."""
        return self._limit(lambda info: info.num_blocks * info.block_size)

    def submit(self, request: engine_pb2.EngineRequest, num_samples: int, more_coming: bool = False,
               exclude: Collection[str] = ()) -> str:
        """Send the request to the chosen replica; return that replica's address.

        `more_coming`: more requests are on their way (SessionInput.more_coming).
        `exclude`: addresses not to use (a retry's replicas that already failed it)."""
        ready = [r for r in self._replicas.values() if r.ready and r.addr not in exclude]
        if request.lora_name:  # none serving it: any, whose engine refuses it NOT_FOUND naming it
            ready = [r for r in ready if r.serves(request.lora_name)] or ready
        # Unhealthy replicas are skipped; only when no replica is healthy is one of them tried.
        candidates = [r for r in ready if r.healthy] or ready
        replica = self.router.choose(candidates, request.prompt_token_ids, request.lora_name)
        if replica is None:
            raise NoReplicaError("no engine replica is connected")
        replica.submit(request, num_samples, more_coming)
        self._where[request.request_id] = replica
        return replica.addr

    def can_retry_elsewhere(self, exclude: Collection[str]) -> bool:
        """Some replica outside `exclude` is connected and healthy."""
        return any(r.available and r.addr not in exclude for r in self._replicas.values())

    def abort(self, request_ids: Iterable[str]) -> None:
        by_replica: dict[EngineReplica, list[str]] = {}
        for request_id in request_ids:
            replica = self._where.pop(request_id, None)
            if replica is not None:
                by_replica.setdefault(replica, []).append(request_id)
        for replica, ids in by_replica.items():
            replica.abort(ids)

    def abort_samples(self, samples: Iterable[engine_pb2.SampleRef]) -> None:
        """Abort single samples where their requests run."""
        by_replica: dict[EngineReplica, list[engine_pb2.SampleRef]] = {}
        for sample in samples:
            replica = self._where.get(sample.request_id)
            if replica is not None:
                by_replica.setdefault(replica, []).append(sample)
        for replica, refs in by_replica.items():
            replica.abort_samples(refs)

    def _forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._where.pop(request_id, None)

    # -- the replica set --------------------------------------------------------------------
    async def refresh(self) -> None:
        """Resolve the entries once; add replicas for new addresses, retire those gone."""
        self._resolved = await resolve_entries(self.entries, self._resolver, self._resolved)
        wanted = {addr: str(entry) for entry, addrs in self._resolved.items() for addr in addrs}
        for addr, entry in wanted.items():
            replica = self._replicas.get(addr)
            if replica is None:
                self._add(addr, entry)
            elif replica.retired:
                log.info("engine replica is back in the resolved set", extra={"engine": addr})
                replica.retired = False
        for addr, replica in list(self._replicas.items()):
            if addr not in wanted and not replica.retired:
                log.info("engine replica left the resolved set; retiring it",
                         extra={"engine": addr, "outstanding": replica.outstanding})
                replica.retired = True
            if replica.retired and replica.outstanding == 0:
                await self._remove(addr)

    def _add(self, addr: str, entry: str) -> None:
        on_step, on_lost, on_handoff = self._handlers

        def lost(request_ids: list[str], reason: str) -> None:
            self._forget(request_ids)
            on_lost(request_ids, reason)

        def session_open(replica: EngineReplica) -> None:
            if replica.sessions_opened > 1:  # a reconnect: the engine may have restarted cold
                self.router.forget(replica.addr)

        replica = EngineReplica(addr, entry, self._stall_timeout_s, self._tls)
        self._replicas[addr] = replica
        def handoff(request_ids: list[str], reason: str) -> bool:
            taken = on_handoff(request_ids, reason)
            if taken:
                self._forget(request_ids)
            return taken

        self._tasks[addr] = asyncio.create_task(replica.run(on_step, lost, self._forget, session_open, handoff),
                                                name=f"engine-{addr}")
        log.info("engine replica added", extra={"engine": addr, "engine_entry": entry})

    async def _remove(self, addr: str) -> None:
        replica = self._replicas.pop(addr)
        task = self._tasks.pop(addr)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self.router.forget(addr)
        await replica.close()
        log.info("engine replica removed", extra={"engine": addr})

    async def _discover(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a resolver bug must not stop discovery
                log.exception("engine discovery failed")
            await asyncio.sleep(self._resolve_interval_s if self._replicas else RESOLVE_RETRY_S)

    async def close(self) -> None:
        tasks = [t for t in (self._discovery, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for replica in self._replicas.values():
            await replica.close()
