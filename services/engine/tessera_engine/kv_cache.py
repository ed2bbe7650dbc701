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

A model whose layers attend differently (Gemma: sliding-window and global layers) has several
KV cache groups (kv_layout.py), each with its own block table per request in the one pool:
a block belongs to one group at a time and is cached under its group's hashes (the same tokens
give each group different K/V). A request allocates for every group or for none (admission and
preemption count the blocks of all groups), and a prefix hit is the longest prefix that every
group serves: the global group needs all its blocks, a sliding group only those its window
reaches. The whole-and-partial-block hits above need one full-attention group.

K/V depends on more than the tokens where a LoRA adapter runs (its K and V projections):
such a request's chain starts from its `cache_salt` (a hash naming the adapter and the load
it came from) instead of nothing, so it shares blocks only with requests of the same adapter.

K/V depends on whether a token was the sample's prompt or its output where the backend plan
computes prompt rows on the dense matmul and output rows on the quantized one (`prompt_dense`):
then (`outputs_apart`) a block holding output tokens is hashed with how many of its tokens were
prompt, so only a sample with the same prompt and outputs (itself after a preemption, another
of its n) reuses it, and a partial-block hit copies prompt tokens only.
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
    group: int = 0  # the KV cache group whose hashes it is cached under


class PrefixHit(NamedTuple):
    """A request's cached prefix: whole blocks (one list per KV cache group), then maybe the
    first copy_tokens slots of block copy_from, to be copied into the request's next (fresh)
    block (one full-attention group only)."""
    block_ids: tuple[list[int], ...]
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
    """One request's share of the pool: a block table per KV cache group, all of one length
    (entries a sliding window let go stay, as FREED_BLOCK, so positions keep indexing them)."""
    tables: tuple[list[int], ...]
    num_freed: list[int]  # per group: leading entries a sliding window let go
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # of its full blocks, memoized
    num_registered: int = 0  # leading blocks already published in the prefix cache

    @staticmethod
    def empty(num_groups: int) -> "RequestBlocks":
        return RequestBlocks(tuple([] for _ in range(num_groups)), [0] * num_groups)


