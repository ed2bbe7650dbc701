"""AsyncLLM: the frontend's engine facade (vLLM v1's AsyncLLM): tokenize, submit, stream outputs, abort.

`generate(request_id, prompt, params)` tokenizes the prompt (chat messages through
the model's chat template), builds the EngineRequest (with the LoRA adapter to run it
with, `lora_name`, when one is named), submits it to a replica and
yields a `SampleOutput` per sample per engine step until every sample has
finished. With a stream interval N > 1 (vLLM's and SGLang's `--stream-interval`) a
sample's first output goes out at once, then its outputs are held and merged until
they hold N tokens or the sample finishes: N times fewer messages to the client,
the same text and tokens in the end.

Bursts: each submission tells the engine whether more requests are still being
prepared here (SessionInput.more_coming), so that an idle engine starts a burst of
concurrent requests in one step.

Migration: when a replica's session breaks (the process killed, the node lost, the step
watchdog, a drain that ran out) or a draining replica hands its requests off, every
request it held continues on another replica: the same EngineRequest (prompt, sampling
parameters, seed, LoRA adapter) with `resumed`, each running sample's tokens so far (every token the
engine sent, delivered or still with the detokenizer), under a new engine request id (the
replica left behind may still hold the old one: a healed partition). The new replica prefills them and
continues each sample at the same output position of the same seed, so the text goes on
exactly as it would have; the detokenize state, usage and stop-string matching stay here,
untouched. A request migrates at most MAX_MIGRATIONS times, then fails UNAVAILABLE; with no
replica serving it waits up to the engine timeout (--engine-timeout-s) for one.
A request that an engine refuses with UNAVAILABLE before it produced any token (a
draining replica) is submitted again to another one, up to MAX_ATTEMPTS replicas in all;
the client sees one request either way.

If the consumer goes away first (the call is cancelled or the generator is closed),
the request is aborted in the engine and cancelled on the detokenize stream. Failures
surface as `GenerateError(code, message)`.

AsyncLLM wires the engine replicas' step outputs through the OutputProcessor and runs
its delivery loop (vLLM's output handler); every processor call returns an
`OutputProcessorOutput`, and AsyncLLM aborts what it names in the engine.

Besides the field ranges the API layer checks (`validation`), generate() checks
what needs the model, by the rules the engine checks too (tessera.common.request_rules):
token ids inside the vocabulary, the ranges again once defaults apply (min_tokens <=
max_tokens), and prompt + max_tokens within the model's length and the engines' KV
cache; each is INVALID_ARGUMENT naming the field.

Inside, the request runs under an engine request id "<request_id>-<random>": unique
per attempt (two frontends, a client reusing its id, or a retry never collide in the
engine), and still greppable by the client's id in every service's logs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from typing import AsyncIterator, Sequence, Union

import grpc

from tessera.common import tracing
from tessera.common.request_rules import Problem, request_problem, token_ids_problem
from tessera.v1 import common_pb2, engine_pb2, tokenizer_pb2
from tessera_frontend import metrics
from tessera_frontend.engine_client import EngineCoreClient, NoReplicaError
from tessera_frontend.grpc_util import StatusError
from tessera_frontend.output_processor import (Failure, OutputProcessor, OutputProcessorOutput, RequestState,
                                               SampleOutput)
from tessera_frontend.tokenizer_client import TokenizeError, TokenizerClient

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16  # vLLM's default
READY_WAIT_S = 3.0  # how long a request waits for the backends before UNAVAILABLE
MAX_ATTEMPTS = 3  # replicas a request that produced nothing yet is tried on (see _may_retry)
MAX_MIGRATIONS = 4  # times one request may move to another replica before it fails
MIGRATE_POLL_S = 0.05  # while no replica can take a migrating request: how often to look again

# Raw text, chat messages (rendered with the chat template), or token ids.
Prompt = Union[str, tokenizer_pb2.ChatMessages, Sequence[int]]


class GenerateError(StatusError):
    """A request failed; `code` is the gRPC status to report."""

    @classmethod
    def of(cls, problem: Problem) -> "GenerateError":
        """The error for a request that breaks a rule of request_rules."""
        return cls(grpc.StatusCode[problem.code], str(problem))


def _trace_usage(span, out: SampleOutput) -> None:
    """The request's usage on its `generate` span, from the last output (tracing only)."""
    if out.usage is not None:
        span.set_attributes({"gen_ai.usage.input_tokens": out.usage.prompt_tokens,
                             "gen_ai.usage.output_tokens": out.usage.completion_tokens})


