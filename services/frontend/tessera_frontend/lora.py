"""LoRA adapters as the engine replicas serve them: the list a request's adapter is looked up in,
and run-time load / unload on every replica (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, allowed by --allow-runtime-lora-updating).

The list is the union of the connected replicas' own lists (`EngineReplica.lora`, read before
each session opens and after every load or unload made here), in the order the adapters were
loaded. Another frontend may load or unload on the same engines, so a name the list lacks
makes every replica list again (at most once per REFRESH_MIN_S, concurrent callers sharing
one round) before it counts as unknown, and listing the adapters refreshes lists older than that.

Load and unload go to every connected replica at once. The first failure in replica order is
what the caller gets, with the engine's status and message; nothing is rolled back on the
replicas that took it: requests for an adapter go only to replicas whose list has it
(`EngineCoreClient.submit`). An unload is done once no replica has the adapter any more, so a
NOT_FOUND from a replica that never had it (restarted since the load) is no failure when another
replica unloaded it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Iterable, Protocol, Sequence

import grpc

from tessera.v1 import common_pb2
from tessera_frontend.grpc_util import StatusError

log = logging.getLogger(__name__)

REFRESH_MIN_S = 1.0  # an unknown name or a listing reads the replicas' lists at most this often
RUNTIME_UPDATES_OFF = "runtime LoRA updating is off: start the frontend with --allow-runtime-lora-updating"


class LoRAError(StatusError):
    """A LoRA call failed: `code` (a grpc.StatusCode), `message`, and `param`, the request field
    at fault when there is one (the HTTP error body's `param`)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(code, message)
        self.param = param


class Replica(Protocol):
    """What this module reads of an engine replica (engine_client.EngineReplica)."""
    addr: str
    lora: common_pb2.LoRAAdapters | None
    retired: bool

    @property
    def connected(self) -> bool: ...

    async def refresh_lora(self) -> common_pb2.LoRAAdapters: ...

    async def load_lora(self, name: str, path: str) -> common_pb2.LoRAAdapter: ...

    async def unload_lora(self, name: str) -> common_pb2.LoRAAdapter: ...


class Replicas(Protocol):
    """The replica set (engine_client.EngineCoreClient)."""

    @property
    def replicas(self) -> Sequence[Replica]: ...


def served_adapters(lists: Iterable[common_pb2.LoRAAdapters]) -> common_pb2.LoRAAdapters:
    """The replicas' lists as one: every adapter once (the first replica's entry, in load order),
    enabled when any replica is, and the smallest limits among those enabled (what all take)."""
    merged = common_pb2.LoRAAdapters()
    names: set[str] = set()
    for one in lists:
        if one.enabled:
            merged.max_loras = min(merged.max_loras, one.max_loras) if merged.enabled else one.max_loras
            merged.max_lora_rank = (min(merged.max_lora_rank, one.max_lora_rank) if merged.enabled
                                    else one.max_lora_rank)
            merged.enabled = True
        for adapter in one.adapters:
            if adapter.name not in names:
                names.add(adapter.name)
                merged.adapters.append(adapter)
    return merged


class LoRARegistry:
    """The adapters the engines serve, and loading and unloading them on every replica."""

    def __init__(self, engine: Replicas, allow_updates: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.allow_updates = allow_updates
        self._clock = clock
        self._updating = asyncio.Lock()  # one load / unload at a time: each starts from the lists the last left
        self._refresh: asyncio.Future | None = None
        self._refreshed_at = float("-inf")

    def _live(self) -> list[Replica]:
        return [r for r in self.engine.replicas if r.connected and not r.retired]

    # -- the list --------------------------------------------------------------------------------
    @property
    def known(self) -> bool:
        """Some connected replica has listed its adapters (before that, no name is known unknown)."""
        return any(r.lora is not None for r in self._live())

    def served(self) -> common_pb2.LoRAAdapters:
        """The adapters as the replicas last listed them (no call made)."""
        return served_adapters(r.lora for r in self._live() if r.lora is not None)

    def get(self, name: str) -> common_pb2.LoRAAdapter | None:
        return next((a for a in self.served().adapters if a.name == name), None)

    async def find(self, name: str) -> common_pb2.LoRAAdapter | None:
        """The served adapter of this name; the replicas are asked again before it is None."""
        adapter = self.get(name)
        if adapter is None:
            await self.refresh()
            adapter = self.get(name)
        return adapter

    async def list(self) -> common_pb2.LoRAAdapters:
        await self.refresh()
        return self.served()

    async def refresh(self, max_age_s: float = REFRESH_MIN_S) -> None:
        """Have every connected replica list its adapters, unless that began less than
        `max_age_s` ago; callers arriving meanwhile wait for the same round."""
        if self._refresh is None or self._refresh.done():
            if self._clock() - self._refreshed_at < max_age_s:
                return
            self._refreshed_at = self._clock()
            self._refresh = asyncio.ensure_future(self._list_all(self._live()))
        await asyncio.shield(self._refresh)

    async def _list_all(self, replicas: Sequence[Replica]) -> None:
        results = await asyncio.gather(*(r.refresh_lora() for r in replicas), return_exceptions=True)
        for replica, result in zip(replicas, results):
            if isinstance(result, BaseException):  # its last list stands
                log.warning("ListLoRAAdapters failed", extra={"engine": replica.addr, "error": _describe(result)})

    # -- run-time changes -------------------------------------------------------------------------
    async def load(self, name: str, path: str) -> common_pb2.LoRAAdapter:
        """Load the adapter at `path` as `name` on every connected replica."""
        self._check_allowed()
        missing = [field for field, value in (("lora_name", name), ("lora_path", path)) if not value]
        if missing:
            raise LoRAError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required",
                            param=missing[0])
        return await self._on_every_replica("load", name, lambda r: r.load_lora(name, path), path=path)

    async def unload(self, name: str) -> common_pb2.LoRAAdapter:
        """Unload the adapter `name` from every connected replica."""
        self._check_allowed()
        if not name:
            raise LoRAError(grpc.StatusCode.INVALID_ARGUMENT, "lora_name is required", param="lora_name")
        return await self._on_every_replica("unload", name, lambda r: r.unload_lora(name))

    def _check_allowed(self) -> None:
        if not self.allow_updates:
            raise LoRAError(grpc.StatusCode.FAILED_PRECONDITION, RUNTIME_UPDATES_OFF)

    async def _on_every_replica(self, what: str, name: str,
                                call: Callable[[Replica], Awaitable[common_pb2.LoRAAdapter]],
                                **log_fields) -> common_pb2.LoRAAdapter:
        async with self._updating:
            replicas = self._live()
            if not replicas:
                raise LoRAError(grpc.StatusCode.UNAVAILABLE, "no engine replica is connected")
            results = await asyncio.gather(*(self._call_and_list(r, call) for r in replicas),
                                           return_exceptions=True)
        done = [r for r in results if isinstance(r, common_pb2.LoRAAdapter)]
        failures = [(replica, r) for replica, r in zip(replicas, results) if not isinstance(r, common_pb2.LoRAAdapter)]
        if what == "unload" and done:  # gone from every replica either way
            failures = [(replica, r) for replica, r in failures if _code(r) != grpc.StatusCode.NOT_FOUND]
        for replica, error in failures:
            log.warning(f"LoRA adapter {what} failed", extra={"lora_name": name, "engine": replica.addr,
                                                              "error": _describe(error), **log_fields})
        if failures:
            replica, error = failures[0]
            message = _message(error)
            if len(replicas) > 1:
                message = f"engine {replica.addr}: {message}"
                if done:
                    message += f" ({len(done)} of {len(replicas)} engine replicas did {what} it)"
            raise LoRAError(_code(error), message)
        log.info(f"LoRA adapter {what}ed", extra={"lora_name": name, "engines": len(replicas),
                                                   "rank": done[0].rank, **log_fields})
        return done[0]

    @staticmethod
    async def _call_and_list(replica: Replica,
                             call: Callable[[Replica], Awaitable[common_pb2.LoRAAdapter]]) -> common_pb2.LoRAAdapter:
        """The call on one replica, then its list read again (whatever the call's outcome: a
        failure may have changed nothing, or may come after the change, a lost answer)."""
        try:
            return await call(replica)
        finally:
            try:
                await replica.refresh_lora()
            except grpc.aio.AioRpcError as exc:
                log.warning("ListLoRAAdapters failed", extra={"engine": replica.addr, "error": _describe(exc)})


def _code(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code()
    if isinstance(error, StatusError):
        return error.code
    return grpc.StatusCode.INTERNAL


def _message(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.details() or error.code().name
    if isinstance(error, StatusError):
        return error.message
    return repr(error)


def _describe(error: BaseException) -> str:
    return f"{_code(error).name}: {_message(error)}"
