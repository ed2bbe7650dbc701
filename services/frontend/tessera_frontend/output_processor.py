"""Engine step outputs -> per-request outputs (the seed's OutputProcessor).

For each EngineStepOutputs the processor sends the new token ids of every live
sample in ONE DetokenizeStreamRequest and, once the tokenizer's reply is back,
puts a `SampleOutput` (text delta, token ids, logprobs, finish reason) on the
queue of the request it belongs to.

The two halves are pipelined: `process_step` sends a step's message at once and
returns, so the engine streams are read on while a reply is pending; a single
delivery task takes the replies in the order the messages were sent (the
tokenizer answers in order), which keeps every request's outputs in order. At
most MAX_PENDING_STEPS messages wait for replies; past that `process_step` waits.

Each of a request's n samples is detokenized separately, under the key
"<engine request id>#<index>". When the tokenizer reports a matched stop string, the
sample finishes with STOP and that stop string; its tokens are cut to
`tokens_consumed`; once every sample of the request is done the request is
aborted in the engine if the engine is still running any of its samples; a sample
that stops while its siblings run on is aborted alone (AbortRequests.samples).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable, Iterable, Optional

import grpc

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
    """What one sample of one request produced in one engine step."""
    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[common_pb2.PositionLogprobs] = dataclasses.field(default_factory=list)
    finish_reason: int = RUNNING
    stop_reason: str | None = None
    stop_token_id: int | None = None   # the stop_token_ids entry that ended it
    prompt_logprobs: list[common_pb2.PositionLogprobs] | None = None  # once, when asked
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    failure: Failure | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason != RUNNING


@dataclasses.dataclass
class _Sample:
    """Book-keeping for one of a request's samples."""
    key: str                     # request id on the detokenize stream
    opened_in: int | None = None  # detokenize stream generation it was opened on
    tokenizer_done: bool = False  # the tokenizer has forgotten it (finished, stopped or cancelled)
    engine_done: bool = False     # the engine has sent its final output
    done: bool = False            # its final SampleOutput has been delivered


