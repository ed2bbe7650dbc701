"""Admission control: a cap on the requests the frontend has in flight.

Both public APIs take a `Ticket` from the one `AdmissionController` before they
start a request and give it back when the request is over (finished, failed or
cancelled). Past the cap a new request is refused at once with `Overloaded`
(gRPC RESOURCE_EXHAUSTED, HTTP 429) instead of queueing without bound; the
requests already admitted are not touched. A request of several prompts (an
OpenAI /v1/completions batch) takes one slot per prompt, all or none.
"""
from __future__ import annotations

import time

from tessera.common import tracing


class Overloaded(Exception):
    """The frontend is at its in-flight cap; the message says so for the client."""


class Ticket:
    """Slots held by one admitted request; `release()` is idempotent, `with` releases on exit."""

    def __init__(self, controller: "AdmissionController", count: int) -> None:
        self._controller = controller
        self._count = count

    def release(self) -> None:
        if self._count:
            self._controller._in_flight -= self._count
            self._count = 0

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class AdmissionController:
    """Counts requests in flight against `max_inflight` (one event loop, so no lock is needed)."""

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1 (got {max_inflight})")
        self.max_inflight = max_inflight
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def admit(self, count: int = 1) -> Ticket:
        """Take `count` slots or raise Overloaded (taking none)."""
        if tracing.ENABLED:  # a span under the handler's: the slots asked for, the load, a refusal
            self._trace(count)
        if self._in_flight + count > self.max_inflight:
            raise Overloaded(f"the server is at its limit of {self.max_inflight} requests in flight "
                             f"({self._in_flight} running); retry later")
        self._in_flight += count
        return Ticket(self, count)

    def _trace(self, count: int) -> None:
        now = time.time()
        refused = self._in_flight + count > self.max_inflight
        tracing.record_span("admission", now, now, attributes={
            "tessera.admission.slots": count, "tessera.admission.in_flight": self._in_flight,
            "tessera.admission.max_inflight": self.max_inflight, "tessera.admission.admitted": not refused},
            error="over the in-flight cap" if refused else None)
