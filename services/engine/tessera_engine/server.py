"""gRPC adapter around EngineCoreLoop: the EngineService Session stream, health, reflection,
metrics, flags.

Each frontend keeps one Session stream open. Requests and aborts arrive on it;
the core loop's per-step outputs are grouped by session and each session gets
one EngineStepOutputs message per step. Closing a session aborts its requests.

Drain (SIGTERM / SIGINT): health turns NOT_SERVING at once, new requests on open
sessions are refused with UNAVAILABLE (the frontend retries a request that has no
token yet on another replica). With --drain-mode handoff (the default) every session is
told so at once (EngineStepOutputs.handoff): a frontend with another replica serving moves
its requests there (they continue exactly: EngineRequest.resumed) and aborts them here, so
the drain ends as soon as they are gone; with `wait`, or where no other replica serves,
requests in flight run to the end. Either way, after at most --drain-timeout-s every
session is closed (OK) and the process exits 0; what is still running then is aborted
(and the frontend migrates it).

Health is SERVING only while the model is loaded and the core loop runs: a watcher
turns it NOT_SERVING when the loop dies or one step runs past --step-timeout-s (the
watchdog), ends every open session with UNAVAILABLE so that no request waits forever,
and EXIT_AFTER_FAILURE_S later stops the process with exit code 1, so that compose's
restart policy or Kubernetes starts a fresh one. The same truth is on the metrics
port's HTTP /health until then. A model that fails to load ends the process as well, after
one error line naming it and why (exit code 3: it can never be served as configured, so a
restart will not help; tessera_engine.load_failure).

Test-only fault injection (tessera_engine.fault_injection): with the environment variable
TESSERA_ENGINE_FAULT_AFTER_STEPS=N the core loop raises instead of running step N+1;
with TESSERA_ENGINE_HANG_AFTER_STEPS=N step N+1 never returns.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import threading
import time
from typing import Callable

import grpc

from tessera.common import tls, tracing
from tessera.common.flags import add_common_flags, add_flag
from tessera.common.grpc_server import GrpcServer, run_service
from tessera.common.grpc_service import Health
from tessera.common.heap import freeze_startup_heap
from tessera.common.logs import client_request_id
from tessera.common.metrics import add_metrics_flag
from tessera.common.samples import OpenSamples
from tessera.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tessera_engine import allocator, fault_injection, load_failure
from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore, EngineCoreLoop, RequestRejected
from tessera_engine.lora import LoRAError
from tessera_engine.metrics import EngineMetrics
from tessera_engine.outputs import EngineCoreOutput, EngineStats, IterationStats, TokenLogprobs
from tessera_engine.request import EngineCoreRequest, SampleKey
from tessera_engine.sampling_params import SamplingParams
from tessera_engine.session_outbox import SessionOutbox

log = logging.getLogger("tessera.engine")

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name

LOOP_WATCH_S = 0.25  # how often the watcher checks that the core loop is alive
EXIT_AFTER_FAILURE_S = 3.0  # NOT_SERVING and the sessions' UNAVAILABLE go out before the process exits
_LOOP_DIED = object()  # put on every session queue when the core loop dies
_INPUTS_ENDED = object()  # put on a session's queue when its client's inputs end
_DRAINED = object()  # put on every session queue when the drain is over: the session ends (OK)
_HANDOFF = object()  # put on every session queue when a handoff drain starts: the frontend is told
DRAIN_MODES = ("handoff", "wait")
DRAINING_MESSAGE = "engine is draining (shutting down): the request was not started; retry it on another replica"

_FINISH = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "stop": common_pb2.FINISH_REASON_STOP,
           "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT,
           "error": common_pb2.FINISH_REASON_ERROR}


def _logprob_entry(entry: TokenLogprobs | None) -> common_pb2.PositionLogprobs:
    if entry is None:
        return common_pb2.PositionLogprobs()
    return common_pb2.PositionLogprobs(
        chosen=common_pb2.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank),
        top=[common_pb2.TokenLogprob(token_id=t, logprob=l, rank=r + 1)
             for r, (t, l) in enumerate(zip(entry.top_ids, entry.top_logprobs))])


def output_to_proto(o: EngineCoreOutput) -> engine_pb2.RequestOutput:
    msg = engine_pb2.RequestOutput(
        request_id=o.request_id, index=o.index, new_token_ids=o.new_token_ids,
        finish_reason=_FINISH[o.finish_reason], num_prompt_tokens=o.num_prompt_tokens,
        num_cached_tokens=o.num_cached_tokens,
        logprobs=[_logprob_entry(e) for e in o.logprobs])
    if o.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(_logprob_entry(e) for e in o.prompt_logprobs)
    if o.stop_token_id is not None:
        msg.stop_token_id = o.stop_token_id
    if o.error is not None:
        msg.error.code, msg.error.message = o.error
    return msg


def stats_to_proto(s: EngineStats) -> engine_pb2.EngineStats:
    return engine_pb2.EngineStats(
        num_running=s.num_running, num_waiting=s.num_waiting, num_blocks_total=s.num_blocks_total,
        num_blocks_free=s.num_blocks_free, prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions,
        kv_cache_usage=s.kv_cache_usage)


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, config: EngineConfig, health: Health, request_stop: Callable[[], None],
                 drain_mode: str = "handoff") -> None:
        self.config = config
        self.drain_mode = drain_mode
        self.health = health
        self.request_stop = request_stop  # the process's stop (the watcher's, on a dead or stuck loop)
        self.failure: str | None = None   # why the loop is dead or stuck, once it is (the process then exits 1)
        self.core: EngineCore | None = None
        self.loop_runner: EngineCoreLoop | None = None
        self.metrics: EngineMetrics | None = None
        self.watcher: asyncio.Task | None = None
        self.sessions: dict[str, SessionOutbox] = {}
        self._session_ids = itertools.count()
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        # the requests accepted, by (session, request id): the drain waits for none left
        self._in_flight: OpenSamples[tuple[str, str]] = OpenSamples()
        self._idle = asyncio.Event()
        self._idle.set()
        self.traces = tracing.EngineTraces()  # traced requests in flight (empty unless tracing is on)

    async def load(self) -> None:
        """Load the model off the event loop, then start the core loop and report SERVING."""
        self._aio_loop = asyncio.get_running_loop()
        self.loop_runner = await self._start_core_thread()
        self.core = self.loop_runner.core
        self.metrics = EngineMetrics(
            self.core.model_name, self.core.max_model_len, block_size=self.config.block_size,
            num_blocks=self.core.kv_cache.num_blocks, enable_prefix_caching=self.config.enable_prefix_caching)
        if self.core.lora is not None:
            self.metrics.max_lora = self.core.lora.max_loras
        self.metrics.record_step(self.core.stats(), None)
        self.watcher = asyncio.create_task(self._watch_loop(), name="core-loop-watcher")
        freeze_startup_heap(log)
        await self.health.set(True)
        log.info("engine ready", extra={"model": self.core.model_name, "num_blocks": self.core.kv_cache.num_blocks})

    async def _watch_loop(self) -> None:
        """Once the core loop is dead or a step overruns --step-timeout-s: NOT_SERVING, every
        session ended (UNAVAILABLE), then the process stopped with exit code 1."""
        runner = self.loop_runner
        limit = self.config.step_timeout_s
        while runner.alive():
            started = runner.step_started
            if limit and started is not None and time.monotonic() - started > limit:
                self.failure = f"a step ran past --step-timeout-s ({limit:g} s)"
                break
            await asyncio.sleep(LOOP_WATCH_S)
        else:
            if runner.stopped and runner.error is None:
                return  # stopped on purpose
            self.failure = f"engine core loop died: {runner.error!r}"
        log.error("engine core loop is dead; health is NOT_SERVING",
                  extra={"error": self.failure, "sessions": len(self.sessions), "exit_in_s": EXIT_AFTER_FAILURE_S})
        await self.health.set(False)
        for q in self.sessions.values():
            q.put_control(_LOOP_DIED)
        await asyncio.sleep(EXIT_AFTER_FAILURE_S)
        log.error("exiting so that the engine is restarted", extra={"exit_code": 1})
        self.request_stop()

    async def _start_core_thread(self) -> EngineCoreLoop:
        """Load the model on a new thread that then runs the core loop; return the loop once loaded.

        One thread does both because torch's CPU thread team (OpenMP) belongs to the first
        thread that runs an op, and a loop on a second thread measured much slower.
        """
        loaded: asyncio.Future = self._aio_loop.create_future()

        def settle(value=None, exc: BaseException | None = None) -> None:
            if not loaded.done():
                loaded.set_exception(exc) if exc is not None else loaded.set_result(value)

        def core_thread() -> None:
            try:
                core = EngineCore(self.config)
                core.warm_up()
                fault_injection.arm_from_env(core)
                runner = EngineCoreLoop(core, self._on_outputs)
            except BaseException as exc:  # noqa: BLE001 (handed to load(), which raises it)
                self._aio_loop.call_soon_threadsafe(settle, None, exc)
                return
            runner.thread = threading.current_thread()  # alive() from now on, before the loop's first turn
            self._aio_loop.call_soon_threadsafe(settle, runner)
            runner.run_here()

        threading.Thread(target=core_thread, name="engine-core", daemon=True).start()
        return await loaded

    # called on the core thread once per loop iteration that did something
    def _on_outputs(self, outs: list[EngineCoreOutput], stats: EngineStats,
                    iteration: IterationStats | None) -> None:
        by_client: dict[str, list[EngineCoreOutput]] = {}
        finished = []
        for o in outs:
            by_client.setdefault(o.client_id, []).append(o)
            if o.finish_reason is not None:
                finished.append(o)
        self._aio_loop.call_soon_threadsafe(self._deliver, by_client, stats, iteration, finished)

    def _deliver(self, by_client: dict, stats: EngineStats, iteration: IterationStats | None,
                 finished: list[EngineCoreOutput]) -> None:
        if self.metrics is not None:  # None only in the instant between the model load and load()'s return
            self.metrics.record_step(stats, iteration)
            for o in finished:
                self.metrics.record_finished(o)
        for o in finished:
            self._note_finished(o.client_id, o.request_id, o.finish_reason == "error")
            if tracing.ENABLED and self.traces:  # its spans, from the timestamps it kept
                self.traces.finished(o)
        for client_id, outs in by_client.items():
            q = self.sessions.get(client_id)
            if q is not None:
                q.put_step(engine_pb2.EngineStepOutputs(outputs=[output_to_proto(o) for o in outs]))

    def _note_finished(self, client_id: str, request_id: str, whole_request: bool) -> None:
        """One sample finished (an error ends the whole request)."""
        if self._in_flight.finish((client_id, request_id), whole_request) and not self._in_flight:
            self._idle.set()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, wait up to `timeout_s` for those in flight, end every session
        (GrpcServer.stop runs it once health is NOT_SERVING)."""
        self.draining = True
        log.info("draining", extra={"in_flight": len(self._in_flight), "sessions": len(self.sessions),
                                    "drain_timeout_s": timeout_s, "drain_mode": self.drain_mode})
        started = time.monotonic()
        if self.drain_mode == "handoff":
            for q in self.sessions.values():
                q.put_control(_HANDOFF)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain timed out; aborting the requests still running",
                        extra={"in_flight": len(self._in_flight), "drain_timeout_s": timeout_s})
        else:
            log.info("drained", extra={"seconds": round(time.monotonic() - started, 3)})
        for q in self.sessions.values():
            q.put_control(_DRAINED)

    def _ready(self, context) -> bool:
        return self.loop_runner is not None and self.loop_runner.alive() and self.failure is None

    async def Session(self, request_iterator, context):
        if not self._ready(context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is not ready (model loading or loop stopped)")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
        client_id = f"s{next(self._session_ids)}"
        q = SessionOutbox()
        self.sessions[client_id] = q
        log.info("session opened", extra={"session": client_id, "peer": context.peer()})

        async def read_inputs() -> None:
            async for msg in request_iterator:
                for pb in msg.add:
                    self._submit(pb, client_id, q)
                if msg.add:
                    self.loop_runner.more_coming(msg.more_coming)
                if msg.abort.request_ids:
                    self.loop_runner.abort(list(msg.abort.request_ids))
                if msg.abort.samples:
                    self.loop_runner.abort_samples([SampleKey(r.request_id, r.index) for r in msg.abort.samples])

        reader = asyncio.create_task(read_inputs())
        # The reader's end (the client closed its side, or it failed) is one more item on the
        # queue, so the loop below waits on the queue alone: no task and no wait() per message.
        reader.add_done_callback(lambda _: q.put_control(_INPUTS_ENDED))
        try:
            while True:
                item = await q.get()
                if item is _INPUTS_ENDED:
                    reader.result()  # re-raise a reader failure
                    break  # the client closed its side
                if item is _LOOP_DIED:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, self.failure)
                if item is _DRAINED:
                    break
                if item is _HANDOFF:
                    item = engine_pb2.EngineStepOutputs(handoff=True)
                yield item
        finally:
            reader.cancel()
            self.sessions.pop(client_id, None)
            self.loop_runner.abort_client(client_id)
            for key in [k for k in self._in_flight if k[0] == client_id]:  # their outputs have nowhere to go
                self._note_finished(*key, whole_request=True)
                self.traces.discard(key[1])
            log.info("session closed", extra={"session": client_id})

    def _submit(self, pb: engine_pb2.EngineRequest, client_id: str, q: SessionOutbox) -> None:
        req = EngineCoreRequest(
            request_id=pb.request_id, prompt_token_ids=list(pb.prompt_token_ids), lora_name=pb.lora_name,
            sampling_params=SamplingParams.from_proto(pb.sampling_params), priority=pb.priority,
            arrival_time=pb.arrival_time or time.time(), eos_token_ids=list(pb.eos_token_ids) or None,
            client_id=client_id, resumed={r.index: list(r.output_token_ids) for r in pb.resumed} or None)
        try:
            if not pb.request_id:
                raise RequestRejected("INVALID_ARGUMENT", "request_id is empty")
            if self.draining:
                raise RequestRejected("UNAVAILABLE", DRAINING_MESSAGE)
            if (client_id, pb.request_id) in self._in_flight:  # the session's own bookkeeping needs it unique
                raise RequestRejected("ALREADY_EXISTS", f"request_id {pb.request_id!r} is already running")
        except RequestRejected as exc:
            out = exc.output(req)
            self.metrics.record_finished(out)  # the request's one log line
            q.put_step(engine_pb2.EngineStepOutputs(outputs=[output_to_proto(out)]))
            return
        self._in_flight.add((client_id, pb.request_id), len(req.sample_indices()))
        if tracing.ENABLED and pb.traceparent:
            self.traces.add(pb.request_id, pb.traceparent, len(req.sample_indices()))
        self._idle.clear()
        log.debug("request added", extra={"request_id": client_request_id(pb.request_id),
                                          "engine_request_id": pb.request_id,
                                          "prompt_tokens": len(req.prompt_token_ids), "n": req.sampling_params.n})
        self.loop_runner.add(req)

    async def GetStats(self, request, context):
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is loading")
        return stats_to_proto(self.core.stats())

    async def GetInfo(self, request, context):
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is loading")
        ex = self.core.executor
        return engine_pb2.EngineInfo(
            model_name=self.core.model_name, max_model_len=self.core.max_model_len,
            vocab_size=self.core.vocab_size, device=str(ex.device), dtype=str(ex.dtype).removeprefix("torch."),
            block_size=self.config.block_size, num_blocks=self.core.kv_cache.num_blocks)

    # -- LoRA adapters ---------------------------------------------------------------
    def _adapter_proto(self, adapter) -> common_pb2.LoRAAdapter:
        return common_pb2.LoRAAdapter(name=adapter.name, path=adapter.path, rank=adapter.rank,
                                      target_modules=adapter.target_modules)

    async def _lora_call(self, context, fn):
        """fn(core) on the core thread, between steps; a LoRAError ends the call with its status."""
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is loading")
        try:
            return await asyncio.wrap_future(self.loop_runner.call(fn))
        except LoRAError as exc:
            await context.abort(grpc.StatusCode[exc.code], str(exc))

    async def LoadLoRAAdapter(self, request, context):
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is loading")
        if self.core.lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this engine runs without LoRA: start it with --enable-lora")
        if not request.lora_name or not request.lora_path:
            missing = [f for f in ("lora_name", "lora_path") if not getattr(request, f)]
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{' and '.join(missing)} must be set")
        if request.lora_name in self.core.lora.adapters:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"LoRA adapter {request.lora_name!r} is already loaded")
        try:  # read and checked off the event loop and the core thread: nothing changes until it is whole
            adapter = await asyncio.to_thread(self.core.lora.read, request.lora_name, request.lora_path)
        except LoRAError as exc:
            log.warning("lora adapter refused", extra={"lora_name": request.lora_name, "error": str(exc)})
            await context.abort(grpc.StatusCode[exc.code], str(exc))
        adapter = await self._lora_call(context, lambda core: core.load_lora(adapter))
        return self._adapter_proto(adapter)

    async def UnloadLoRAAdapter(self, request, context):
        adapter = await self._lora_call(context, lambda core: core.unload_lora(request.lora_name))
        return self._adapter_proto(adapter)

    async def ListLoRAAdapters(self, request, context):
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is loading")
        lora = self.core.lora
        if lora is None:
            return common_pb2.LoRAAdapters(enabled=False)
        return common_pb2.LoRAAdapters(adapters=[self._adapter_proto(a) for a in list(lora.adapters.values())],
                                       enabled=True, max_loras=lora.max_loras, max_lora_rank=lora.max_lora_rank)


