"""The samples of each request in flight on an engine Session that have not finished, counted
by the rule both ends of the Session share: an output with a finish reason ends one sample
(an abort of a whole request sends one per sample still running), an error ends the whole
request whatever n is. The engine counts what it accepted (its drain waits for none left);
the frontend counts what it sent to each replica (load, and what a broken session loses).
"""
from __future__ import annotations

from typing import Generic, Hashable, Iterator, TypeVar

K = TypeVar("K", bound=Hashable)


class OpenSamples(Generic[K]):
    """Request key -> samples not finished yet."""

    def __init__(self) -> None:
        self._left: dict[K, int] = {}

    def __len__(self) -> int:
        return len(self._left)

    def __contains__(self, key: K) -> bool:
        return key in self._left

    def __iter__(self) -> Iterator[K]:
        return iter(self._left)

    def add(self, key: K, num_samples: int) -> None:
        self._left[key] = num_samples

    def finish(self, key: K, whole_request: bool = False) -> bool:
        """One sample of `key` finished (all of them with `whole_request`, an error); True when
        that ended the request. An unknown key changes nothing (False)."""
        left = self._left.get(key)
        if left is None:
            return False
        if whole_request or left <= 1:
            del self._left[key]
            return True
        self._left[key] = left - 1
        return False

    def discard(self, key: K) -> None:
        self._left.pop(key, None)

    def clear(self) -> list[K]:
        """Forget every request; return their keys."""
        keys, self._left = list(self._left), {}
        return keys