class RequestState:
    """A request the processor delivers outputs for; the consumer reads `queue`."""

    def __init__(self, request_id: str, n: int, detokenize_open: tokenizer_pb2.DetokenizeOpen,
                 want_token_texts: bool) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[SampleOutput] = asyncio.Queue()
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

    def __init__(self, tokenizer: TokenizerClient, abort_in_engine: Callable[[list[str]], None],
                 abort_samples_in_engine: Callable[[list[tuple[str, int]]], None]) -> None:
        self._tokenizer = tokenizer
        self._abort_in_engine = abort_in_engine
        self._abort_samples_in_engine = abort_samples_in_engine
        self._requests: dict[str, RequestState] = {}
        # Steps sent to the tokenizer, in order, waiting for their reply to be delivered.
        self._pending: asyncio.Queue[_PendingStep] = asyncio.Queue(MAX_PENDING_STEPS)
        self._delivery: asyncio.Task | None = None

    def start(self) -> None:
        """Start the delivery task (takes the tokenizer's replies in order)."""
        self._delivery = asyncio.create_task(self._deliver_loop(), name="output-delivery")

    async def close(self) -> None:
        if self._delivery is not None:
            self._delivery.cancel()
            await asyncio.gather(self._delivery, return_exceptions=True)
            self._delivery = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, state: RequestState) -> None:
        self._requests[state.request_id] = state

    def release(self, request_id: str) -> bool:
        """Forget a request (its consumer is gone); cancel its open detokenize states.

        Returns True when the engine may still be running it (the caller aborts it there).
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self._cancel_in_tokenizer(state.samples)
        return state.engine_running

    def fail(self, request_ids: Iterable[str], failure: Failure) -> None:
        """Fail these requests (e.g. their engine stream broke): the consumer raises."""
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is not None:
                for sample in state.samples:
                    sample.engine_done = True
                self._deliver_failure(state, failure)

    async def process_step(self, step: engine_pb2.EngineStepOutputs) -> None:
        """Send one engine step's new tokens to the tokenizer (one message); delivery follows in order.

        Returns without waiting for the tokenizer's reply unless MAX_PENDING_STEPS are pending.
        """
        entries: list[_Entry] = []
        items: list[tokenizer_pb2.DetokenizeItem] = []
        for output in step.outputs:
            state = self._requests.get(output.request_id)
            if state is None or output.index >= len(state.samples):
                continue  # finished, released or unknown: a late output
            sample = state.samples[output.index]
            if sample.done:
                continue
            finished = output.finish_reason != RUNNING
            sample.engine_done = sample.engine_done or finished
            if output.finish_reason == ERROR:
                self._deliver_failure(state, Failure.from_proto(output.error, grpc.StatusCode.INTERNAL))
                continue
            if sample.opened_in is None and not output.new_token_ids:
                if finished:  # ended before any token (e.g. aborted while waiting)
                    entries.append(_Entry(state, sample, output, detokenized=False))
                continue
            item = tokenizer_pb2.DetokenizeItem(request_id=sample.key, new_token_ids=output.new_token_ids,
                                                finished=finished)
            if sample.opened_in is None:
                item.open.CopyFrom(state.open)
                sample.opened_in = self._tokenizer.stream.generation
            elif sample.opened_in != self._tokenizer.stream.generation:
                self._deliver_failure(state, Failure(grpc.StatusCode.UNAVAILABLE,
                                                     "the tokenizer restarted while the request ran"))
                continue
            items.append(item)
            entries.append(_Entry(state, sample, output, detokenized=True))
        if not entries:
            return
        reply: asyncio.Future | None = None
        if items:
            try:
                reply = self._tokenizer.stream.send(items)
            except DetokenizeStreamError as exc:
                for entry in entries:
                    self._deliver_failure(entry.state, Failure(grpc.StatusCode.UNAVAILABLE, str(exc)))
                return
        await self._pending.put(_PendingStep(entries, reply, len(items)))

    async def _deliver_loop(self) -> None:
        while True:
            pending = await self._pending.get()
            try:
                await self._deliver_step(pending)
            except Exception as exc:  # a bug must not stop delivery for every other request
                log.exception("output delivery failed")
                for entry in pending.entries:
                    self._deliver_failure(entry.state, Failure(grpc.StatusCode.INTERNAL,
                                                               f"internal error: {exc!r}"))

    async def _deliver_step(self, pending: "_PendingStep") -> None:
        results: list[tokenizer_pb2.DetokenizeResult] = []
        if pending.reply is not None:
            try:
                results = await pending.reply
                if len(results) != pending.num_items:
                    raise DetokenizeStreamError(
                        f"tokenizer answered {len(results)} results for {pending.num_items} items")
            except DetokenizeStreamError as exc:
                for entry in pending.entries:
                    self._deliver_failure(entry.state, Failure(grpc.StatusCode.UNAVAILABLE, str(exc)))
                return
        texts = await self._token_texts(pending.entries)
        next_result = iter(results)
        for entry in pending.entries:
            result = next(next_result) if entry.detokenized else None
            state, sample = entry.state, entry.sample
            if self._requests.get(state.request_id) is not state or sample.done:
                continue  # released, failed or already stopped meanwhile
            if result is None:
                self._deliver(state, sample, self._sample_output(state, entry.output, "", [], [], texts))
            else:
                self._deliver_result(state, sample, entry.output, result, texts)

    def _deliver_result(self, state: RequestState, sample: _Sample, output: engine_pb2.RequestOutput,
                        result: tokenizer_pb2.DetokenizeResult, texts: dict[int, str]) -> None:
        if result.error.code:
            sample.tokenizer_done = True
            self._deliver_failure(state, Failure.from_proto(result.error, grpc.StatusCode.INTERNAL))
            return
        out = self._sample_output(state, output, result.text_delta, list(output.new_token_ids),
                                  list(output.logprobs), texts)
        if result.HasField("stop_matched"):
            del out.token_ids[result.tokens_consumed:]
            del out.logprobs[result.tokens_consumed:]
            out.finish_reason, out.stop_reason, out.stop_token_id = STOP, result.stop_matched, None
        if result.finished or output.finish_reason != RUNNING:
            sample.tokenizer_done = True  # the tokenizer forgets a request it reports or was told finished
        self._deliver(state, sample, out)

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

    def _deliver(self, state: RequestState, sample: _Sample, out: SampleOutput) -> None:
        state.queue.put_nowait(out)
        if not out.finished:
            return
        sample.done = True
        if not sample.tokenizer_done and sample.opened_in is not None:
            self._cancel_in_tokenizer([sample])
        if state.done:
            self._requests.pop(state.request_id, None)
            if state.engine_running:  # stopped by a stop string: free the engine's slots now
                self._abort_in_engine([state.request_id])
        elif not sample.engine_done:  # one choice stopped by a stop string, others run on
            sample.engine_done = True
            self._abort_samples_in_engine([(state.request_id, out.index)])

    def _deliver_failure(self, state: RequestState, failure: Failure) -> None:
        """Fail the whole request: its consumer raises on this output."""
        if self._requests.pop(state.request_id, None) is None:
            return
        log.warning("request failed", extra={"request_id": state.request_id,
                                             "code": failure.code.name, "error": failure.message})
        self._cancel_in_tokenizer(state.samples)
        for sample in state.samples:
            sample.done = True
        if state.engine_running:
            self._abort_in_engine([state.request_id])
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


def _fill_token_texts(logprobs: Iterable[common_pb2.PositionLogprobs], texts: dict[int, str]) -> None:
    for position in logprobs:
        if position.HasField("chosen"):
            position.chosen.token = texts.get(position.chosen.token_id, "")
        for lp in position.top:
            lp.token = texts.get(lp.token_id, "")
