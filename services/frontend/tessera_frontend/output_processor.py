"""Engine step outputs -> detokenized per-request outputs (vLLM v1's OutputProcessor).

For each EngineStepOutputs the processor sends the new token ids of every live
sample in ONE DetokenizeStreamRequest and, once the tokenizer's reply is back,
puts a `SampleOutput` (text delta, token ids, logprobs, finish reason) on the
queue of the request it belongs to.

The two halves are pipelined: `process_step` sends a step's message at once and
returns, so the engine streams are read on while a reply is pending; the caller's
delivery loop calls `deliver_next`, which takes the replies in the order the
messages were sent (the tokenizer answers in order) and so keeps every request's
outputs in order. `throttle` holds the engine reader while more than
MAX_PENDING_STEPS messages wait for replies.

The processor never calls into the engine. Each of its entry points returns an
`OutputProcessorOutput` naming what the caller must abort there (as vLLM's
`process_outputs` returns `reqs_to_abort`), and AsyncLLM does the aborting.

A tokenizer that restarts (or a stream that breaks) loses no request: each sample keeps
the token ids whose text its consumer has and how many characters that text is. Outputs
that could not be detokenized (the stream was down, or broke before their reply) wait on
their sample ("stranded"); once a stream is open again each such sample is reopened on it
with DetokenizeOpen.resumed_token_ids / resumed_text_chars, so the tokenizer rebuilds its
state and the text continues with no repeated or missing character, and the waiting
tokens go out with it. A sample stranded longer than the tokenizer timeout fails with
UNAVAILABLE.

Each of a request's n samples is detokenized separately, under the key
"<engine request id>#<index>". When the tokenizer reports a matched stop string, the
sample finishes with STOP and that stop string; its tokens are cut to
`tokens_consumed`; once every sample of the request is done the request is to be
aborted in the engine if the engine is still running any of its samples
(`reqs_to_abort`); a sample that stops while its siblings run on is to be aborted
alone (`samples_to_abort`, sent as AbortRequests.samples).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Iterable, Optional

import grpc

from tessera.common.request_outputs import MergingQueue, merged_request_outputs
from tessera.v1 import common_pb2, engine_pb2, tokenizer_pb2
from tessera_frontend.grpc_util import status_code
from tessera_frontend.tokenizer_client import DetokenizeStreamError, TokenizerClient

log = logging.getLogger(__name__)

RUNNING = common_pb2.FINISH_REASON_UNSPECIFIED
STOP = common_pb2.FINISH_REASON_STOP
ABORT = common_pb2.FINISH_REASON_ABORT
ERROR = common_pb2.FINISH_REASON_ERROR

MAX_PENDING_STEPS = 32


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a request failed: a gRPC status code and a message for the client."""
    code: grpc.StatusCode
    message: str

    @classmethod
    def from_proto(cls, error: common_pb2.RequestError, default: grpc.StatusCode) -> "Failure":
        code = status_code(error.code, default)
        return cls(code, error.message or code.name)


@dataclasses.dataclass
class SampleOutput:
    """What one sample (choice) of one request produced in one engine step: the processor puts
    it on the request's queue, and AsyncLLM.generate yields it with the client's `request_id`,
    and `usage` on the request's last output."""
    request_id: str = ""
    index: int = 0
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[common_pb2.PositionLogprobs] = dataclasses.field(default_factory=list)
    finish_reason: int = RUNNING
    stop_reason: str | None = None
    usage: common_pb2.Usage | None = None
    stop_token_id: int | None = None   # the stop_token_ids entry that ended it
    prompt_logprobs: list[common_pb2.PositionLogprobs] | None = None  # once, when asked
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    failure: Failure | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason != RUNNING

    def merged_with(self, later: "SampleOutput") -> "SampleOutput":
        """This output followed by `later` of the same sample, as one: the later one's status, the
        two texts, token ids and logprobs joined, the prompt logprobs of whichever has them."""
        return dataclasses.replace(
            later, text=self.text + later.text, token_ids=self.token_ids + later.token_ids,
            logprobs=self.logprobs + later.logprobs, prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            num_cached_tokens=max(self.num_cached_tokens, later.num_cached_tokens))


class OutputCollector(MergingQueue[SampleOutput]):
    """A request's outputs waiting for its consumer. Once MAX_WAITING outputs wait (a client
    that reads slowly), a new output of a sample is merged into the last output of that
    sample still waiting, so the queue never grows past MAX_WAITING + one per sample,
    however far behind the client falls: memory is bounded by the request's own tokens, and
    the engine and the other requests never wait for it (vLLM's RequestOutputCollector
    merges the same way). A consumer that keeps up still gets one output per step."""

    MAX_WAITING = 16

    def merge(self, waiting: collections.deque, out: SampleOutput) -> bool:
        if out.failure is not None:
            return False
        for i in range(len(waiting) - 1, -1, -1):
            earlier = waiting[i]
            if earlier.index == out.index:
                if earlier.failure is None and not earlier.finished:
                    waiting[i] = earlier.merged_with(out)
                    return True
                return False
        return False


