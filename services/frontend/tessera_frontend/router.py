"""Which engine replica gets a new request.

Policy for now: the replica with the fewest outstanding requests among those whose
Session stream is open; ties go round-robin so that idle replicas share the load.
(Prefix affinity and health weighting come later.)
"""
from __future__ import annotations

from typing import Protocol, Sequence, TypeVar


class Replica(Protocol):
    @property
    def outstanding(self) -> int: ...


R = TypeVar("R", bound=Replica)


class Router:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[R]) -> R | None:
        """The least-loaded candidate, or None when there is none."""
        if not candidates:
            return None
        self._turn += 1
        count = len(candidates)
        # Rotating the start makes min() break ties round-robin (min keeps the first minimum).
        rotated = [candidates[(self._turn + i) % count] for i in range(count)]
        return min(rotated, key=lambda r: r.outstanding)