def partial_key(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The key under which a block is found by its first len(token_ids) tokens: the parent's
    hash (fixed width) and the tokens themselves, so equal keys mean equal prefixes."""
    return (parent_hash or b"") + array("q", token_ids).tobytes()


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], prompt_tokens: int | None = None) -> bytes:
    """sha256 of the parent's 32-byte hash (nothing for the first block) and the block's
    token ids as int64: fixed widths, so no two (parent, tokens) pairs share an input.
    prompt_tokens: how many of the tokens are the sample's prompt, for a block that holds
    output tokens too, where those were computed otherwise (KVCacheManager.outputs_apart);
    an int64 more, so such a block never shares a hash with a block of prompt tokens only."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    if prompt_tokens is not None:
        h.update(array("q", [prompt_tokens]).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,), outputs_apart: bool = False) -> None:
        """windows: each KV cache group's sliding window (None: full attention), kv_layout's order.
        outputs_apart: a sample's output tokens get other K/V than the same tokens in a prompt
        (the backend plan's prompt_dense: prompt rows on the dense matmul, output rows on the
        quantized one), so a block holding output tokens is cached apart (hash_block's
        prompt_tokens) and a partial-block hit copies prompt tokens only."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        if not windows:
            raise ValueError("the KV cache needs at least one group")
        self.block_size = block_size
        self.windows = list(windows)
        self.num_groups = len(self.windows)
        self.window_groups = [g for g, w in enumerate(self.windows) if w]
        # partial-block hits copy one block's first slots: one full-attention group only
        self.partial_hits = self.windows == [None]
        self.outputs_apart = outputs_apart
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first). dict keeps insertion order.
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(num_blocks))
        self.cached: list[dict[bytes, int]] = [{} for _ in self.windows]  # per group: block hash -> block id
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

    def block_tables(self, req: Sample) -> tuple[list[int], ...]:
        """The request's block table of each group (live views, grown as it runs)."""
        blocks = self.req_blocks.get(req.key)
        return blocks.tables if blocks is not None else tuple([] for _ in self.windows)

    def block_table(self, req: Sample, group: int = 0) -> list[int]:
        return self.block_tables(req)[group]

    def held_blocks(self, req: Sample) -> list[int]:
        """Blocks the request holds now in each group (the ones a window let go not counted)."""
        return [sum(b != FREED_BLOCK for b in t) for t in self.block_tables(req)]

    def blocks_needed(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once, all groups together,
        prefilled in chunks of at most `chunk` tokens: a full-attention group all of its blocks,
        a sliding one the window behind a step's chunk plus the chunk."""
        bs = self.block_size
        every = -(-num_tokens // bs)
        # a step's tokens [p, p + chunk) see back to p - w + 1: w + chunk - 1 positions, which
        # straddle at most one block more than they fill
        return sum(min(every, -(-(w + chunk - 1) // bs) + 1) if w else every for w in self.windows)

    # -- prefix cache --------------------------------------------------------
    def _block_hashes(self, req: Sample, num_tokens: int) -> list[bytes]:
        """Hashes of the request's full blocks among its first num_tokens tokens (memoized)."""
        blocks = self.req_blocks.get(req.key)
        if blocks is None:
            blocks = self.req_blocks[req.key] = RequestBlocks.empty(self.num_groups)
        hashes = blocks.hashes
        bs = self.block_size
        tokens = req.all_token_ids
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else req.cache_salt
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs], self._prompt_part(req, i)))
        return hashes

    def _prompt_part(self, req: Sample, i: int) -> int | None:
        """How many of block i's tokens are the sample's prompt where that is not all of them and
        outputs are cached apart; else None."""
        n = req.num_prompt_tokens - i * self.block_size
        return max(n, 0) if self.outputs_apart and n < self.block_size else None

    def find_cached_prefix(self, req: Sample) -> PrefixHit:
        """Longest cached prefix of a request about to be scheduled from scratch.

        At least one token is always left to compute, since its logits are needed to
        sample. A request that still wants its prompt logprobs reads nothing from the cache
        (as in vLLM): every prompt position must go through the model (its blocks are still
        cached for others).
        """
        if not self.enable_prefix_caching or (req.params.prompt_logprobs is not None
                                              and not req.prompt_logprobs_done):
            return PrefixHit(tuple([] for _ in self.windows), 0)
        max_tokens = req.num_tokens - 1
        hashes = self._block_hashes(req, max_tokens)
        if not self.partial_hits:
            return self._find_cached_groups(hashes)
        found: list[int] = []
        cached = self.cached[0]
        for h in hashes:
            block_id = cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        num = len(found) * self.block_size
        end = num + min(self.block_size - 1, max_tokens - num)
        if self.outputs_apart:  # only prompt tokens are published by their first tokens (_publish_partial)
            end = min(end, req.num_prompt_tokens)
        rest = req.all_token_ids[num:end]
        src, t = self._find_partial(hashes[len(found) - 1] if found else req.cache_salt, rest)
        if src in self._step_copies:
            # the source's first slots are themselves copied this step, and the step's copies
            # all read before any writes: read from where they come (at most what was copied)
            src, copied = self._step_copies[src]
            t = min(t, copied)
        return PrefixHit((found,), num + t, src if t else None, t)

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

    def _find_cached_groups(self, hashes: list[bytes]) -> PrefixHit:
        """The longest prefix of k whole blocks every group serves: each group has cached the
        blocks that the window of position k * bs reaches (a full-attention group: all k); the
        blocks before a window's reach are FREED_BLOCK entries of that group's table."""
        bs, n = self.block_size, len(hashes)
        ok = [True] * (n + 1)  # ok[k]: every group serves a prefix of k blocks
        group_ids = []
        for g in range(self.num_groups):
            cached = self.cached[g]
            ids = [cached.get(h) for h in hashes]
            group_ids.append(ids)
            run_start = 0  # first block of the cached run ending at block k - 1
            for k in range(1, n + 1):
                if ids[k - 1] is None:
                    run_start = k
                if run_start > self._first_needed_block(g, k * bs):
                    ok[k] = False
        best = max(k for k in range(n + 1) if ok[k])
        tables = []
        for g, ids in enumerate(group_ids):
            first = self._first_needed_block(g, best * bs)
            tables.append([FREED_BLOCK] * first + ids[first:best])
        return PrefixHit(tuple(tables), best * bs)

    def _first_needed_block(self, group: int, position: int) -> int:
        """The first block of a group that the window of a token at `position` reaches (0
        for full attention)."""
        w = self.windows[group]
        return max(0, position - w + 1) // self.block_size if w else 0

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one scheduled lookup (vLLM counts tokens, not blocks)."""
        if self.enable_prefix_caching:
            self.queries += num_tokens
            self.hits += num_hit

    # -- allocation ----------------------------------------------------------
    def allocate(self, req: Sample, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room for num_new_tokens more tokens of req (after its computed ones), in every
        group or in none.

        hit: the prefix found by find_cached_prefix, taken on the first allocation (its
        copy source, if any, is held until release_copy_sources). Returns False, changing
        nothing, when the pool is short.
        """
        blocks = self.req_blocks.get(req.key)
        started = blocks is not None and bool(blocks.tables[0])
        if started:
            for g in self.window_groups:  # first give back what the windows have left behind
                self._free_outside_window(blocks, g, req.num_computed_tokens)
            have = len(blocks.tables[0])  # every group's table has one length
            num_computed = req.num_computed_tokens
            hit = None
        else:
            have = len(hit.block_ids[0]) if hit else 0
            num_computed = hit.num_tokens if hit else 0
        need_new = max(0, -(-(num_computed + num_new_tokens) // self.block_size) - have)
        copy_from = hit.copy_from if hit else None
        reclaim = 0  # cached blocks that are free count against the free pool when we take them
        if hit:
            for ids in hit.block_ids:
                reclaim += sum(1 for b in ids if b != FREED_BLOCK and self.blocks[b].ref_cnt == 0)
            if copy_from is not None and self.blocks[copy_from].ref_cnt == 0:
                reclaim += 1
        if need_new * self.num_groups + reclaim > self.num_free_blocks:
            return False
        if blocks is None:
            blocks = self.req_blocks[req.key] = RequestBlocks.empty(self.num_groups)
        if hit:
            for table, ids in zip(blocks.tables, hit.block_ids):
                for block_id in ids:
                    if block_id != FREED_BLOCK:
                        self._hold(block_id)
                    table.append(block_id)
        if copy_from is not None:  # held before fresh blocks are taken, which could evict it
            self._hold(copy_from)
            self._pinned.append(copy_from)
        for g, table in enumerate(blocks.tables):
            for _ in range(need_new):
                table.append(self._take_free_block(g))
        if self.enable_prefix_caching:  # (speculated tokens are not known yet: not published)
            self._register_full_blocks(req, blocks, min(num_computed + num_new_tokens, req.num_tokens))
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
        copy = KVCopy(hit.copy_from, self.req_blocks[req.key].tables[0][len(hit.block_ids[0])], hit.copy_tokens)
        self._step_copies[copy.dst] = (copy.src, copy.num_tokens)
        return copy

    def release_copy_sources(self) -> None:
        """Let go of the copy sources held for the last step (it has run)."""
        for block_id in self._pinned:
            self._release(block_id)
        self._pinned.clear()
        self._step_copies.clear()

    def _free_outside_window(self, blocks: RequestBlocks, group: int, num_computed: int) -> None:
        """Free the group's blocks no token from position num_computed on attends: the window
        of the step's first token starts in block _first_needed_block(group, num_computed)."""
        table = blocks.tables[group]
        upto = self._first_needed_block(group, num_computed)
        for i in range(blocks.num_freed[group], upto):
            if table[i] != FREED_BLOCK:
                self._release(table[i])
                table[i] = FREED_BLOCK
        blocks.num_freed[group] = max(blocks.num_freed[group], upto)

    def _take_free_block(self, group: int) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        self._unpublish(block)
        block.ref_cnt = 1
        block.group = group
        return block_id

    def _unpublish(self, block: Block) -> None:
        """Take a block out of the prefix cache (whole and partial keys)."""
        if block.block_hash is not None:
            cached = self.cached[block.group]
            if cached.get(block.block_hash) == block.block_id:
                del cached[block.block_hash]
            block.block_hash = None
        for key in block.partial_keys or ():
            ids = self.partial.get(key)
            if ids is not None:
                ids.pop(block.block_id, None)
                if not ids:
                    del self.partial[key]
        block.partial_keys = None

    def _register_full_blocks(self, req: Sample, blocks: RequestBlocks, num_tokens: int) -> None:
        """Publish the blocks that will be full after this step under their hashes, in each group.

        Their K/V is written in this step's forward pass before any attention
        reads, so a request scheduled in the same step may already reuse them.
        """
        num_full = num_tokens // self.block_size  # hashes may run ahead (memoized by a lookup)
        start = blocks.num_registered
        if num_full <= start:
            return
        hashes = self._block_hashes(req, num_tokens)
        blocks.num_registered = num_full
        for g, table in enumerate(blocks.tables):
            cached = self.cached[g]
            for i in range(start, num_full):
                if table[i] == FREED_BLOCK:  # a window-only prefix hit: nothing held there
                    continue
                h = hashes[i]
                block = self.blocks[table[i]]
                if block.block_hash is None:
                    if h in cached:  # same content already cached in another block
                        continue
                    block.block_hash = h
                    cached[h] = block.block_id
                    if self.partial_hits:
                        part = self._prompt_part(req, i)
                        self._publish_partial(block, hashes[i - 1] if i else req.cache_salt,
                                              req.all_token_ids[i * self.block_size:(i + 1) * self.block_size],
                                              self.block_size - 1 if part is None else part)

    def _publish_partial(self, block: Block, parent: bytes | None, tokens: Sequence[int], longest: int) -> None:
        """Publish the block by its first t tokens, for t up to `longest` (< block_size)."""
        block.partial_keys = [partial_key(parent, tokens[:t]) for t in range(1, longest + 1)]
        for key in block.partial_keys:
            self.partial.setdefault(key, {})[block.block_id] = None

    def forget_free_blocks(self) -> None:
        """Unpublish every free block's hash: after a failed step, blocks published for it
        (see _register_full_blocks) may never have been written, and must not be reused."""
        for block_id in self.free_queue:
            self._unpublish(self.blocks[block_id])

    def free(self, req: Sample) -> None:
        """Release a finished, aborted or preempted request's blocks (each table tail first)."""
        blocks = self.req_blocks.pop(req.key, None)
        if blocks is None:
            return
        for table in blocks.tables:
            for block_id in reversed(table):
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