def parse_lora_modules(items: list[str]) -> list[tuple[str, str]]:
    """--lora-modules entries, `name=path` or vLLM's JSON form {"name": ..., "path": ...}, as
    (name, path) pairs; ValueError naming a malformed one."""
    out = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
                name, path = obj["name"], obj["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {item!r} is not JSON with \"name\" and \"path\"") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {item!r} is not name=path")
        out.append((str(name), str(path)))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tessera-engine", description="tessera engine core service")
    add_common_flags(p, 50053, "TESSERA_ENGINE_PORT")
    add_flag(p, "--model", "TESSERA_MODEL", None, help="HF directory or GGUF file (default: embedded SmolLM2-135M-Instruct)")
    add_flag(p, "--device", "TESSERA_DEVICE", "auto", help="auto, cpu or cuda")
    add_flag(p, "--dtype", "TESSERA_DTYPE", "auto",
             help="auto (bf16 on CUDA and on CPUs with native bf16: avx512_bf16 / amx_bf16; else fp32), "
                  "float32, bfloat16, float16")
    add_flag(p, "--max-model-len", "TESSERA_MAX_MODEL_LEN", None, type=int, help="max prompt + output tokens")
    add_flag(p, "--block-size", "TESSERA_BLOCK_SIZE", 16, type=int, help="tokens per KV block")
    add_flag(p, "--kv-cache-gib", "TESSERA_KV_CACHE_GIB", 1.0, type=float, help="KV cache size on CPU (GiB)")
    add_flag(p, "--gpu-memory-utilization", "TESSERA_GPU_MEMORY_UTILIZATION", 0.9, type=float,
             help="fraction of free GPU memory for the KV cache")
    add_flag(p, "--num-kv-blocks", "TESSERA_NUM_KV_BLOCKS", None, type=int, help="explicit KV pool size in blocks")
    add_flag(p, "--enable-prefix-caching", "TESSERA_ENABLE_PREFIX_CACHING", True, type=bool, help="reuse cached prefix blocks")
    add_flag(p, "--max-num-seqs", "TESSERA_MAX_NUM_SEQS", 256, type=int, help="cap on running sequences")
    add_flag(p, "--max-logprobs", "TESSERA_MAX_LOGPROBS", 20, type=int,
             help="cap on logprobs / prompt_logprobs a request may ask for (the frontend's flag of the same name)")
    add_flag(p, "--max-waiting-requests", "TESSERA_MAX_WAITING_REQUESTS", 1024, type=int,
             help="samples waiting to start past which new requests are refused with RESOURCE_EXHAUSTED "
                  "(HTTP 429 at the frontend; 0: no cap)")
    add_flag(p, "--step-timeout-s", "TESSERA_STEP_TIMEOUT_S", 60.0, type=float,
             help="watchdog: a step running longer turns the engine NOT_SERVING and exits it non-zero "
                  "(vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S; 0: off)")
    add_flag(p, "--max-num-batched-tokens", "TESSERA_MAX_NUM_BATCHED_TOKENS", None, type=int,
             help="token budget per step (default: 512 on CPU, 2048 on CUDA)")
    add_flag(p, "--scheduling-policy", "TESSERA_SCHEDULING_POLICY", "fcfs", choices=["fcfs", "priority"], help="queue order")
    add_flag(p, "--idle-batch-wait-ms", "TESSERA_IDLE_BATCH_WAIT_MS", 50.0, type=float,
             help="an idle engine told that more requests are coming (a burst) waits this long at most for "
                  "them before its first step (0: never)")
    add_flag(p, "--seed", "TESSERA_SEED", 0, type=int,
             help="seeds the seeds of requests that come without one (the frontend seeds every request)")
    add_flag(p, "--speculative-config", "TESSERA_SPECULATIVE_CONFIG", None,
             help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                  '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": N} (ngram: guesses '
                  'looked up in the request\'s own prompt and output; outputs are unchanged, greedy or seeded; '
                  'disable_by_batch_size unset: measured at start). Unset: off')
    add_flag(p, "--drain-mode", "TESSERA_DRAIN_MODE", "handoff", choices=list(DRAIN_MODES),
             help="on SIGTERM: handoff (the frontends move the requests in flight to another serving replica, "
                  "where they continue exactly; those with nowhere to go finish here) or wait (every request "
                  "finishes here); either way for --drain-timeout-s at most")
    add_flag(p, "--num-threads", "TESSERA_NUM_THREADS", None, type=int, help="torch CPU threads")
    add_flag(p, "--cpu-threads-bind", "TESSERA_CPU_THREADS_BIND", "auto",
             help="CPU: bind each compute thread to one CPU. auto: when the threads fill the CPUs this "
                  "process may use (one per CPU or per physical core); off; or a CPU list such as 0-3, "
                  "which also sets the thread count")
    add_flag(p, "--cpu-kernels", "TESSERA_CPU_KERNELS", True, type=bool,
             help="fused C++ kernels on CPU (built with gcc at install or first start; torch ops where they cannot be)")
    add_flag(p, "--cpu-kernels-prebuilt", "TESSERA_CPU_KERNELS_PREBUILT", None,
             help="load the fused CPU kernels from this module file instead of building them (the engine image)")
    add_flag(p, "--gguf-dequantize", "TESSERA_GGUF_DEQUANTIZE", False, type=bool,
             help="GGUF: dequantize every weight at load (default: the quantized types the CPU kernels take stay "
                  "as the file has them and their quantized matmul runs small batches on them)")
    add_flag(p, "--quantized-max-rows", "TESSERA_QUANTIZED_MAX_ROWS", None, type=int,
             help="GGUF on CPU: batches up to this many rows run a layer's quantized blocks on the quantized "
                  "matmul, larger ones its dense weights (0: never; default: every batch size with "
                  "--batch-invariant, else timed at first start on this CPU and model, then cached)")
    add_flag(p, "--batch-invariant", "TESSERA_BATCH_INVARIANT", True, type=bool,
             help="a row's results never depend on the batch it runs in: every batch size takes the same "
                  "matmul path, so the same greedy request gives the same text alone, batched, cached or "
                  "chunked (off: a layer with quantized blocks takes its dense weights past the timed "
                  "--quantized-max-rows crossover, faster for large batches)")
    add_flag(p, "--quantized-matmul", "TESSERA_QUANTIZED_MATMUL", "auto", choices=["auto", "int8", "exact"],
             help="GGUF on CPU: how the quantized matmul computes: int8 (activations quantized to int8 per "
                  "16 values, integer dot products on AVX512-VNNI, as llama.cpp; Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K "
                  "weights), exact (each block dequantized to the activations' dtype), auto (int8 in "
                  "bfloat16 where the kernels have VNNI, exact in float32)")
    add_flag(p, "--prompt-matmul", "TESSERA_PROMPT_MATMUL", "auto", choices=["auto", "dense", "quantized"],
             help="GGUF on CPU, batch-invariant: which matmul a prompt's rows take in the decoder layers: dense "
                  "(their bf16 weights, kept for it: AMX computes a prompt chunk several times faster), "
                  "quantized (as output rows always do), auto (timed at first start on this CPU and model, "
                  "then cached)")
    add_flag(p, "--enforce-eager", "TESSERA_ENFORCE_EAGER", False, type=bool,
             help="CPU kernels: run the decoder layers from the Python loop, op by op, instead of in one C++ "
                  "call a step (DecoderStack: the same kernel calls, the same results, without ~280 "
                  "interpreter round trips a step); for debugging and comparison")
    add_flag(p, "--allocator", allocator.ENV, "auto", choices=list(allocator.CHOICES),
             help="memory allocator: tcmalloc when found (auto), tcmalloc (required) or system (glibc); "
                  "the engine re-executes itself once to preload it")
    add_flag(p, "--enable-lora", "TESSERA_ENABLE_LORA", False, type=bool,
             help="serve LoRA adapters (PEFT's format) beside the base model: a request names one as its model")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   default=os.environ.get("TESSERA_LORA_MODULES", "").split(),
                   help="LoRA adapters loaded at start, each name=path (or vLLM's JSON {\"name\": ..., "
                        "\"path\": ...}), implies --enable-lora [env TESSERA_LORA_MODULES; space-separated, "
                        "default none]")
    add_flag(p, "--max-loras", "TESSERA_MAX_LORAS", 1, type=int,
             help="LoRA adapters in one step at most (their weights resident; the least recently used is "
                  "reloaded when another is needed)")
    add_flag(p, "--max-lora-rank", "TESSERA_MAX_LORA_RANK", 16, type=int,
             help="the largest LoRA rank accepted (memory per slot grows with it)")
    add_metrics_flag(p, "engine")
    args = p.parse_args(argv)
    try:
        args.lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as exc:
        p.error(str(exc))
    tls.check_flags(p, args)
    problem = allocator.check(args.allocator)
    if problem:
        p.error(problem)
    try:  # a bad setting is a usage error (exit 2, the flag's message), not a traceback at start
        config_from_args(args).validate()
    except ValueError as exc:
        p.error(str(exc))
    return args


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching, max_num_seqs=args.max_num_seqs,
        max_logprobs=args.max_logprobs, max_waiting_requests=args.max_waiting_requests,
        step_timeout_s=args.step_timeout_s,
        max_num_batched_tokens=args.max_num_batched_tokens, scheduling_policy=args.scheduling_policy,
        idle_batch_wait_ms=args.idle_batch_wait_ms, seed=args.seed, num_threads=args.num_threads,
        cpu_threads_bind=args.cpu_threads_bind,
        cpu_kernels=args.cpu_kernels, cpu_kernels_prebuilt=args.cpu_kernels_prebuilt,
        gguf_dequantize=args.gguf_dequantize, quantized_max_rows=args.quantized_max_rows,
        quantized_matmul=args.quantized_matmul, prompt_matmul=args.prompt_matmul,
        batch_invariant=args.batch_invariant,
        enforce_eager=args.enforce_eager,
        speculative_config=args.speculative_config, enable_lora=args.enable_lora, lora_modules=args.lora_modules,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)


