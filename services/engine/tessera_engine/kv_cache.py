"""Paged KV cache bookkeeping: a pool of fixed-size blocks, per-request block
tables grown on demand, and a hash-chained prefix cache with LRU eviction.

A full block is identified by sha256(parent block's hash, its token ids), so a
block hash names the whole prefix up to and including that block. Past the last whole
block a prefix shares with the cache, a request may still share the first tokens of the
next one (chat prompts share a system prompt that rarely ends on a block boundary): a
cached block whose first t < block_size tokens follow the same parent is found through
keys of (parent hash, those t tokens), and the model runner copies those t slots of its
K/V into the request's own fresh block (the copy source is held until that step has run),
as SGLang's radix cache reuses any token prefix while vLLM reuses whole blocks only. sha256, not
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

K/V depends on more than the tokens where a LoRA adapter runs (its K and V projections):
such a request's chain starts from its `cache_salt` (a hash naming the adapter and the load
it came from) instead of nothing, so it shares blocks only with requests of the same adapter.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
from array import array
from typing import NamedTuple, Sequence

from tessera_engine.request import Sample, SampleKey

FREED_BLOCK = -1  # a block table entry whose block a sliding window let go


@dataclasses.dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    partial_keys: list[bytes] | None = None  # its keys in KVCacheManager.partial, while published


class PrefixHit(NamedTuple):
    """A request's cached prefix: whole blocks, then maybe the first copy_tokens slots of
    block copy_from, to be copied into the request's next (fresh) block."""
    block_ids: list[int]
    num_tokens: int  # tokens cached, the copied ones included
    copy_from: int | None = None
    copy_tokens: int = 0


class KVCopy(NamedTuple):
    """Slots [0, num_tokens) of block src copied into block dst, in the step before its attention."""
    src: int
    dst: int
    num_tokens: int


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


