"""Paged KV cache bookkeeping: a pool of fixed-size blocks, per-request block
tables grown on demand, and a hash-chained prefix cache with LRU eviction.

A full block is identified by sha256(parent block's hash, its token ids), so a
block hash names the whole prefix up to and including that block. sha256, not
Python's 64-bit hash(): a collision would hand one request another's cached KV
(vLLM moved to sha256 for the same reason). Blocks whose
reference count drops to zero go to the back of the free queue but keep their
hash, so a later request with the same prefix can take them back; allocation
takes from the front of the queue, evicting the least recently freed first.

With a sliding window (each token attends only its last `window` positions), blocks wholly
before the window of a request's next token are freed while it runs, as vLLM's sliding-window
manager does; their table entries become FREED_BLOCK, so positions keep indexing the table.
A prefix-cache hit then needs only the blocks its first new token's window reaches, not the
whole chain: the hash of block i still names every token up to it.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
from array import array
from typing import Sequence

from tessera_engine.request import Request, SampleKey

FREED_BLOCK = -1  # a block table entry whose block a sliding window let go


@dataclasses.dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclasses.dataclass
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int     # tokens found cached

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclasses.dataclass
class RequestBlocks:
    """One request's share of the pool."""
    block_ids: list[int] = dataclasses.field(default_factory=list)  # its block table
    hashes: list[bytes] = dataclasses.field(default_factory=list)   # of its full blocks, memoized
    num_registered: int = 0  # leading blocks already published in the prefix cache
    num_freed: int = 0       # leading entries a sliding window let go (FREED_BLOCK)


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """sha256 of the parent's 32-byte hash (nothing for the first block) and the block's
    token ids as int64: fixed widths, so no two (parent, tokens) pairs share an input."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first). dict keeps insertion order.
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.req_blocks: dict[SampleKey, RequestBlocks] = {}
        self.queries = 0
        self.hits = 0

    # -- queries -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.num_blocks, self.num_free_blocks, self.queries, self.hits)

    def block_table(self, req: Request) -> list[int]:
        blocks = self.req_blocks.get(req.key)
        return blocks.block_ids if blocks is not None else []

    # -- prefix cache --------------------------------------------------------
    def _block_hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the request's full blocks among its first num_tokens tokens (memoized)."""
        hashes = self.req_blocks.setdefault(req.key, RequestBlocks()).hashes
        bs = self.block_size
        tokens = req.all_token_ids
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request about to be scheduled from scratch.

        Returns (block ids, number of tokens they hold). At least one token is
        always left to compute, since its logits are needed to sample. A request that
        still wants its prompt logprobs reads nothing from the cache (as in vLLM): every
        prompt position must go through the model (its blocks are still cached for others).
        """
        if not self.enable_prefix_caching or (req.params.prompt_logprobs is not None
                                              and not req.prompt_logprobs_done):
            return [], 0
        max_tokens = req.num_tokens - 1
        hashes = self._block_hashes(req, max_tokens)
        if self.window:
            return self._find_cached_window(hashes)
        found: list[int] = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found, len(found) * self.block_size

    def _find_cached_window(self, hashes: list[bytes]) -> tuple[list[int], int]:
        """Longest prefix of k blocks whose last blocks, those the window of position k * bs
        reaches, are all cached; the blocks before them are FREED_BLOCK entries."""
        bs = self.block_size
        ids = [self.cached.get(h) for h in hashes]
        best, run_start = 0, 0  # run_start: first block of the cached run ending at block k - 1
        for k in range(1, len(ids) + 1):
            if ids[k - 1] is None:
                run_start = k
            elif run_start <= self._first_needed_block(k * bs):
                best = k
        first = self._first_needed_block(best * bs)
        return [FREED_BLOCK] * first + ids[first:best], best * bs

    def _first_needed_block(self, position: int) -> int:
        """The first block the window of a token at `position` reaches (0 without a window)."""
        return max(0, position - self.window + 1) // self.block_size if self.window else 0

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one scheduled lookup (vLLM counts tokens, not blocks)."""
        if self.enable_prefix_caching:
            self.queries += num_tokens
            self.hits += num_hit

    # -- allocation ----------------------------------------------------------
    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Make room for num_new_tokens more tokens of req (after its computed ones).

        cached_blocks: the prefix found by find_cached_prefix, taken on the first
        allocation. Returns False, changing nothing, when the pool is short.
        """
        blocks = self.req_blocks.get(req.key)
        table = blocks.block_ids if blocks is not None else None
        if self.window and table:  # first give back what the window has left behind
            self._free_outside_window(req, req.num_computed_tokens)
        cached_blocks = cached_blocks or []
        have = (len(table) if table else 0) + len(cached_blocks)
        num_computed = req.num_computed_tokens if table else len(cached_blocks) * self.block_size
        need_total = -(-(num_computed + num_new_tokens) // self.block_size)
        need_new = max(0, need_total - have)
        # Cached blocks that are free count against the free pool when we take them.
        reclaim = sum(1 for b in cached_blocks if b != FREED_BLOCK and self.blocks[b].ref_cnt == 0)
        if need_new + reclaim > self.num_free_blocks:
            return False
        if table is None:
            table = self.req_blocks.setdefault(req.key, RequestBlocks()).block_ids
        for block_id in cached_blocks:
            if block_id == FREED_BLOCK:
                table.append(block_id)
                continue
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1
            table.append(block_id)
        for _ in range(need_new):
            table.append(self._take_free_block())
        if self.enable_prefix_caching:
            self._register_full_blocks(req, num_computed + num_new_tokens)
        return True

    def _free_outside_window(self, req: Request, num_computed: int) -> None:
        """Free the blocks no token from position num_computed on attends: the window of
        the step's first token starts in block _first_needed_block(num_computed)."""
        blocks = self.req_blocks[req.key]
        table = blocks.block_ids
        upto = self._first_needed_block(num_computed)
        for i in range(blocks.num_freed, upto):
            if table[i] != FREED_BLOCK:
                self._release(table[i])
                table[i] = FREED_BLOCK
        blocks.num_freed = max(blocks.num_freed, upto)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def _register_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Publish the blocks that will be full after this step under their hashes.

        Their K/V is written in this step's forward pass before any attention
        reads, so a request scheduled in the same step may already reuse them.
        """
        hashes = self._block_hashes(req, num_tokens)
        num_full = num_tokens // self.block_size  # hashes may run ahead (memoized by a lookup)
        blocks = self.req_blocks[req.key]
        table = blocks.block_ids
        start = blocks.num_registered
        blocks.num_registered = max(start, num_full)
        for i in range(start, num_full):
            if table[i] == FREED_BLOCK:  # a window-only prefix hit: nothing held there
                continue
            h = hashes[i]
            block = self.blocks[table[i]]
            if block.block_hash is None:
                if h in self.cached:  # same content already cached in another block
                    continue
                block.block_hash = h
                self.cached[h] = block.block_id

    def forget_free_blocks(self) -> None:
        """Unpublish every free block's hash: after a failed step, blocks published for it
        (see _register_full_blocks) may never have been written, and must not be reused."""
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None

    def free(self, req: Request) -> None:
        """Release a finished, aborted or preempted request's blocks (tail first)."""
        blocks = self.req_blocks.pop(req.key, None)
        if blocks is None or not blocks.block_ids:
            return
        for block_id in reversed(blocks.block_ids):
            if block_id != FREED_BLOCK:
                self._release(block_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                # Uncached blocks are reused first: they hold nothing worth keeping.
                self.free_queue[block_id] = None
                self.free_queue.move_to_end(block_id, last=False)
            else:
                self.free_queue[block_id] = None