async def serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; the process exit code (1: the port cannot be bound). A model
    that fails to load ends the engine at once, after one error line naming the model and why:
    exit code 3 when it can never be served as configured, 1 when a restart may load it
    (tessera_engine.load_failure)."""
    config = config_from_args(args)
    config.validate()
    log.info("memory allocator", extra=allocator.in_use())
    grpc_server = GrpcServer([SERVICE_NAME], log, grace_s=args.drain_timeout_s)
    servicer = EngineServicer(config, grpc_server.health, grpc_server.request_stop, args.drain_mode)
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, grpc_server.server)
    if await grpc_server.try_start(args.host, args.port, args.metrics_port, tls=tls.server_tls(args)) is None:
        return 1

    load = asyncio.create_task(servicer.load())
    load_failures: list[load_failure.LoadFailure] = []
    load.add_done_callback(lambda task: _on_load_done(task, config.model, load_failures, grpc_server.request_stop))
    await grpc_server.wait_for_stop()
    load.cancel()
    if servicer.watcher:
        servicer.watcher.cancel()  # the loop's end at shutdown is no crash
    running = servicer.loop_runner is not None and servicer.failure is None
    await grpc_server.stop(drain=(lambda: servicer.drain(args.drain_timeout_s)) if running else None)
    if servicer.loop_runner:
        servicer.loop_runner.stop()
    code = load_failures[0].exit_code if load_failures else 1 if servicer.failure else 0
    log.info("stopped", extra={"exit_code": code})
    return code


def _on_load_done(task: asyncio.Task, model: str | None, failures: list[load_failure.LoadFailure],
                  request_stop: Callable[[], None]) -> None:
    """A model that failed to load: one error line naming it and why, then the process stops
    (serve returns the failure's exit code). Waiting NOT_SERVING would help nobody: nothing
    retries a load, and an exit is what compose, Kubernetes and `tessera serve` can show."""
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    failure = load_failure.classify(exc)
    path = load_failure.model_path(model)
    what = "cannot serve the model" if failure.permanent else "could not load the model (a restart may)"
    log.error(f"{what} {path}: {failure.reason}", exc_info=exc if failure.traceback else None,
              extra={"model": path, "exit_code": failure.exit_code})
    failures.append(failure)
    request_stop()


def main(argv=None) -> int:
    return run_service("engine", serve, parse_args(argv))


if __name__ == "__main__":
    main()