def partial_key(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The key under which a block is found by its first len(token_ids) tokens: the parent's
    hash (fixed width) and the tokens themselves, so equal keys mean equal prefixes."""
    return (parent_hash or b"") + array("q", token_ids).tobytes()


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
        # partial_key(parent, first t tokens) -> cached blocks starting so, for 0 < t < block_size
        self.partial: dict[bytes, dict[int, None]] = {}
        self._pinned: list[int] = []  # copy sources held until the step that copies them has run
        self._step_copies: dict[int, tuple[int, int]] = {}  # this step's copies: dst -> (src, tokens)
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

    def block_table(self, req: Sample) -> list[int]:
        blocks = self.req_blocks.get(req.key)
        return blocks.block_ids if blocks is not None else []

    # -- prefix cache --------------------------------------------------------
    def _block_hashes(self, req: Sample, num_tokens: int) -> list[bytes]:
        """Hashes of the request's full blocks among its first num_tokens tokens (memoized)."""
        hashes = self.req_blocks.setdefault(req.key, RequestBlocks()).hashes
        bs = self.block_size
        tokens = req.all_token_ids
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else req.cache_salt
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, req: Sample) -> PrefixHit:
        """Longest cached prefix of a request about to be scheduled from scratch.

        At least one token is always left to compute, since its logits are needed to
        sample. A request that still wants its prompt logprobs reads nothing from the cache
        (as in vLLM): every prompt position must go through the model (its blocks are still
        cached for others).
        """
        if not self.enable_prefix_caching or (req.params.prompt_logprobs is not None
                                              and not req.prompt_logprobs_done):
            return PrefixHit([], 0)
        max_tokens = req.num_tokens - 1
        hashes = self._block_hashes(req, max_tokens)
        if self.window:
            return PrefixHit(*self._find_cached_window(hashes))
        found: list[int] = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        num = len(found) * self.block_size
        rest = req.all_token_ids[num:num + min(self.block_size - 1, max_tokens - num)]
        src, t = self._find_partial(hashes[len(found) - 1] if found else req.cache_salt, rest)
        if src in self._step_copies:
            # the source's first slots are themselves copied this step, and the step's copies
            # all read before any writes: read from where they come (at most what was copied)
            src, copied = self._step_copies[src]
            t = min(t, copied)
        return PrefixHit(found, num + t, src if t else None, t)

    def _find_partial(self, parent: bytes | None, tokens: Sequence[int]) -> tuple[int | None, int]:
        """A cached block after `parent` sharing the longest start with `tokens`, and how many
        tokens it shares (None, 0: none). A block sharing t tokens has every shorter key too,
        so the longest shared start is found by bisection."""
        best, lo, hi = None, 0, len(tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ids = self.partial.get(partial_key(parent, tokens[:mid]))
            if ids:
                best, lo = next(reversed(ids)), mid
            else:
                hi = mid - 1
        return best, lo

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
    def allocate(self, req: Sample, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room for num_new_tokens more tokens of req (after its computed ones).

        hit: the prefix found by find_cached_prefix, taken on the first allocation (its
        copy source, if any, is held until release_copy_sources). Returns False, changing
        nothing, when the pool is short.
        """
        blocks = self.req_blocks.get(req.key)
        table = blocks.block_ids if blocks is not None else None
        if self.window and table:  # first give back what the window has left behind
            self._free_outside_window(req, req.num_computed_tokens)
        cached_blocks = hit.block_ids if hit else []
        copy_from = hit.copy_from if hit and not table else None
        have = (len(table) if table else 0) + len(cached_blocks)
        num_computed = req.num_computed_tokens if table else (hit.num_tokens if hit else 0)
        need_total = -(-(num_computed + num_new_tokens) // self.block_size)
        need_new = max(0, need_total - have)
        # Cached blocks that are free count against the free pool when we take them.
        reclaim = sum(1 for b in cached_blocks if b != FREED_BLOCK and self.blocks[b].ref_cnt == 0)
        if copy_from is not None and self.blocks[copy_from].ref_cnt == 0:
            reclaim += 1
        if need_new + reclaim > self.num_free_blocks:
            return False
        if table is None:
            table = self.req_blocks.setdefault(req.key, RequestBlocks()).block_ids
        for block_id in cached_blocks:
            if block_id == FREED_BLOCK:
                table.append(block_id)
                continue
            self._hold(block_id)
            table.append(block_id)
        if copy_from is not None:  # held before fresh blocks are taken, which could evict it
            self._hold(copy_from)
            self._pinned.append(copy_from)
        for _ in range(need_new):
            table.append(self._take_free_block())
        if self.enable_prefix_caching:  # (speculated tokens are not known yet: not published)
            self._register_full_blocks(req, min(num_computed + num_new_tokens, req.num_tokens))
        return True

    def _hold(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def copy_for(self, req: Sample, hit: PrefixHit) -> KVCopy | None:
        """The copy a partial hit asks for, once allocate took it: into the request's first fresh block."""
        if hit.copy_from is None:
            return None
        copy = KVCopy(hit.copy_from, self.req_blocks[req.key].block_ids[len(hit.block_ids)], hit.copy_tokens)
        self._step_copies[copy.dst] = (copy.src, copy.num_tokens)
        return copy

    def release_copy_sources(self) -> None:
        """Let go of the copy sources held for the last step (it has run)."""
        for block_id in self._pinned:
            self._release(block_id)
        self._pinned.clear()
        self._step_copies.clear()

    def _free_outside_window(self, req: Sample, num_computed: int) -> None:
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
        self._unpublish(block)
        block.ref_cnt = 1
        return block_id

    def _unpublish(self, block: Block) -> None:
        """Take a block out of the prefix cache (whole and partial keys)."""
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        for key in block.partial_keys or ():
            ids = self.partial.get(key)
            if ids is not None:
                ids.pop(block.block_id, None)
                if not ids:
                    del self.partial[key]
        block.partial_keys = None

    def _register_full_blocks(self, req: Sample, num_tokens: int) -> None:
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
                if not self.window:
                    self._publish_partial(block, hashes[i - 1] if i else req.cache_salt,
                                          req.all_token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _publish_partial(self, block: Block, parent: bytes | None, tokens: Sequence[int]) -> None:
        block.partial_keys = [partial_key(parent, tokens[:t]) for t in range(1, self.block_size)]
        for key in block.partial_keys:
            self.partial.setdefault(key, {})[block.block_id] = None

    def forget_free_blocks(self) -> None:
        """Unpublish every free block's hash: after a failed step, blocks published for it
        (see _register_full_blocks) may never have been written, and must not be reused."""
        for block_id in self.free_queue:
            self._unpublish(self.blocks[block_id])

    def free(self, req: Sample) -> None:
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