@dataclasses.dataclass
class OutputProcessorOutput:
    """What the caller must abort in the engine after a call into the processor.

    `reqs_to_abort`: whole requests (every sample); `samples_to_abort`: single samples
    of requests whose other samples run on.
    """
    reqs_to_abort: list[str] = dataclasses.field(default_factory=list)
    samples_to_abort: list[engine_pb2.SampleRef] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Sample:
    """Book-keeping for one of a request's samples."""
    key: str                     # request id on the detokenize stream
    opened_in: int | None = None  # detokenize stream generation it was opened on
    tokenizer_done: bool = False  # the tokenizer has forgotten it (finished, stopped or cancelled)
    engine_done: bool = False     # the engine has sent its final output
    engine_ids: list[int] = dataclasses.field(default_factory=list)  # every token the engine sent for it
    done: bool = False            # its final SampleOutput has been delivered
    # what a resume on a new stream needs: the ids whose text the consumer has, and its length
    acked_ids: list[int] = dataclasses.field(default_factory=list)
    emitted_chars: int = 0
    # (step sequence number, output) not detokenized yet because the stream was down
    stranded: list[tuple[int, engine_pb2.RequestOutput]] = dataclasses.field(default_factory=list)
    stranded_since: float = 0.0


class RequestState:
    """A request the processor delivers outputs for; the consumer reads `queue`."""

    def __init__(self, request_id: str, n: int, detokenize_open: tokenizer_pb2.DetokenizeOpen,
                 want_token_texts: bool) -> None:
        self.request_id = request_id
        self.queue = OutputCollector()
        self.open = detokenize_open
        self.want_token_texts = want_token_texts
        self.samples = [_Sample(f"{request_id}#{i}") for i in range(n)]
        self.prompt_logprobs_sent = False

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    @property
    def engine_running(self) -> bool:
        return not all(s.engine_done for s in self.samples)


