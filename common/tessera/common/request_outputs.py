"""Folding one sample's consecutive outputs into one, and the bounded queue that does it.

`merged_request_output(s)`: one sample's consecutive engine outputs (tessera.v1.RequestOutput)
as one. Both ends of the engine's Session stream need it: the engine, when a session's
reader falls behind and its waiting step messages are folded together
(tessera_engine.session_outbox), and the frontend, when outputs that waited for a restarted
tokenizer are resumed as one.

`MergingQueue`: what a consumer has waiting, kept bounded by merging: the engine's
SessionOutbox (step messages for a Session's writer) and the frontend's OutputCollector
(a request's outputs for its client) are both one.
"""
from __future__ import annotations

import asyncio
import collections
import functools
from typing import Generic, Sequence, TypeVar

from tessera.v1 import common_pb2, engine_pb2

RUNNING = common_pb2.FINISH_REASON_UNSPECIFIED


def merged_request_output(earlier: engine_pb2.RequestOutput,
                          later: engine_pb2.RequestOutput) -> engine_pb2.RequestOutput:
    """`earlier` then `later` (the same sample's next output) as one new message: the token ids
    and logprobs joined, the later one's status, the prompt logprobs of whichever has them."""
    merged = engine_pb2.RequestOutput()
    merged.CopyFrom(later)
    del merged.new_token_ids[:]
    merged.new_token_ids.extend(earlier.new_token_ids)
    merged.new_token_ids.extend(later.new_token_ids)
    del merged.logprobs[:]
    merged.logprobs.extend(earlier.logprobs)
    merged.logprobs.extend(later.logprobs)
    if earlier.prompt_logprobs and not merged.prompt_logprobs:
        merged.prompt_logprobs.extend(earlier.prompt_logprobs)
    merged.num_cached_tokens = max(earlier.num_cached_tokens, later.num_cached_tokens)
    return merged


def merged_request_outputs(outputs: Sequence[engine_pb2.RequestOutput]) -> engine_pb2.RequestOutput:
    """One sample's consecutive outputs, in order, as one new message."""
    if len(outputs) == 1:
        only = engine_pb2.RequestOutput()
        only.CopyFrom(outputs[0])
        return only
    return functools.reduce(merged_request_output, outputs)


T = TypeVar("T")


class MergingQueue(Generic[T]):
    """A consumer's queue that never grows past a bound, however far behind the consumer falls.

    Once MAX_WAITING items that `counts` wait, a new item is offered to `merge`, which folds it
    into a waiting one (True) or declines (False: it is queued after them). Nothing is lost or
    reordered: a merged item carries what both held, where the waiting one stood, so memory
    is bounded by what the items themselves hold, and the producer (the engine's core loop,
    the frontend's delivery loop) never waits for a slow consumer. A consumer that keeps up
    still gets one item per put. Items that `counts` declines (control items) are always
    queued, and never merged into. Producer and consumer share one event loop.
    """

    MAX_WAITING = 16

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._counted = 0  # items that `counts`
        self._ready = asyncio.Event()

    def counts(self, item: T) -> bool:
        """Whether `item` counts toward MAX_WAITING and may be merged into (default: all do)."""
        return True

    def merge(self, waiting: collections.deque[T], item: T) -> bool:
        """Fold `item` into one of the `waiting` items (the queue, oldest first); False to queue
        it instead. Called only once MAX_WAITING counted items wait."""
        return False

    def put_nowait(self, item: T) -> None:
        counted = self.counts(item)
        if counted and self._counted >= self.MAX_WAITING and self.merge(self._items, item):
            return
        self._items.append(item)
        self._counted += counted
        self._ready.set()

    async def get(self) -> T:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._pop()

    def get_nowait(self) -> T:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._pop()

    def _pop(self) -> T:
        item = self._items.popleft()
        self._counted -= self.counts(item)
        return item

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
