"""EngineCore (the seed's): a Scheduler and an Executor, stepped by a run loop.

EngineCore is synchronous and has no gRPC in it: tests and benchmarks drive it
in-process with add_request / step. EngineCoreLoop runs it on its own thread:
each iteration takes in new requests and aborts, schedules, executes and hands
the step's outputs to a callback (the gRPC server's fan-out), so a slow client
never blocks a step.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from tessera_engine.config import EngineConfig
from tessera_engine.executor import Executor
from tessera_engine.kv_cache import KVCacheManager
from tessera_engine.models.loader import LoadedModel
from tessera_engine.request import EngineCoreRequest, Request, RequestStatus
from tessera_engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class RequestRejected(Exception):
    """A request the engine refuses; code is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclasses.dataclass
class EngineCoreOutput:
    """One sample's progress in one step (maps onto tessera.v1.RequestOutput)."""
    request_id: str
    index: int
    client_id: str
    new_token_ids: list[int]
    logprobs: list[tuple] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None  # stop, length, abort, error
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: tuple[str, str] | None = None  # (code, message)
    timing: "RequestTiming | None" = None  # set on a finished sample's last output


@dataclasses.dataclass
class RequestTiming:
    """A finished sample's timestamps (unix seconds; None when it never got there) and
    token count: the raw material of the request metrics and the 'request finished' log line."""
    queued: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float
    num_generation_tokens: int


@dataclasses.dataclass
class IterationStats:
    """What one engine step did (one record per step that ran; the metrics' per-step input)."""
    step: int
    duration_s: float           # schedule + execute + outputs, wall clock
    num_batched_tokens: int     # tokens the model computed this step (prefill chunks + decodes)
    num_prompt_tokens: int      # prompt lengths of the samples that got their first token
    num_generation_tokens: int  # tokens sampled (= new_token_ids emitted) this step
    num_preempted: int


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    kv_cache_usage: float


