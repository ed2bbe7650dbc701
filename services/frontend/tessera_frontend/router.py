"""Which engine replica gets a new request: the least loaded, unless another holds its prefix.

Load is the replica's number of outstanding requests (submitted, not finished).
Prefix affinity: the router remembers, for recent prompts, which replicas were
sent which prompt blocks (chained hashes of `block_tokens`-token blocks, as the
engines' prefix caches key their KV blocks) in a bounded LRU (`PrefixIndex`).
A new request goes to the replica that holds the longest run of its leading
blocks when all of these hold:

  * that run is at least `min_match_tokens` longer than the least-loaded
    replica's own run (an equal or nearly equal match on a less busy replica
    wins, so a chat template and a few common words at the head of every
    prompt do not pin all traffic to one replica);
  * it covers at least `min_match_fraction` of the prompt (a short shared head
    of a long prompt is not worth a busier replica);
  * that replica has at most `max_imbalance` more outstanding requests than the
    least loaded (affinity yields when it is much busier).

Otherwise the least-loaded replica gets it; ties go round-robin. A request for a LoRA
adapter keys its blocks by the adapter too (its KV differs from the base model's for the
same tokens), so the same prompt under two adapters shares no affinity. The router
only sees replicas the caller offers (connected and healthy ones); `forget`
drops what it knew of a replica whose cache was lost (it restarted).
"""
from __future__ import annotations

import collections
from typing import Protocol, Sequence, TypeVar

DEFAULT_BLOCK_TOKENS = 16
DEFAULT_MAX_IMBALANCE = 4
DEFAULT_MIN_MATCH_FRACTION = 0.5
DEFAULT_MIN_MATCH_TOKENS = 128
DEFAULT_CAPACITY_BLOCKS = 65_536
MAX_HASHED_BLOCKS = 512  # affinity looks at a prompt's first 512 blocks (8192 tokens at 16)


class Replica(Protocol):
    @property
    def addr(self) -> str: ...

    @property
    def outstanding(self) -> int: ...


R = TypeVar("R", bound=Replica)


def prefix_block_hashes(token_ids: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS,
                        max_blocks: int = MAX_HASHED_BLOCKS, lora_name: str = "") -> list[int]:
    """One hash per full leading block, each chained to the one before (a prefix's identity);
    the chain starts from the LoRA adapter's name when there is one."""
    hashes: list[int] = []
    parent = hash(("lora", lora_name)) if lora_name else 0
    full = min(len(token_ids) // block_tokens, max_blocks)
    for i in range(full):
        parent = hash((parent, tuple(token_ids[i * block_tokens:(i + 1) * block_tokens])))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Block hash -> addresses of the replicas sent that block, least recently used evicted first."""

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        self.capacity = capacity_blocks
        self._holders: collections.OrderedDict[int, set[str]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each replica holding the first block: how many leading blocks it holds in a row."""
        if not hashes or hashes[0] not in self._holders:
            return {}
        alive = set(self._holders[hashes[0]])
        matched = dict.fromkeys(alive, 1)
        for depth, block in enumerate(hashes[1:], start=2):
            holders = self._holders.get(block)
            if holders is None:
                break
            alive &= holders
            if not alive:
                break
            for addr in alive:
                matched[addr] = depth
        return matched

    def record(self, hashes: Sequence[int], addr: str) -> None:
        for block in hashes:
            holders = self._holders.get(block)
            if holders is None:
                self._holders[block] = {addr}
            else:
                holders.add(addr)
                self._holders.move_to_end(block)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def forget(self, addr: str) -> None:
        for block in [b for b, holders in self._holders.items() if addr in holders]:
            holders = self._holders[block]
            holders.discard(addr)
            if not holders:
                del self._holders[block]


class Router:
    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS, max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                 min_match_fraction: float = DEFAULT_MIN_MATCH_FRACTION,
                 min_match_tokens: int = DEFAULT_MIN_MATCH_TOKENS,
                 capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        self.block_tokens = block_tokens
        self.max_imbalance = max_imbalance
        self.min_match_fraction = min_match_fraction
        self.min_match_tokens = min_match_tokens
        self.index = PrefixIndex(capacity_blocks)
        self._turn = 0

    def choose(self, candidates: Sequence[R], prompt_token_ids: Sequence[int] = (), lora_name: str = "") -> R | None:
        """The replica for a request with this prompt (under this LoRA adapter; "": the base model),
        or None when there is no candidate."""
        if not candidates:
            return None
        self._turn += 1
        count = len(candidates)
        # Rotating the start makes min()/max() break ties round-robin (they keep the first extreme).
        rotated = [candidates[(self._turn + i) % count] for i in range(count)]
        least = min(rotated, key=lambda r: r.outstanding)
        hashes = prefix_block_hashes(prompt_token_ids, self.block_tokens, lora_name=lora_name)
        if not hashes:
            return least
        chosen = least
        considered = min(len(prompt_token_ids), MAX_HASHED_BLOCKS * self.block_tokens)
        matched = self.index.match(hashes)
        if matched:
            best = max(rotated, key=lambda r: (matched.get(r.addr, 0), -r.outstanding))
            best_blocks = matched.get(best.addr, 0)
            advantage = (best_blocks - matched.get(least.addr, 0)) * self.block_tokens
            if (advantage > 0 and advantage >= self.min_match_tokens
                    and best_blocks * self.block_tokens >= self.min_match_fraction * considered
                    and best.outstanding - least.outstanding <= self.max_imbalance):
                chosen = best
        self.index.record(hashes, chosen.addr)
        return chosen

    def forget(self, addr: str) -> None:
        """The replica at `addr` lost its prefix cache (it restarted): stop preferring it."""
        self.index.forget(addr)