class OutputProcessor:
    """Turns engine step outputs into per-request SampleOutputs via the detokenize stream."""

    def __init__(self, tokenizer: TokenizerClient) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, RequestState] = {}
        # Steps sent to the tokenizer, in the order sent, waiting for their reply to be
        # delivered; _CHECK_STRANDED entries ask deliver_next to resume or expire stranded samples.
        self._pending: asyncio.Queue = asyncio.Queue()
        self._step_taken = asyncio.Event()  # set whenever deliver_next takes a pending step
        self._seq = 0  # engine steps processed
        self._stranded: dict[str, tuple[RequestState, _Sample]] = {}  # sample key ->
        self._timeout_s = getattr(tokenizer, "timeout_s", 30.0)
        listeners = getattr(tokenizer.stream, "on_open", None)
        if listeners is not None:
            listeners.append(lambda: self._pending.put_nowait(_CHECK_STRANDED))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, state: RequestState) -> None:
        self._requests[state.request_id] = state

    def release(self, request_id: str) -> OutputProcessorOutput:
        """Forget a request (its consumer is gone); cancel its open detokenize states.

        The request is in `reqs_to_abort` when the engine may still be running it.
        """
        result = OutputProcessorOutput()
        state = self._requests.pop(request_id, None)
        if state is None:
            return result
        self._cancel_in_tokenizer(state.samples)
        if state.engine_running:
            result.reqs_to_abort.append(request_id)
        return result

    def rename(self, request_id: str, new_id: str) -> None:
        """The request goes on under a new engine request id (a migration: the replica it left
        may still hold the old one). Its samples keep their detokenize keys."""
        state = self._requests.pop(request_id)
        state.request_id = new_id
        self._requests[new_id] = state

    def resume_point(self, request_id: str) -> dict[int, list[int]] | None:
        """For a migration: each sample the engine was still running, with every token the engine
        sent for it (whether or not delivered yet: those still on their way are delivered as
        usual, and the new replica continues after them). None: not a live request."""
        state = self._requests.get(request_id)
        if state is None or state.done:
            return None
        return {i: list(s.engine_ids) for i, s in enumerate(state.samples) if not s.engine_done}

    def fail(self, request_ids: Iterable[str], failure: Failure) -> OutputProcessorOutput:
        """Fail these requests, which the engine no longer runs (e.g. their engine stream broke):
        the consumer raises."""
        result = OutputProcessorOutput()
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is not None:
                for sample in state.samples:
                    sample.engine_done = True
                self._deliver_failure(state, failure, result)
        return result

    def process_step(self, step: engine_pb2.EngineStepOutputs) -> OutputProcessorOutput:
        """Send one engine step's new tokens to the tokenizer (one message) and queue the step
        for `deliver_next`; outputs that need no reply (failures) are delivered at once.

        Returns what to abort in the engine for the requests failed here.
        """
        result = OutputProcessorOutput()
        self._seq += 1
        seq = self._seq
        generation = self._tokenizer.stream.generation
        entries: list[_Entry] = []
        items: list[tokenizer_pb2.DetokenizeItem] = []
        for output in step.outputs:
            state = self._requests.get(output.request_id)
            if state is None or output.index >= len(state.samples):
                continue  # finished, released or unknown: a late output
            sample = state.samples[output.index]
            if sample.done:
                continue
            sample.engine_ids.extend(output.new_token_ids)
            finished = output.finish_reason != RUNNING
            sample.engine_done = sample.engine_done or finished
            if output.finish_reason == ERROR:
                self._deliver_failure(state, Failure.from_proto(output.error, grpc.StatusCode.INTERNAL), result)
                continue
            if sample.opened_in is None and not output.new_token_ids and not sample.stranded:
                if finished:  # ended before any token (e.g. aborted while waiting)
                    entries.append(_Entry(state, sample, output, detokenized=False))
                continue
            if sample.stranded or (sample.opened_in is not None and sample.opened_in != generation):
                self._strand(state, sample, seq, output)  # resumed below, or once a stream is open
                continue
            item = tokenizer_pb2.DetokenizeItem(request_id=sample.key, new_token_ids=output.new_token_ids,
                                                finished=finished)
            if sample.opened_in is None:
                item.open.CopyFrom(state.open)
                sample.opened_in = generation
            items.append(item)
            entries.append(_Entry(state, sample, output, detokenized=True))
        if self._stranded and self._tokenizer.stream.connected:
            self._resume_into(items, entries)
        self._send(entries, items, seq)
        return result

    def _send(self, entries: list["_Entry"], items: list[tokenizer_pb2.DetokenizeItem], seq: int) -> None:
        """Send one message for these entries and queue it for deliver_next; if the stream is
        down, the entries that need the tokenizer are stranded instead."""
        if not entries:
            return
        reply: asyncio.Future | None = None
        if items:
            try:
                reply = self._tokenizer.stream.send(items)
            except DetokenizeStreamError:
                for entry in entries:
                    if entry.detokenized:
                        self._strand(entry.state, entry.sample, seq, entry.output)
                entries = [e for e in entries if not e.detokenized]
                items = []
                if not entries:
                    return
        self._pending.put_nowait(_PendingStep(entries, reply, len(items), seq))

    def _strand(self, state: RequestState, sample: _Sample, seq: int, output: engine_pb2.RequestOutput) -> None:
        if not sample.stranded:
            sample.stranded_since = time.monotonic()
            if not self._stranded:  # expire what is still stranded once the timeout has passed
                asyncio.get_running_loop().call_later(self._timeout_s + 0.05, self._pending.put_nowait,
                                                      _CHECK_STRANDED)
        sample.stranded.append((seq, output))
        sample.opened_in = None  # the tokenizer that had it open is gone
        self._stranded[sample.key] = (state, sample)

    def _resume_into(self, items: list[tokenizer_pb2.DetokenizeItem], entries: list["_Entry"]) -> None:
        """Reopen every stranded sample on the current stream, with its waiting outputs as one."""
        generation = self._tokenizer.stream.generation
        for key, (state, sample) in list(self._stranded.items()):
            del self._stranded[key]
            if self._requests.get(state.request_id) is not state or sample.done:
                sample.stranded = []
                continue
            outputs = [o for _, o in sorted(sample.stranded, key=lambda x: x[0])]
            sample.stranded = []
            merged = merged_request_outputs(outputs)
            item = tokenizer_pb2.DetokenizeItem(request_id=sample.key, new_token_ids=merged.new_token_ids,
                                                finished=merged.finish_reason != RUNNING)
            item.open.CopyFrom(state.open)
            if sample.acked_ids:
                item.open.resumed_token_ids.extend(sample.acked_ids)
                item.open.resumed_text_chars = sample.emitted_chars
            sample.opened_in = generation
            items.append(item)
            entries.append(_Entry(state, sample, merged, detokenized=True))
            log.info("request resumed on a new detokenize stream", extra={
                "request_id": state.request_id, "sample": key, "resumed_tokens": len(sample.acked_ids),
                "waiting_tokens": len(merged.new_token_ids)})

    def _check_stranded(self, result: OutputProcessorOutput) -> None:
        """Fail samples stranded past the timeout; resume the others if a stream is open."""
        now = time.monotonic()
        for key, (state, sample) in list(self._stranded.items()):
            if now - sample.stranded_since > self._timeout_s:
                del self._stranded[key]
                sample.stranded = []
                self._deliver_failure(state, Failure(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the tokenizer was unavailable for more than {self._timeout_s:g} s while the request ran"), result)
        if self._stranded and self._tokenizer.stream.connected:
            items: list[tokenizer_pb2.DetokenizeItem] = []
            entries: list[_Entry] = []
            self._resume_into(items, entries)
            self._seq += 1
            self._send(entries, items, self._seq)
        elif self._stranded:
            oldest = min(sample.stranded_since for _, sample in self._stranded.values())
            asyncio.get_running_loop().call_later(max(0.0, oldest + self._timeout_s - now) + 0.05,
                                                  self._pending.put_nowait, _CHECK_STRANDED)

    async def throttle(self) -> None:
        """Wait while more than MAX_PENDING_STEPS steps wait for their tokenizer replies."""
        while self._pending.qsize() > MAX_PENDING_STEPS:
            self._step_taken.clear()
            await self._step_taken.wait()

    async def deliver_next(self) -> OutputProcessorOutput:
        """Wait for the oldest pending step's tokenizer reply and deliver its outputs to their
        requests' queues; return what to abort in the engine (requests or samples that a stop
        string ended, requests that failed)."""
        pending = await self._pending.get()
        self._step_taken.set()
        result = OutputProcessorOutput()
        if pending is _CHECK_STRANDED:
            self._check_stranded(result)
            return result
        try:
            await self._deliver_step(pending, result)
        except Exception as exc:  # a bug must not stop delivery for every other request
            log.exception("output delivery failed")
            for entry in pending.entries:
                self._deliver_failure(entry.state, Failure(grpc.StatusCode.INTERNAL,
                                                           f"internal error: {exc!r}"), result)
        return result

    async def _deliver_step(self, pending: "_PendingStep", result: OutputProcessorOutput) -> None:
        results: list[tokenizer_pb2.DetokenizeResult] = []
        if pending.reply is not None:
            try:
                results = await pending.reply
            except DetokenizeStreamError:
                # the stream broke before the reply: these outputs wait for the next stream
                for entry in pending.entries:
                    if entry.detokenized:
                        self._strand(entry.state, entry.sample, pending.seq, entry.output)
                    else:
                        self._deliver(entry.state, entry.sample,
                                      self._sample_output(entry.state, entry.output, "", [], [], {}), result)
                if self._tokenizer.stream.connected:  # a new stream is already open
                    self._pending.put_nowait(_CHECK_STRANDED)
                return
            if len(results) != pending.num_items:  # a tokenizer bug: these requests cannot go on
                message = f"tokenizer answered {len(results)} results for {pending.num_items} items"
                for entry in pending.entries:
                    self._deliver_failure(entry.state, Failure(grpc.StatusCode.UNAVAILABLE, message), result)
                return
        texts = await self._token_texts(pending.entries)
        next_result = iter(results)
        for entry in pending.entries:
            detokenized = next(next_result) if entry.detokenized else None
            state, sample = entry.state, entry.sample
            if self._requests.get(state.request_id) is not state or sample.done:
                continue  # released, failed or already stopped meanwhile
            if detokenized is None:
                self._deliver(state, sample, self._sample_output(state, entry.output, "", [], [], texts), result)
            else:
                self._deliver_detokenized(state, sample, entry.output, detokenized, texts, result)

    def _deliver_detokenized(self, state: RequestState, sample: _Sample, output: engine_pb2.RequestOutput,
                             detokenized: tokenizer_pb2.DetokenizeResult, texts: dict[int, str],
                             result: OutputProcessorOutput) -> None:
        if detokenized.error.code:
            sample.tokenizer_done = True
            self._deliver_failure(state, Failure.from_proto(detokenized.error, grpc.StatusCode.INTERNAL), result)
            return
        out = self._sample_output(state, output, detokenized.text_delta, list(output.new_token_ids),
                                  list(output.logprobs), texts)
        if detokenized.HasField("stop_matched"):
            del out.token_ids[detokenized.tokens_consumed:]
            del out.logprobs[detokenized.tokens_consumed:]
            out.finish_reason, out.stop_reason, out.stop_token_id = STOP, detokenized.stop_matched, None
        if detokenized.finished or output.finish_reason != RUNNING:
            sample.tokenizer_done = True  # the tokenizer forgets a request it reports or was told finished
        sample.acked_ids.extend(output.new_token_ids)
        sample.emitted_chars += len(detokenized.text_delta)
        self._deliver(state, sample, out, result)

    @staticmethod
    def _sample_output(state: RequestState, output: engine_pb2.RequestOutput, text: str,
                       token_ids: list[int], logprobs: list[common_pb2.PositionLogprobs],
                       texts: dict[int, str]) -> SampleOutput:
        out = SampleOutput(index=output.index, text=text, token_ids=token_ids, logprobs=logprobs,
                           finish_reason=output.finish_reason, num_prompt_tokens=output.num_prompt_tokens,
                           num_cached_tokens=output.num_cached_tokens)
        if output.HasField("stop_token_id"):
            out.stop_token_id = output.stop_token_id
        if output.prompt_logprobs and not state.prompt_logprobs_sent:
            # Every sample carries the prompt's logprobs; the request reports them once.
            out.prompt_logprobs = list(output.prompt_logprobs)
            state.prompt_logprobs_sent = True
        if texts:
            _fill_token_texts(out.logprobs, texts)
            _fill_token_texts(out.prompt_logprobs or (), texts)
        return out

    def _deliver(self, state: RequestState, sample: _Sample, out: SampleOutput,
                 result: OutputProcessorOutput) -> None:
        state.queue.put_nowait(out)
        if not out.finished:
            return
        sample.done = True
        if not sample.tokenizer_done and sample.opened_in is not None:
            self._cancel_in_tokenizer([sample])
        if state.done:
            self._requests.pop(state.request_id, None)
            if state.engine_running:  # stopped by a stop string: free the engine's slots now
                result.reqs_to_abort.append(state.request_id)
        elif not sample.engine_done:  # one choice stopped by a stop string, others run on
            sample.engine_done = True
            result.samples_to_abort.append(engine_pb2.SampleRef(request_id=state.request_id, index=out.index))

    def _deliver_failure(self, state: RequestState, failure: Failure, result: OutputProcessorOutput) -> None:
        """Fail the whole request: its consumer raises on this output."""
        if self._requests.pop(state.request_id, None) is None:
            return
        log.warning("request failed", extra={"request_id": state.request_id,
                                             "code": failure.code.name, "error": failure.message})
        self._cancel_in_tokenizer(state.samples)
        for sample in state.samples:
            sample.done = True
        if state.engine_running:
            result.reqs_to_abort.append(state.request_id)
        state.queue.put_nowait(SampleOutput(index=0, finish_reason=ERROR, failure=failure))

    def _cancel_in_tokenizer(self, samples: Iterable[_Sample]) -> None:
        keys = []
        for sample in samples:
            if sample.opened_in is not None and not sample.tokenizer_done:
                sample.tokenizer_done = True
                if sample.opened_in == self._tokenizer.stream.generation:
                    keys.append(sample.key)
        self._tokenizer.stream.cancel(keys)

    async def _token_texts(self, entries: list["_Entry"]) -> dict[int, str]:
        """Texts of every token named in these outputs' logprobs (only for requests that want them)."""
        ids = {lp.token_id
               for entry in entries if entry.state.want_token_texts
               for position in (*entry.output.logprobs, *entry.output.prompt_logprobs)
               for lp in (position.chosen, *position.top)
               if position.HasField("chosen") or position.top}
        if not ids:
            return {}
        try:
            return await self._tokenizer.token_texts(ids)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not decode logprob tokens", extra={"error": str(exc.details())})
            return {}


@dataclasses.dataclass
class _Entry:
    """One sample's output in a pending step; `detokenized`: it has an item in the tokenizer message."""
    state: RequestState
    sample: _Sample
    output: engine_pb2.RequestOutput
    detokenized: bool


@dataclasses.dataclass
class _PendingStep:
    """A step whose tokenizer message is out: its entries, in item order, and the reply to come."""
    entries: list[_Entry]
    reply: Optional[asyncio.Future]
    num_items: int
    seq: int = 0  # the engine step's sequence number (stranded outputs are resumed in order)


_CHECK_STRANDED = object()  # on the pending queue: resume stranded samples, expire old ones


def _fill_token_texts(logprobs: Iterable[common_pb2.PositionLogprobs], texts: dict[int, str]) -> None:
    for position in logprobs:
        if position.HasField("chosen"):
            position.chosen.token = texts.get(position.chosen.token_id, "")
        for lp in position.top:
            lp.token = texts.get(lp.token_id, "")