_FINISH = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
           RequestStatus.FINISHED_ABORTED: "abort"}


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        config.validate()
        self.config = config
        self.executor = Executor(config, loaded)
        self.max_model_len = self.executor.max_model_len
        self.model_name = self.executor.model_name
        self.vocab_size = self.executor.hf_config.vocab_size
        eos = getattr(self.executor.hf_config, "eos_token_id", None)
        self.default_eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.kv_cache = KVCacheManager(self.executor.num_blocks, config.block_size,
                                       config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache, self.max_model_len)
        self.step_count = 0
        self.last_iteration: IterationStats | None = None  # the latest step() that ran, else None

    # -- intake ----------------------------------------------------------------
    def check_request(self, req: EngineCoreRequest) -> None:
        """Raise RequestRejected when the request cannot run here."""
        p = req.sampling_params
        try:
            p.validate()
        except ValueError as exc:
            raise RequestRejected("INVALID_ARGUMENT", str(exc)) from None
        n = len(req.prompt_token_ids)
        if n == 0:
            raise RequestRejected("INVALID_ARGUMENT", "prompt_token_ids is empty")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejected("INVALID_ARGUMENT",
                                  f"prompt_token_ids: {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if n + p.max_tokens > self.max_model_len:
            raise RequestRejected(
                "INVALID_ARGUMENT",
                f"prompt ({n} tokens) + max_tokens ({p.max_tokens}) exceeds max_model_len ({self.max_model_len})")
        needed = -(-(n + p.max_tokens) // self.config.block_size)
        if needed > self.kv_cache.num_blocks:
            raise RequestRejected(
                "RESOURCE_EXHAUSTED",
                f"request needs {needed} KV blocks but the cache has only {self.kv_cache.num_blocks}")
        if any((req.request_id, i) in self.scheduler.requests for i in range(p.n)):
            raise RequestRejected("ALREADY_EXISTS", f"request_id {req.request_id!r} is already running")

    def add_request(self, req: EngineCoreRequest) -> None:
        self.check_request(req)
        eos = req.eos_token_ids or self.default_eos
        for i in range(req.sampling_params.n):
            self.scheduler.add_request(Request(req, i, eos))

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort every sample of these requests."""
        wanted = set(request_ids)
        return self.abort_samples([key for key in self.scheduler.requests if key[0] in wanted])

    def abort_samples(self, keys: list[tuple[str, int]]) -> list[EngineCoreOutput]:
        """Abort single samples, (request_id, index); unknown or finished ones are ignored."""
        outs = []
        for key in keys:
            req = self.scheduler.requests.get(key)
            if req is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                outs.append(self._output(req, []))
        return outs

    def abort_client(self, client_id: str) -> list[EngineCoreOutput]:
        ids = {r.request_id for r in self.scheduler.requests.values() if r.client_id == client_id}
        return self.abort_requests(list(ids))

    # -- the step --------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.empty:
            self.last_iteration = None
            return []
        result = self.executor.execute_model(sched)
        for key, entries in result.prompt_logprobs.items():
            self.scheduler.requests[key].prompt_logprobs.extend(entries)
        self.scheduler.update_after_step(sched, result.sampled)
        self.step_count += 1
        now = time.time()
        num_prompt_tokens = 0
        outs = []
        for s in sched.scheduled:
            req = s.request
            token = result.sampled.get(req.key)
            if token is None:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
                num_prompt_tokens += req.num_prompt_tokens
            req.last_token_time = now
            out = self._output(req, [token], now)
            lp = result.logprobs.get(req.key)
            if lp is not None:
                out.logprobs = [lp]
            if not req.prompt_logprobs_done:
                out.prompt_logprobs = req.prompt_logprobs
                req.prompt_logprobs_done = True
            outs.append(out)
        self.last_iteration = IterationStats(self.step_count, time.perf_counter() - started,
                                             sched.num_batched_tokens, num_prompt_tokens, len(outs),
                                             len(sched.preempted))
        return outs

    def _output(self, req: Request, tokens: list[int], now: float | None = None) -> EngineCoreOutput:
        out = EngineCoreOutput(
            request_id=req.request_id, index=req.index, client_id=req.client_id,
            new_token_ids=tokens, finish_reason=_FINISH.get(req.status),
            stop_token_id=req.stop_token_id, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0))
        if out.finish_reason is not None:
            out.timing = RequestTiming(req.queued_time, req.first_scheduled_time, req.first_token_time,
                                       req.last_token_time, now or time.time(), req.num_output_tokens)
        return out

    def stats(self) -> EngineStats:
        kv = self.kv_cache.stats()
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), kv.num_blocks,
                           kv.num_free_blocks, kv.prefix_cache_queries, kv.prefix_cache_hits,
                           self.scheduler.num_preemptions, kv.usage)

    # -- in-process convenience (tests, benchmarks) -------------------------------
    def generate(self, requests: list[EngineCoreRequest]) -> dict[tuple, list[int]]:
        """Run the given requests to completion; returns (request_id, index) -> output token ids."""
        for r in requests:
            self.add_request(r)
        tokens: dict[tuple, list[int]] = {}
        while self.has_unfinished():
            for out in self.step():
                tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        return tokens


# (step count, outputs, scheduler stats after the step, the step's IterationStats or None when
# no step ran, e.g. after an abort). Called on the core thread; keep it short.
OutputCallback = Callable[[int, list[EngineCoreOutput], EngineStats, "IterationStats | None"], None]


IDLE_BATCH_GAP_S = 0.001  # idle start: inputs this close together belong to one burst


class EngineCoreLoop:
    """Runs EngineCore.run_loop on its own thread; other threads talk to it through a queue.

    Burst start: a frontend that has more requests on their way says so with each
    message (`more_coming`, after the message's adds). An engine that was idle then
    keeps taking inputs, up to config.idle_batch_wait_ms, until a message without the
    hint arrives, and only then runs its first step: a burst of requests starts in one
    step instead of its first few arrivals taking a prefill step on their own while the
    rest wait behind it. Requests that reach an idle engine less than IDLE_BATCH_GAP_S
    apart are taken together too (a burst from several frontends, or one whose first
    arrivals come before the frontend knows of the rest). A running engine never waits.
    """

    def __init__(self, core: EngineCore, on_outputs: OutputCallback,
                 fault_after_steps: int | None = None) -> None:
        self.core = core
        self.on_outputs = on_outputs
        # Test-only fault injection: the loop raises instead of running step N+1.
        self.fault_after_steps = fault_after_steps
        self.inputs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self.run_loop, name="engine-core", daemon=True)
        self.stopped = False
        self.error: BaseException | None = None

    def start(self) -> None:
        self.thread.start()

    def run_here(self) -> None:
        """Run the loop on the calling thread instead of a new one (see server.load: on CPU,
        the thread that loaded the model is the one whose torch thread team runs fastest)."""
        self.thread = threading.current_thread()
        self.run_loop()

    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def add(self, req: EngineCoreRequest) -> None:
        self.inputs.put(("add", req))

    def abort(self, request_ids: list[str]) -> None:
        self.inputs.put(("abort", request_ids))

    def more_coming(self, more: bool) -> None:
        """The sender's hint after its adds: more requests are on their way (see the class doc)."""
        self.inputs.put(("more", more))

    def abort_samples(self, keys: list[tuple[str, int]]) -> None:
        self.inputs.put(("abort_samples", keys))

    def abort_client(self, client_id: str) -> None:
        self.inputs.put(("abort_client", client_id))

    def stop(self) -> None:
        self.stopped = True
        self.inputs.put(("stop", None))

    def _handle(self, kind: str, arg, outs: list[EngineCoreOutput]) -> None:
        if kind == "add":
            try:
                self.core.add_request(arg)
            except RequestRejected as exc:
                outs.append(EngineCoreOutput(arg.request_id, 0, arg.client_id, [], finish_reason="error",
                                             num_prompt_tokens=len(arg.prompt_token_ids),
                                             error=(exc.code, exc.message)))
        elif kind == "abort":
            outs.extend(self.core.abort_requests(arg))
        elif kind == "abort_samples":
            outs.extend(self.core.abort_samples(arg))
        elif kind == "abort_client":
            outs.extend(self.core.abort_client(arg))  # nobody reads them, but they are counted and logged

    def _take_inputs(self, outs: list[EngineCoreOutput], idle: bool) -> bool | None:
        """Handle the queued inputs; True when there were any, None when told to stop.

        Idle: block for the first input (nothing to run), then, while the latest hint
        says more requests are coming, wait for them up to idle_batch_wait_ms.
        """
        handled = more = False
        block = idle
        wait_s = self.core.config.idle_batch_wait_ms / 1000 if idle else 0.0
        deadline = last = 0.0
        while True:
            if block:
                timeout = None
            elif wait_s:  # idle start: until the burst stops (no hint, no input for the gap) or the deadline
                timeout = max(0.0, (deadline if more else min(deadline, last + IDLE_BATCH_GAP_S)) - time.monotonic())
            else:
                timeout = 0.0
            try:
                kind, arg = self.inputs.get(block=block or timeout > 0, timeout=timeout)
            except queue.Empty:
                return handled
            if kind == "stop":
                return None
            last = time.monotonic()
            if block:
                deadline = last + wait_s
            block = False
            if kind == "more":
                more = bool(arg)
                continue
            self._handle(kind, arg, outs)
            handled = True

    def run_loop(self) -> None:
        """receive → add → schedule → execute → emit, until stopped."""
        try:
            while not self.stopped:
                outs: list[EngineCoreOutput] = []
                handled = self._take_inputs(outs, idle=not self.core.has_unfinished())
                if handled is None:
                    return
                if (self.fault_after_steps is not None and self.core.has_unfinished()
                        and self.core.step_count >= self.fault_after_steps):
                    raise RuntimeError(f"injected fault after {self.core.step_count} steps "
                                       "(TESSERA_ENGINE_FAULT_AFTER_STEPS)")
                outs.extend(self.core.step())
                iteration = self.core.last_iteration
                if iteration is not None and log.isEnabledFor(logging.DEBUG):
                    log.debug("step", extra={"step": iteration.step, "tokens": iteration.num_batched_tokens,
                                             "sampled": iteration.num_generation_tokens,
                                             "ms": round(iteration.duration_s * 1000, 3)})
                if outs or iteration is not None or handled:
                    self.on_outputs(self.core.step_count, outs, self.core.stats(), iteration)
        except BaseException as exc:  # the loop dying must be visible to health checks
            self.error = exc
            log.exception("engine core loop died")
            raise
