"""EngineCore: a Scheduler and an Executor, stepped by a run loop.

EngineCore is synchronous and has no gRPC in it: tests and benchmarks drive it
in-process with add_request / step. One step is one way: the scheduler's
SchedulerOutput goes to the executor, whose ModelRunnerOutput goes back to the
scheduler's update_from_output, which returns the step's EngineCoreOutputs.
EngineCoreLoop runs it on its own thread: each iteration takes in new requests
and aborts, steps, and hands the outputs to a callback (the gRPC server's
fan-out), so a slow client never blocks a step.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import logging
import queue
import threading
import time
from typing import Callable

import torch

from tessera.common.request_rules import SamplingCaps, request_problem, resumed_problem
from tessera_engine.config import EngineConfig
from tessera_engine.executor import Executor
from tessera_engine.kv_cache import KVCacheManager
from tessera_engine.lora import LoRAError
from tessera_engine.models.loader import LoadedModel
from tessera_engine.outputs import (EngineCoreOutput, EngineCoreOutputs, EngineStats, IterationStats,
                                    RequestError)
from tessera_engine.request import EngineCoreRequest, Sample, SampleKey
from tessera_engine.scheduler import Scheduler
from tessera_engine.speculative import NgramProposer, SpeculativeConfig, StepCost
from tessera_engine.structured_output import Constraint, StructuredOutputManager, hf_tokenizer_of

log = logging.getLogger(__name__)

MAX_FAILED_STEPS_IN_A_ROW = 3  # a step failing this many times running ends the core loop


_STEP_COST_TABLES: dict[tuple, dict[int, float]] = {}  # this process's measured step costs (StepCost)


class RequestRejected(Exception):
    """A request the engine refuses; code is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def output(self, req: EngineCoreRequest) -> EngineCoreOutput:
        """The refused request's one output: finished with this error."""
        return EngineCoreOutput(req.request_id, 0, req.client_id, [], finish_reason="error",
                                num_prompt_tokens=len(req.prompt_token_ids),
                                error=RequestError(self.code, self.message))


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
        plan = self.executor.plan
        self.kv_cache = KVCacheManager(self.executor.num_blocks, config.block_size,
                                       config.enable_prefix_caching, self.executor.kv_layout.windows,
                                       outputs_apart=plan.prompt_dense)
        speculative = SpeculativeConfig.parse(config.speculative_config)
        proposer = None
        if speculative is not None:
            proposer = (self.executor.draft_proposer(speculative) if speculative.method == "draft_model"
                        else NgramProposer(speculative))
        self.scheduler = Scheduler(config, self.kv_cache, self.max_model_len, plan.token_budget, proposer,
                                   prompt_apart=plan.prompt_dense)
        if speculative is not None and speculative.disable_by_batch_size is None:
            self.scheduler.step_cost = self._step_cost()  # a set disable_by_batch_size decides alone
            proposer.measure_cost()
        log.info("scheduler ready", extra={"token_budget": self.scheduler.token_budget,
                                           "max_num_seqs": config.max_num_seqs, "policy": config.scheduling_policy})
        self.step_count = 0
        self.failed_steps_in_a_row = 0
        self.structured = StructuredOutputManager(self._model_tokenizer, self.vocab_size)
        self._compiling: list[Sample] = []  # samples whose output constraint is still compiling
        self.lora = self.executor.lora  # lora.LoRAManager; None without --enable-lora
        for name, path in config.lora_modules:  # a bad one at start: the engine can never serve as asked
            self.load_lora(self.lora.read(name, path))

    def _step_cost(self) -> StepCost:
        """The forward pass's time by rows, for speculative decoding's per-step decision: measured
        on this model and plan once per process (engines over one model share it)."""
        plan = self.executor.plan
        key = (id(self.executor.model), plan.dtype, plan.quantized_max_rows, torch.get_num_threads())
        table = _STEP_COST_TABLES.get(key)
        if table is None:
            t0 = time.perf_counter()
            table = _STEP_COST_TABLES[key] = self.executor.runner.time_rows(StepCost.ROWS)
            log.info("speculative decoding: step cost measured", extra={
                "took_ms": round((time.perf_counter() - t0) * 1000, 1),
                "ms_by_rows": {r: round(t * 1000, 2) for r, t in table.items()}})
        return StepCost(table)

    def _model_tokenizer(self):
        """The model's HF tokenizer, which output constraints are compiled against."""
        from tessera.common.model_source import resolve_model

        src = resolve_model(self.config.model)
        return hf_tokenizer_of(str(src.directory), src.gguf_file)

    # -- intake ----------------------------------------------------------------
    def check_request(self, req: EngineCoreRequest) -> None:
        """Raise RequestRejected when the request cannot run here: the request rules
        (tessera.common.request_rules, the frontend's too: a client may call the engine
        directly) against this engine's model and caps, then its queue and running ids.
        Called on the core thread, which owns the state it reads."""
        p = req.sampling_params
        problem = request_problem(
            p, req.prompt_token_ids, vocab_size=self.vocab_size,
            caps=SamplingCaps(max_logprobs=self.config.max_logprobs), max_model_len=self.max_model_len,
            eos_token_ids=req.eos_token_ids or (), max_num_seqs=self.config.max_num_seqs,
            kv_cache_tokens=self.kv_cache.num_blocks * self.config.block_size,
            kv_tokens_needed=self._blocks_needed(len(req.prompt_token_ids) + p.max_tokens) * self.config.block_size)
        if problem is not None:
            raise RequestRejected(problem.code, str(problem))
        cap = self.config.max_waiting_requests
        if cap and self.scheduler.num_waiting + p.n > cap:
            raise RequestRejected(
                "RESOURCE_EXHAUSTED",
                f"the engine's waiting queue is full ({self.scheduler.num_waiting} samples waiting, "
                f"--max-waiting-requests {cap}); retry later")
        if req.resumed:
            problem = resumed_problem(req.resumed, p, self.vocab_size)
            if problem is not None:
                raise RequestRejected("INVALID_ARGUMENT", str(problem))
        if any((req.request_id, i) in self.scheduler.requests for i in req.sample_indices()):
            raise RequestRejected("ALREADY_EXISTS", f"request_id {req.request_id!r} is already running")
        self._adapter_of(req)

    def _adapter_of(self, req: EngineCoreRequest):
        """The LoRA adapter the request names (None: the base model); RequestRejected NOT_FOUND
        when this engine does not serve it."""
        if not req.lora_name:
            return None
        if self.lora is None:
            raise RequestRejected("NOT_FOUND", f"the LoRA adapter {req.lora_name!r} is not served here: this "
                                               "engine runs without LoRA (--enable-lora, --lora-modules)")
        try:
            return self.lora.get(req.lora_name)
        except LoRAError as exc:
            raise RequestRejected(exc.code, str(exc)) from None

    def _blocks_needed(self, num_tokens: int) -> int:
        """The most blocks (pages, counted per group as the pool counts them) a request of
        num_tokens tokens holds at once (KVCacheManager.blocks_needed)."""
        return self.kv_cache.blocks_needed(num_tokens, min(num_tokens, self.scheduler.token_budget))

    def add_request(self, req: EngineCoreRequest) -> None:
        self.check_request(req)
        eos = req.eos_token_ids or self.default_eos
        spec = req.sampling_params.structured
        adapter = self._adapter_of(req)
        for i in req.sample_indices():
            sample = Sample(req, i, eos)
            if adapter is not None:
                sample.lora, sample.cache_salt = adapter, adapter.salt
            if spec is not None:
                sample.constraint = Constraint(self.structured, spec)
                self._compiling.append(sample)
            self.scheduler.add_request(sample)

    def _check_compiled(self) -> list[EngineCoreOutput]:
        """Fail the samples whose constraint did not compile; forget those compiled or gone."""
        outs, still = [], []
        for req in self._compiling:
            if self.scheduler.requests.get(req.key) is not req:
                continue  # finished or aborted meanwhile
            error = req.constraint.error()
            if error is not None:
                outs += self.scheduler.fail([req], RequestError("INVALID_ARGUMENT", error))
            elif not req.constraint.ready:
                still.append(req)
        self._compiling = still
        return outs

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort every sample of these requests."""
        wanted = set(request_ids)
        return self.scheduler.abort([key for key in self.scheduler.requests if key.request_id in wanted])

    def abort_samples(self, keys: list[SampleKey]) -> list[EngineCoreOutput]:
        """Abort single samples; unknown or finished ones are ignored."""
        return self.scheduler.abort(keys)

    def abort_client(self, client_id: str) -> list[EngineCoreOutput]:
        ids = {r.request_id for r in self.scheduler.requests.values() if r.client_id == client_id}
        return self.abort_requests(list(ids))

    # -- LoRA adapters (read on any thread with self.lora.read; these on the core thread) --
    def _lora_manager(self):
        if self.lora is None:
            raise LoRAError("this engine runs without LoRA: start it with --enable-lora", "FAILED_PRECONDITION")
        return self.lora

    def load_lora(self, adapter):
        """Serve an adapter read by LoRAManager.read; LoRAError ALREADY_EXISTS when the name is taken."""
        return self._lora_manager().register(adapter)

    def unload_lora(self, name: str):
        """Stop serving an adapter (requests running with it finish); LoRAError NOT_FOUND if unknown."""
        return self._lora_manager().unregister(name)

    def lora_requests_info(self) -> tuple[list[str], list[str]]:
        """The adapters of the running and of the waiting requests (vLLM's lora_requests_info)."""
        running = {r.lora.name for r in self.scheduler.running if r.lora is not None}
        waiting = {r.lora.name for r in self.scheduler.waiting + self.scheduler.arrived if r.lora is not None}
        return sorted(running), sorted(waiting)

    # -- the step --------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def run_step(self) -> EngineCoreOutputs:
        """schedule -> execute -> update_from_output; iteration is None when nothing was scheduled."""
        started = time.perf_counter()
        failed = self._check_compiled() if self._compiling else []
        sched = self.scheduler.schedule()
        if sched.empty:
            if self._compiling and not failed:  # only constraints compiling: wait for one, not spin
                self.structured.wait_any([r.constraint for r in self._compiling], timeout_s=0.01)
            return EngineCoreOutputs(failed)
        try:
            result = self.executor.execute_model(sched)
            step = self.scheduler.update_from_output(sched, result)
            self.failed_steps_in_a_row = 0
        except Exception as exc:
            # The step's requests fail, not the engine; a fault that repeats (the model or
            # the device is broken) ends the loop, and the service exits to be restarted.
            self.failed_steps_in_a_row += 1
            if self.failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                raise
            log.exception("engine step failed; its requests fail", extra={
                "requests": len(sched.scheduled), "failed_steps_in_a_row": self.failed_steps_in_a_row})
            error = RequestError("INTERNAL", f"the engine step running this request failed: {exc!r}")
            outs = self.scheduler.fail([s.sample for s in sched.scheduled], error)
            step = EngineCoreOutputs(outs, IterationStats(0, 0.0, sched.num_batched_tokens, 0, len(outs),
                                                          len(sched.preempted)))
        self.step_count += 1
        step.outputs[:0] = failed
        step.iteration.step = self.step_count
        step.iteration.num_generation_tokens = sum(len(o.new_token_ids) for o in step.outputs)
        step.iteration.duration_s = time.perf_counter() - started
        return step

    def step(self) -> list[EngineCoreOutput]:
        """One step's outputs (run_step without its stats)."""
        return self.run_step().outputs

    def warm_up(self) -> None:
        """Run a full step's shapes once before serving (ModelRunner.warm_up says why)."""
        if self.has_unfinished() or self.kv_cache.stats().num_free_blocks != self.kv_cache.num_blocks:
            raise RuntimeError("warm_up runs only before any request")
        times = self.executor.runner.warm_up(min(self.scheduler.token_budget, self.max_model_len),
                                             self.config.max_num_seqs)
        log.info("warmed up", extra=times)

    def stats(self) -> EngineStats:
        kv = self.kv_cache.stats()
        stats = EngineStats(len(self.scheduler.running), self.scheduler.num_waiting, kv.num_blocks,
                            kv.num_free_blocks, kv.prefix_cache_queries, kv.prefix_cache_hits,
                            self.scheduler.num_preemptions, kv.usage)
        if self.lora is not None:
            running, waiting = self.lora_requests_info()
            stats.lora_running, stats.lora_waiting = tuple(running), tuple(waiting)
        return stats

    # -- in-process convenience (tests, benchmarks) -------------------------------
    def generate(self, requests: list[EngineCoreRequest]) -> dict[SampleKey, list[int]]:
        """Run the given requests to completion; returns (request_id, index) -> output token ids."""
        for r in requests:
            self.add_request(r)
        tokens: dict[SampleKey, list[int]] = {}
        while self.has_unfinished():
            for out in self.step():
                tokens.setdefault(SampleKey(out.request_id, out.index), []).extend(out.new_token_ids)
        return tokens


# (outputs, scheduler stats after the step, the step's IterationStats or None when no step ran,
# e.g. after an abort). Called on the core thread; keep it short.
OutputCallback = Callable[[list[EngineCoreOutput], EngineStats, "IterationStats | None"], None]


IDLE_BATCH_GAP_S = 0.001  # idle start: inputs this close together belong to one burst


class InputKind(enum.Enum):
    ADD = "add"                      # payload: an EngineCoreRequest
    ABORT = "abort"                  # payload: request ids (every sample of each)
    ABORT_SAMPLES = "abort_samples"  # payload: SampleKeys
    ABORT_CLIENT = "abort_client"    # payload: a client (session) id
    MORE_COMING = "more_coming"      # payload: bool, the sender's hint after its adds
    CALL = "call"                    # payload: (fn(core), Future): run between steps, result to the future
    STOP = "stop"                    # no payload


@dataclasses.dataclass(frozen=True)
class EngineCoreInput:
    """One message to the core loop from another thread."""
    kind: InputKind
    payload: object = None


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

    def __init__(self, core: EngineCore, on_outputs: OutputCallback) -> None:
        self.core = core
        self.on_outputs = on_outputs
        self.inputs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self.run_loop, name="engine-core", daemon=True)
        self.stopped = False
        self.error: BaseException | None = None
        self.step_started: float | None = None  # time.monotonic() while a step runs (the watchdog reads it)

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
        """Queue a request; it is checked on the core thread, and a refused one comes back as
        its one output, finished with the error."""
        self.inputs.put(EngineCoreInput(InputKind.ADD, req))

    def abort(self, request_ids: list[str]) -> None:
        self.inputs.put(EngineCoreInput(InputKind.ABORT, request_ids))

    def more_coming(self, more: bool) -> None:
        """The sender's hint after its adds: more requests are on their way (see the class doc)."""
        self.inputs.put(EngineCoreInput(InputKind.MORE_COMING, more))

    def abort_samples(self, keys: list[SampleKey]) -> None:
        self.inputs.put(EngineCoreInput(InputKind.ABORT_SAMPLES, keys))

    def abort_client(self, client_id: str) -> None:
        self.inputs.put(EngineCoreInput(InputKind.ABORT_CLIENT, client_id))

    def call(self, fn: Callable[["EngineCore"], object]) -> concurrent.futures.Future:
        """Run fn(core) on the core thread between steps (LoRA loads and unloads change what a
        step reads); its result or exception comes back through the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inputs.put(EngineCoreInput(InputKind.CALL, (fn, future)))
        return future

    def stop(self) -> None:
        self.stopped = True
        self.inputs.put(EngineCoreInput(InputKind.STOP))

    def _handle(self, msg: EngineCoreInput, outs: list[EngineCoreOutput]) -> None:
        kind, arg = msg.kind, msg.payload
        if kind is InputKind.ADD:
            try:
                self.core.add_request(arg)
            except RequestRejected as exc:
                outs.append(exc.output(arg))
        elif kind is InputKind.ABORT:
            outs.extend(self.core.abort_requests(arg))
        elif kind is InputKind.ABORT_SAMPLES:
            outs.extend(self.core.abort_samples(arg))
        elif kind is InputKind.ABORT_CLIENT:
            outs.extend(self.core.abort_client(arg))  # nobody reads them, but they are counted and logged
        elif kind is InputKind.CALL:
            fn, future = arg
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.core))
                except Exception as exc:
                    future.set_exception(exc)

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
                msg = self.inputs.get(block=block or timeout > 0, timeout=timeout)
            except queue.Empty:
                return handled
            if msg.kind is InputKind.STOP:
                return None
            last = time.monotonic()
            if block:
                deadline = last + wait_s
            block = False
            if msg.kind is InputKind.MORE_COMING:
                more = bool(msg.payload)
                continue
            self._handle(msg, outs)
            handled = True

    def run_loop(self) -> None:
        """receive → add → schedule → execute → emit, until stopped."""
        try:
            while not self.stopped:
                outs: list[EngineCoreOutput] = []
                handled = self._take_inputs(outs, idle=not self.core.has_unfinished())
                if handled is None:
                    return
                self.step_started = time.monotonic()
                result = self.core.run_step()
                self.step_started = None
                outs.extend(result.outputs)
                iteration = result.iteration
                if iteration is not None and log.isEnabledFor(logging.DEBUG):
                    log.debug("step", extra={"step": iteration.step, "tokens": iteration.num_batched_tokens,
                                             "sampled": iteration.num_generation_tokens,
                                             "ms": round(iteration.duration_s * 1000, 3)})
                if outs or iteration is not None or handled:
                    self.on_outputs(outs, self.core.stats(), iteration)
        except BaseException as exc:  # the loop dying must be visible to health checks
            self.error = exc
            log.exception("engine core loop died")
            raise