@dataclasses.dataclass
class _Submission:
    """A request as sent to an engine: what a migration sends again, and its migrations."""
    client_id: str
    request: engine_pb2.EngineRequest
    replica: str
    engine_id: str  # its engine request id now (a migration gives it a new one)
    migrations: int = 0
    lost_at: float | None = None  # time.monotonic() of its last migration, until its next output
    task: asyncio.Task | None = None  # a migration waiting for a replica


class AsyncLLM:
    """Tokenizer + engine replicas + output processor behind one generate() call."""

    def __init__(self, tokenizer: TokenizerClient, engine: EngineCoreClient, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 (got {stream_interval})")
        self.tokenizer = tokenizer
        self.engine = engine
        self.stream_interval = stream_interval
        self._preparing = 0  # requests inside generate() not yet submitted (being tokenized)
        self.processor = OutputProcessor(tokenizer)
        self._delivery: asyncio.Task | None = None
        self._submissions: dict[str, _Submission] = {}  # by engine request id
        self._awaiting_output: set[str] = set()  # migrated, no output from the new replica yet

    def start(self) -> None:
        """Start the background tasks: the tokenizer streams, output delivery, the engine replicas."""
        self.tokenizer.start()
        self._delivery = asyncio.create_task(self._deliver_outputs(), name="output-delivery")
        self.engine.start(self._on_engine_step, self._on_engine_lost, self._on_handoff)

    async def close(self) -> None:
        await self.engine.close()
        if self._delivery is not None:
            self._delivery.cancel()
            await asyncio.gather(self._delivery, return_exceptions=True)
            self._delivery = None
        await self.tokenizer.close()

    @property
    def model_name(self) -> str | None:
        """The model's name as the tokenizer reports it (None until it answered)."""
        info = self.tokenizer.model_info
        return info.model_name if info is not None else None

    @property
    def ready(self) -> bool:
        return self.tokenizer.model_info is not None and self.tokenizer.connected and self.engine.ready

    @property
    def max_model_len(self) -> int | None:
        """The engines' limit when known, else the tokenizer's."""
        if self.engine.max_model_len:
            return self.engine.max_model_len
        info = self.tokenizer.model_info
        return info.max_model_len if info and info.max_model_len > 0 else None

    @tracing.traced_stream("generate", attributes=lambda self, request_id, *a, **kw: {"gen_ai.request.id": request_id},
                           on_item=_trace_usage)
    async def generate(self, request_id: str, prompt: Prompt, params: common_pb2.SamplingParams,
                       priority: int = 0, default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
                       lora_name: str = "") -> AsyncIterator[SampleOutput]:
        """Yield each sample's new output per engine step until all n samples have finished.

        `default_max_tokens` applies when params has no max_tokens; None means "up to the
        model's length" (OpenAI chat's default). `lora_name`: the LoRA adapter to run it with
        ("": the base model); one the engine does not serve fails NOT_FOUND.
        """
        arrival = time.time()
        self._preparing += 1
        try:
            await self.wait_ready()
            prompt_ids = await self._tokenize(request_id, prompt)
            params = self._with_defaults(params, len(prompt_ids), default_max_tokens)
            self._check_prompt(prompt_ids, params)
        finally:
            self._preparing -= 1
        tried: list[str] = []  # replicas this request was submitted to, in order
        while True:
            retry = False
            # The engine and the detokenize stream see a unique id per attempt, so a client id
            # that is reused (even while its previous request is still being aborted) never
            # mixes outputs, nor does a retry with its failed attempt.
            engine_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
            n = params.n
            state = RequestState(engine_id, n, _detokenize_open(params, prompt_ids),
                                 want_token_texts=params.HasField("logprobs") or params.HasField("prompt_logprobs"))
            self.processor.add_request(state)
            finished = completion_tokens = cached_tokens = 0
            held: dict[int, SampleOutput] = {}  # per choice: output not yet yielded (stream_interval)
            started: set[int] = set()  # choices whose first output went out
            sub: _Submission | None = None
            try:
                request = engine_pb2.EngineRequest(
                    request_id=engine_id, prompt_token_ids=prompt_ids, sampling_params=params,
                    priority=priority, arrival_time=arrival, eos_token_ids=self.tokenizer.model_info.eos_token_ids,
                    lora_name=lora_name, traceparent=tracing.current_traceparent())  # "" unless traced
                try:
                    replica = self.engine.submit(request, n, more_coming=self._preparing > 0, exclude=tried)
                except NoReplicaError as exc:
                    raise GenerateError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
                sub = self._submissions[engine_id] = _Submission(request_id, request, replica, engine_id)
                tried.append(replica)
                if tracing.ENABLED and len(tried) == 1:  # arrival to an engine's queue, from timestamps
                    tracing.record_span("queueing", arrival, time.time(), attributes={"tessera.engine": replica})
                log.info("request submitted", extra={"request_id": request_id, "engine_request_id": engine_id,
                                                     "engine": replica, "attempt": len(tried),
                                                     "prompt_tokens": len(prompt_ids), "n": n,
                                                     "max_tokens": params.max_tokens,
                                                     **({"lora_name": lora_name} if lora_name else {})})
                while finished < n:
                    out = await state.queue.get()
                    if out.failure is not None:
                        if self._may_retry(out.failure, tried, produced=completion_tokens > 0 or bool(started)):
                            log.warning("request retried on another replica", extra={
                                "request_id": request_id, "engine": replica, "code": out.failure.code.name,
                                "error": out.failure.message})
                            retry = True
                            break
                        raise GenerateError(out.failure.code, out.failure.message)
                    completion_tokens += len(out.token_ids)
                    cached_tokens = max(cached_tokens, out.num_cached_tokens)
                    usage = None
                    if out.finished:
                        finished += 1
                        if finished == n:
                            usage = common_pb2.Usage(prompt_tokens=len(prompt_ids),
                                                     completion_tokens=completion_tokens,
                                                     cached_prompt_tokens=cached_tokens)
                    # the output is this consumer's now: it goes out under the client's id
                    out.request_id, out.usage, out.num_prompt_tokens = request_id, usage, len(prompt_ids)
                    if out.index in held:
                        out = held.pop(out.index).merged_with(out)
                    if (self.stream_interval > 1 and out.index in started and not out.finished
                            and len(out.token_ids) < self.stream_interval):
                        held[out.index] = out  # sent with a later output of this choice
                        continue
                    started.add(out.index)
                    yield out
            finally:
                if sub is not None:  # migrations may have renamed it
                    engine_id = sub.engine_id
                self._forget_submission(engine_id)
                self._abort_in_engine(self.processor.release(engine_id))
                if not retry:
                    # DEBUG: the API layer's "request finished" line is the request's INFO record of its end
                    log.debug("request done" if finished == n else "request ended early",
                              extra={"request_id": request_id, "completion_tokens": completion_tokens,
                                     "seconds": round(time.time() - arrival, 4)})
            if not retry:
                return

    def _may_retry(self, failure: Failure, tried: list[str], produced: bool) -> bool:
        """Whether a failed attempt is retried on another replica: only an engine that went away
        or refused the request while draining (UNAVAILABLE), before the request produced any
        output, and while a replica it has not tried is there to take it."""
        return (failure.code == grpc.StatusCode.UNAVAILABLE and not produced and len(tried) < MAX_ATTEMPTS
                and self.engine.can_retry_elsewhere(tried))

    async def wait_ready(self) -> None:
        """Ride out a short reconnect (a backend restarting); fail with UNAVAILABLE after READY_WAIT_S."""
        deadline = time.monotonic() + READY_WAIT_S
        while not self.ready:
            if time.monotonic() >= deadline:
                raise GenerateError(grpc.StatusCode.UNAVAILABLE,
                                    "the frontend is not ready: waiting for the tokenizer and an engine")
            await asyncio.sleep(0.05)

    @tracing.traced("tokenize", kind="client")  # current while waiting: the TokenizeItem carries it
    async def _tokenize(self, request_id: str, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            request = tokenizer_pb2.TokenizeRequest(text=prompt)
        elif isinstance(prompt, tokenizer_pb2.ChatMessages):
            request = tokenizer_pb2.TokenizeRequest(chat=prompt, add_generation_prompt=True)
        else:
            return self._checked_ids(list(prompt))
        try:
            reply = await self.tokenizer.tokenize(request, request_id)
        except TokenizeError as exc:
            raise GenerateError(exc.code, f"tokenizer: {exc.message}") from None
        return list(reply.token_ids)

    def _checked_ids(self, ids: list[int]) -> list[int]:
        problem = token_ids_problem("token_ids", ids, self.tokenizer.model_info.vocab_size)
        if problem is not None:
            raise GenerateError.of(problem)
        return ids

    def _with_defaults(self, params: common_pb2.SamplingParams, prompt_len: int,
                       default_max_tokens: int | None) -> common_pb2.SamplingParams:
        """A copy with the defaults the frontend owns made explicit (max_tokens, n, and a seed: the
        engine keys every draw on (seed, sample, position), so a seeded request continues on
        another replica exactly as it would have)."""
        out = common_pb2.SamplingParams()
        out.CopyFrom(params)
        if not out.HasField("seed"):
            out.seed = secrets.randbits(63)
        if not out.HasField("max_tokens"):
            limit = self.max_model_len
            if default_max_tokens is None:
                out.max_tokens = max(1, limit - prompt_len) if limit else DEFAULT_MAX_TOKENS
            else:
                out.max_tokens = default_max_tokens
        if not out.HasField("n"):
            out.n = 1
        return out

    def _check_prompt(self, prompt_ids: list[int], params: common_pb2.SamplingParams) -> None:
        """The engine's intake rules, with what the frontend knows of the model and the engines
        (the prompt's ids were checked already, if they came as ids: the tokenizer's always fit).
        A prompt past the engines' KV cache is INVALID_ARGUMENT here, naming max_tokens."""
        problem = request_problem(params, prompt_ids, vocab_size=self.tokenizer.model_info.vocab_size,
                                  max_model_len=self.max_model_len, kv_cache_tokens=self.engine.kv_cache_tokens,
                                  kv_full_code="INVALID_ARGUMENT", prompt_field="prompt", check_prompt_ids=False)
        if problem is not None:
            raise GenerateError.of(problem)

    async def _on_engine_step(self, step: engine_pb2.EngineStepOutputs) -> None:
        """An engine replica's step: send its tokens to the tokenizer (delivery follows in order);
        hold the replica's reader while too many steps wait for the tokenizer."""
        if self._awaiting_output:
            self._note_migrated_outputs(step)
        self._abort_in_engine(self.processor.process_step(step))
        await self.processor.throttle()

    def _note_migrated_outputs(self, step: engine_pb2.EngineStepOutputs) -> None:
        """The migration delay of requests whose new replica sent its first output."""
        now = time.monotonic()
        for output in step.outputs:
            if output.request_id in self._awaiting_output:
                self._awaiting_output.discard(output.request_id)
                sub = self._submissions.get(output.request_id)
                if sub is not None and sub.lost_at is not None:
                    metrics.MIGRATION_DELAY.observe(now - sub.lost_at)
                    sub.lost_at = None

    def _forget_submission(self, engine_id: str) -> None:
        sub = self._submissions.pop(engine_id, None)
        self._awaiting_output.discard(engine_id)
        if sub is not None and sub.task is not None and sub.task is not asyncio.current_task():
            sub.task.cancel()

    async def _deliver_outputs(self) -> None:
        """The delivery loop: each step's outputs to their requests, in the order the steps came."""
        while True:
            self._abort_in_engine(await self.processor.deliver_next())

    def _on_engine_lost(self, request_ids: list[str], reason: str) -> None:
        """A replica's session broke: its requests migrate (or fail, past MAX_MIGRATIONS)."""
        self._migrate(request_ids, reason, "lost")

    def _on_handoff(self, request_ids: list[str], reason: str) -> bool:
        """A draining replica offers its requests: they migrate when another replica serves now
        (True); else they stay and finish there (False)."""
        if not self.engine.ready:
            return False
        self._migrate(request_ids, reason, "handoff")
        return True

    def _migrate(self, request_ids: list[str], reason: str, why: str) -> None:
        failed: list[str] = []
        for engine_id in request_ids:
            sub = self._submissions.get(engine_id)
            resumed = self.processor.resume_point(engine_id)
            if sub is None or not resumed:
                continue  # released, or every sample already finished in the engine
            if sub.migrations >= MAX_MIGRATIONS:
                metrics.MIGRATION_FAILURES.labels("attempts").inc()
                failed.append(engine_id)
                continue
            sub.migrations += 1
            sub.lost_at = time.monotonic()
            new_id = f"{sub.client_id}-{uuid.uuid4().hex[:12]}"
            self.processor.rename(engine_id, new_id)
            del self._submissions[engine_id]
            self._awaiting_output.discard(engine_id)
            self._submissions[new_id] = sub
            sub.engine_id = new_id
            request = engine_pb2.EngineRequest()
            request.CopyFrom(sub.request)
            request.request_id = new_id
            for index, ids in resumed.items():
                request.resumed.add(index=index, output_token_ids=ids)
            if any(resumed.values()):  # the prompt's logprobs went out with the first output
                request.sampling_params.ClearField("prompt_logprobs")
            sub.task = asyncio.create_task(self._resubmit(new_id, sub, request, reason, why),
                                           name=f"migrate-{new_id}")
        if failed:
            self._abort_in_engine(self.processor.fail(failed, Failure(
                grpc.StatusCode.UNAVAILABLE, f"{reason} (the request moved replicas {MAX_MIGRATIONS} times already)")))

    async def _resubmit(self, engine_id: str, sub: _Submission, request: engine_pb2.EngineRequest,
                        reason: str, why: str) -> None:
        """Submit a migrating request to a replica that can take it, waiting for one up to the
        engine timeout."""
        deadline = time.monotonic() + self.engine.timeout_s
        resumed_tokens = sum(len(r.output_token_ids) for r in request.resumed)
        while self._submissions.get(engine_id) is sub:
            try:
                to = self.engine.submit(request, len(request.resumed))
            except NoReplicaError:
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(MIGRATE_POLL_S)
                continue
            metrics.MIGRATIONS.labels(why).inc()
            metrics.MIGRATION_RECOMPUTED_TOKENS.inc(len(request.prompt_token_ids) + resumed_tokens)
            self._awaiting_output.add(engine_id)
            log.warning("request migrated", extra={
                "request_id": sub.client_id, "engine_request_id": engine_id, "from": sub.replica, "to": to,
                "why": why, "reason": reason, "migration": sub.migrations, "resumed_tokens": resumed_tokens,
                "samples": len(request.resumed)})
            sub.replica, sub.task = to, None
            return
        if self._submissions.get(engine_id) is sub:
            sub.task = None
            metrics.MIGRATION_FAILURES.labels("no_replica").inc()
            self._abort_in_engine(self.processor.fail([engine_id], Failure(
                grpc.StatusCode.UNAVAILABLE,
                f"{reason}; no engine replica could take the request within {self.engine.timeout_s:g} s")))

    def _abort_in_engine(self, result: OutputProcessorOutput) -> None:
        if result.reqs_to_abort:
            self.engine.abort(result.reqs_to_abort)
        if result.samples_to_abort:
            self.engine.abort_samples(result.samples_to_abort)


def _detokenize_open(params: common_pb2.SamplingParams, prompt_ids: list[int]) -> tokenizer_pb2.DetokenizeOpen:
    open_ = tokenizer_pb2.DetokenizeOpen(stop=params.stop,
                                         include_stop_str_in_output=params.include_stop_str_in_output,
                                         prompt_token_ids=prompt_ids, min_tokens=params.min_tokens)
    if params.HasField("skip_special_tokens"):
        open_.skip_special_tokens = params.skip_special_tokens
    return open_
