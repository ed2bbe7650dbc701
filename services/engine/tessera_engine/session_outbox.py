"""SessionOutbox: what one engine Session stream has waiting for its gRPC writer.

Each engine step puts one EngineStepOutputs for the session; besides those, control items
(the client closed its side, the core loop died, the drain is over) end the stream. A
frontend that reads slowly (or a connection that stalls) must not make the queue grow
with every step: once MAX_WAITING step messages wait, a new step's outputs are folded into
the last waiting message, each merged with its sample's output there (token ids and
logprobs joined, the later status), so the queue holds at most MAX_WAITING messages plus
one output per sample in flight. The core loop and the other sessions never wait for a
slow reader, nothing is lost or reordered, and memory is bounded by the requests' own
tokens; a reader that keeps up still gets one message per step. (The frontend's
OutputCollector is the same MergingQueue, for each request's client.)
"""
from __future__ import annotations

import collections

from tessera.common.request_outputs import RUNNING, MergingQueue, merged_request_output
from tessera.v1 import engine_pb2


class SessionOutbox(MergingQueue[object]):
    """A Session's step messages and control items; a MergingQueue whose steps count and fold."""

    MAX_WAITING = 64

    def counts(self, item: object) -> bool:
        return isinstance(item, engine_pb2.EngineStepOutputs)

    def merge(self, waiting: collections.deque, item: object) -> bool:
        """Fold the step into the newest waiting message, when that is a step too."""
        if not isinstance(waiting[-1], engine_pb2.EngineStepOutputs):
            return False
        _fold(waiting[-1], item)
        return True

    def put_step(self, step: engine_pb2.EngineStepOutputs) -> None:
        """One step's outputs for this session (from the event loop's thread)."""
        self.put_nowait(step)

    def put_control(self, item: object) -> None:
        """A control item (a sentinel of the server's): delivered after everything before it."""
        self.put_nowait(item)

    def waiting_outputs(self) -> int:
        """RequestOutputs waiting in step messages (what the bound is about)."""
        return sum(len(i.outputs) for i in self._items if isinstance(i, engine_pb2.EngineStepOutputs))


def _fold(last: engine_pb2.EngineStepOutputs, step: engine_pb2.EngineStepOutputs) -> None:
    """Fold `step` into `last`, the newest waiting message: a sample's output joins its
    running output there, any other output (a new sample, or one whose output in `last`
    is finished) goes after them."""
    where = {(o.request_id, o.index): i for i, o in enumerate(last.outputs)}
    for out in step.outputs:
        i = where.get((out.request_id, out.index))
        if i is not None and last.outputs[i].finish_reason == RUNNING and not last.outputs[i].HasField("error"):
            last.outputs[i].CopyFrom(merged_request_output(last.outputs[i], out))
        else:
            where[(out.request_id, out.index)] = len(last.outputs)
            last.outputs.add().CopyFrom(out)
