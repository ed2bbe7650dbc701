"""Paged attention over the flat KV cache: two backends, each building its own metadata.

The cache of a layer is two tensors [num_blocks * block_size, num_kv_heads,
head_dim]; token t of a request lives in slot block_table[t // bs] * bs + t % bs.
A step's tokens are flattened: the first `num_decodes` are single-token decodes,
the rest are prefill chunks.

The model runner picks one backend per engine and asks it, once per step, for the
AttentionMetadata every layer shares; each layer's PagedAttention hands its q/k/v and
that metadata back to the same backend.

- TorchAttention (any device). Decodes: the cache rows of every request's padded
  context, head-major ([D * KVH * L], L = the longest context rounded up to whole
  blocks) and an additive mask [D, 1, 1, L] (0 = attend, -inf = padding). Per layer,
  K/V are gathered with one index_select each straight into [D, KVH, L, d], and the
  query heads that share a KV head are folded into the query length; with one query
  row per head, two batched matmuls and a float32 softmax are several times faster on
  CPU than SDPA's flash kernel. Rotary embedding and the K/V write are torch ops.
- CpuKernelAttention (CPU, tessera_engine.cpu_kernels): every token of the step, a
  prefill chunk's too, attends as a decode of its own position: the kernel reads K/V
  from the cache blocks in place given a block table and context length per token
  (float32 scores and softmax, one pass per (token, KV head)), so chunks need no
  padding, mask or gather; rotary and the K/V write are one fused kernel that indexes
  the whole cos/sin tables by position.
- Prefill chunks, TorchAttention: padded into groups of similar context length and
  attended with one SDPA call per group: queries gathered from the flat batch, keys
  and values gathered from the cache (already holding this step's K/V) straight into
  [N, KVH, Lk, d], with a causal + length mask; so a chunk that continues a request
  (chunked prefill, prefix-cache hit) sees its cached context. GQA is handled by SDPA's
  enable_gqa; torch picks the kernel (flash on CPU, flash / memory-efficient on CUDA).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tessera_engine.models.rotary import apply_rotary_signed


class DecodeEntry(NamedTuple):
    """A single-token decode: its request's block table and its context length (incl. the token)."""
    block_table: list[int]
    context_len: int


class PrefillChunk(NamedTuple):
    """A prefill chunk: positions [start, end) of a request, at row q_start of the flat batch."""
    q_start: int
    start: int
    end: int
    block_table: list[int]


@dataclasses.dataclass
class PrefillGroup:
    """Prefill chunks attended together by one SDPA call, padded to the longest.

    Queries are gathered from the step's flat batch; keys and values from the
    cache (which already holds this step's K/V), so a chunk sees the context
    cached before it (chunked prefill, prefix-cache hits) and its own tokens.
    """
    q_gather: torch.Tensor  # [N * Lq] flat token rows of the padded queries (padding repeats a real row)
    kv_rows: torch.Tensor   # [N * KVH * Lk] rows of the cache seen as [slots * KVH, d], head-major
    valid: torch.Tensor | None  # [n] rows of the padded [N * Lq] queries that are real tokens
    out_rows: torch.Tensor  # [n] flat token rows those outputs go to
    bias: torch.Tensor | None  # [N, 1, Lq, Lk] additive mask; None = plain causal (one chunk, nothing cached)
    num: int
    q_len: int              # Lq
    kv_len: int             # Lk


@dataclasses.dataclass
class TorchDecodeMetadata:
    rows: torch.Tensor   # [D * KVH * L] rows of the cache seen as [slots * KVH, d], each decode's padded context
    bias: torch.Tensor   # [D, 1, 1, L] float32 additive mask, 0 = attend
    length: int          # L


@dataclasses.dataclass
class KernelDecodeMetadata:
    block_tables: torch.Tensor   # [D, max blocks] int64, padded with block 0
    context_lens: torch.Tensor   # [D] int64
    window: int = 0              # the sliding window the kernel applies (0: none)


@dataclasses.dataclass
class AttentionMetadata:
    """What the attention of every layer of one KV cache group (kv_layout.py) needs for one
    step, built once per group by the backend."""
    slot_mapping: torch.Tensor   # [T] where each new token's K/V is written
    positions: torch.Tensor      # [T] int64
    num_decodes: int
    decode: TorchDecodeMetadata | KernelDecodeMetadata | None
    prefill_groups: list[PrefillGroup]
    # cache slots copied (src, dst) after the step's K/V is written, before attention reads
    # (partial prefix-cache hits; a source block may be filled by this very step)
    copy_slots: tuple[torch.Tensor, torch.Tensor] | None = None
    window: int | None = None  # each token attends its last `window` positions (itself included)


def copy_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor]) -> None:
    """K/V of cache slots src copied to slots dst (one layer)."""
    src, dst = slots
    k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
    v_cache.index_copy_(0, dst, v_cache.index_select(0, src))


class TorchAttention:
    """Attention in torch ops, on any device (see the module doc)."""

    name = "torch"

    def __init__(self, block_size: int, num_kv_heads: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.dtype = dtype
        self.device = device
        self._arange_bs = torch.arange(block_size, device=device)
        self._arange_kvh = torch.arange(num_kv_heads, device=device).view(1, -1, 1)

    # -- metadata, once per step -------------------------------------------------
    def build_metadata(self, slot_mapping: torch.Tensor, positions: torch.Tensor,
                       decodes: list[DecodeEntry], chunks: list[PrefillChunk],
                       window: int | None = None) -> AttentionMetadata:
        """window: the group's sliding window (None: full attention)."""
        return AttentionMetadata(slot_mapping, positions, len(decodes),
                                 self._decode_metadata(decodes, window) if decodes else None,
                                 self._group_prefills(chunks, window), window=window)

    def _decode_metadata(self, decodes: list[DecodeEntry], window: int | None):
        bs, dev = self.block_size, self.device
        max_blocks = -(-max(d.context_len for d in decodes) // bs)
        L = max_blocks * bs
        rows = self._table_rows([d.block_table for d in decodes], max_blocks)
        lens = torch.tensor([d.context_len for d in decodes], device=dev)
        ar = torch.arange(L, device=dev).unsqueeze(0)
        valid = ar < lens.unsqueeze(1)
        if window:
            valid &= ar >= lens.unsqueeze(1) - window
        return TorchDecodeMetadata(rows, self._bias(valid, torch.float32).view(len(decodes), 1, 1, L), L)

    def _bias(self, valid: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """bool mask (True = attend) -> additive mask (default: the model's dtype)."""
        dtype = dtype or self.dtype
        zero = torch.zeros((), dtype=dtype, device=self.device)
        return torch.where(valid, zero, torch.full((), float("-inf"), dtype=dtype, device=self.device))

    def _table_rows(self, tables: list[list[int]], num_blocks: int) -> torch.Tensor:
        """Cache rows ([slots * KVH, d] view), head-major, of the first num_blocks blocks of each
        table (short tables padded with block 0, masked by the caller) -> [N * KVH * L]. Blocks a
        sliding window let go (FREED_BLOCK) read block 0 too: the mask hides them."""
        bs = self.block_size
        rows = [t[:num_blocks] + [0] * (num_blocks - len(t)) if len(t) < num_blocks else t[:num_blocks]
                for t in tables]
        tab = torch.tensor(rows, dtype=torch.long, device=self.device).clamp_(min=0)
        slots = (tab.unsqueeze(2) * bs + self._arange_bs).view(len(tables), 1, num_blocks * bs)
        return (slots * self.num_kv_heads + self._arange_kvh).view(-1)

    def _group_prefills(self, chunks: list[PrefillChunk], window: int | None) -> list[PrefillGroup]:
        """Pad prefill chunks of similar context length into groups attended by one SDPA call.

        Chunks are sorted by context length and a group grows while padding stays
        under about a quarter of its keys.
        """
        if not chunks:
            return []
        bs = self.block_size
        groups: list[list[PrefillChunk]] = []
        cur: list[PrefillChunk] = []
        total = 0
        for c in sorted(chunks, key=lambda c: c.end):
            if cur and (len(cur) + 1) * c.end > 1.25 * (total + c.end) + 2 * bs:
                groups.append(cur)
                cur, total = [], 0
            cur.append(c)
            total += c.end
        groups.append(cur)
        return [self._prefill_group_metadata(grp, window) for grp in groups]

    def _prefill_group_metadata(self, grp: list[PrefillChunk], window: int | None) -> PrefillGroup:
        dev, bs = self.device, self.block_size
        N = len(grp)
        q_lens = [c.end - c.start for c in grp]
        Lq = max(q_lens)
        num_blocks = -(-max(c.end for c in grp) // bs)
        Lk = num_blocks * bs
        kv_rows = self._table_rows([c.block_table for c in grp], num_blocks)
        if N == 1 and grp[0].start == 0 and (not window or grp[0].end <= window):
            # one chunk, nothing cached before it, no window to apply: plain causal
            q0, end = grp[0].q_start, grp[0].end
            rows = torch.arange(q0, q0 + end, device=dev)
            kv_rows = kv_rows.view(self.num_kv_heads, Lk)[:, :end].reshape(-1)
            return PrefillGroup(rows, kv_rows, None, rows, None, 1, end, end)
        q_starts = torch.tensor([c.q_start for c in grp], device=dev).unsqueeze(1)
        starts = torch.tensor([c.start for c in grp], device=dev).view(N, 1, 1)
        ends = torch.tensor([c.end for c in grp], device=dev).view(N, 1, 1)
        lens = torch.tensor(q_lens, device=dev).unsqueeze(1)
        ar = torch.arange(Lq, device=dev).unsqueeze(0)
        q_gather = (q_starts + torch.minimum(ar, lens - 1)).view(-1)
        in_chunk = ar < lens                                                  # [N, Lq]
        valid = torch.arange(N * Lq, device=dev).view(N, Lq)[in_chunk]
        out_rows = (q_starts + ar)[in_chunk]
        kpos = torch.arange(Lk, device=dev).view(1, 1, Lk)
        qpos = starts + torch.arange(Lq, device=dev).view(1, Lq, 1)         # [N, Lq, 1]
        allowed = (kpos <= qpos) & (kpos < ends)                             # [N, Lq, Lk]
        if window:
            allowed &= kpos > qpos - window
        return PrefillGroup(q_gather, kv_rows, valid, out_rows, self._bias(allowed).unsqueeze(1), N, Lq, Lk)

    # -- per layer ----------------------------------------------------------------
    def rotary_tables(self, rotary, dtype: torch.dtype, positions: torch.Tensor):
        """cos and sign-folded sin for this step's positions ([T, 1, dim])."""
        return rotary(positions, dtype)

    def rope_and_cache(self, layer: "PagedAttention", qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Rotary on q and k, k and v written to the cache; returns q [T, H, d]."""
        T = qkv.shape[0]
        H, KVH, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        qk, v = qkv.split([(H + KVH) * d, KVH * d], dim=-1)
        # rotate q and k together: one set of elementwise ops for both
        qk = apply_rotary_signed(qk.view(T, H + KVH, d), cos, sin)
        k_cache.index_copy_(0, meta.slot_mapping, qk[:, H:])
        v_cache.index_copy_(0, meta.slot_mapping, v.view(T, KVH, d))
        if meta.copy_slots is not None:
            copy_slots(k_cache, v_cache, meta.copy_slots)
        return qk[:, :H]

    def forward(self, layer: "PagedAttention", q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D] (the cache already holds this step's K/V) -> [T, H * D]."""
        T = q.shape[0]
        width = layer.num_heads * layer.head_dim
        nd = meta.num_decodes
        if nd == T:  # decode-only step: no output assembly
            return self._decode(layer, q, k_cache, v_cache, meta.decode).view(T, width)
        out = torch.empty(T, layer.num_heads, layer.head_dim, dtype=q.dtype, device=q.device)
        if nd:
            out[:nd] = self._decode(layer, q[:nd], k_cache, v_cache, meta.decode)
        for grp in meta.prefill_groups:
            out[grp.out_rows] = self._prefill_group(layer, q, k_cache, v_cache, grp)
        return out.view(T, width)

    def _decode(self, layer, q, k_cache, v_cache, dm: TorchDecodeMetadata) -> torch.Tensor:
        nd = q.shape[0]
        kvh, g, d, L = layer.num_kv_heads, layer.group, layer.head_dim, dm.length
        # gather straight into [D, KVH, L, d] (contiguous) from the cache seen as [slots * KVH, d]
        kc = k_cache.view(-1, d).index_select(0, dm.rows).view(nd, kvh, L, d)
        vc = v_cache.view(-1, d).index_select(0, dm.rows).view(nd, kvh, L, d)
        # the query heads of one KV head share its keys: fold them into the query length
        qg = q.reshape(nd, kvh, g, d)
        # one query row per head: plain batched matmuls beat the flash kernel here
        # scores in float32 (bf16 scores lose too much); probabilities back in the cache dtype
        scores = torch.matmul(qg.float(), kc.float().transpose(-1, -2))   # [D, KVH, g, L]
        scores.mul_(layer.scale).add_(dm.bias)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, vc).reshape(nd, layer.num_heads, d)

    def _prefill_group(self, layer, q, k_cache, v_cache, grp: PrefillGroup) -> torch.Tensor:
        n, Lq, Lk, d = grp.num, grp.q_len, grp.kv_len, layer.head_dim
        qp = q.index_select(0, grp.q_gather).view(n, Lq, layer.num_heads, d).transpose(1, 2)
        kp = k_cache.view(-1, d).index_select(0, grp.kv_rows).view(n, layer.num_kv_heads, Lk, d)
        vp = v_cache.view(-1, d).index_select(0, grp.kv_rows).view(n, layer.num_kv_heads, Lk, d)
        gqa = layer.group > 1
        if grp.bias is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=layer.scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=grp.bias, scale=layer.scale, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(n * Lq, layer.num_heads, d)
        return o if grp.valid is None else o.index_select(0, grp.valid)


class CpuKernelAttention(TorchAttention):
    """Attention (decodes and prefill chunks alike) and the rotary + K/V write in tessera's fused CPU kernels."""

    name = "cpu_kernels"

    def __init__(self, kernels, block_size: int, num_kv_heads: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(block_size, num_kv_heads, dtype, device)
        self.kernels = kernels

    def build_metadata(self, slot_mapping: torch.Tensor, positions: torch.Tensor,
                       decodes: list[DecodeEntry], chunks: list[PrefillChunk],
                       window: int | None = None) -> AttentionMetadata:
        """Every token of the step, prefill chunks' too, attends as a decode of its own position.

        The decode kernel reads each query row's context straight from the cache blocks, so a
        chunk needs no padding, no mask and no gather, which measured faster than the padded
        SDPA groups for short chunks and for one long causal prompt alike. The chunks follow
        the decodes in the flat batch, in order (the model runner lays the batch out so).
        """
        bs = self.block_size
        # With a sliding window, each table starts at the block of the first position any of its
        # rows attends (the blocks before it may be freed) and positions count from there; the
        # kernel applies the window itself.
        firsts = ([self._first_block(d.context_len, window) for d in decodes]
                  + [self._first_block(c.start + 1, window) for c in chunks])
        ends = [-(-d.context_len // bs) for d in decodes] + [-(-c.end // bs) for c in chunks]
        tables = [e.block_table[f:n] for e, f, n in zip(decodes + chunks, firsts, ends)]
        max_blocks = max(map(len, tables))
        table_rows = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        lens = torch.tensor([d.context_len - f * bs for d, f in zip(decodes, firsts)], dtype=torch.long)
        if chunks:  # one row per chunk token: its chunk's table, and its own position + 1
            repeats = torch.tensor([1] * len(decodes) + [c.end - c.start for c in chunks], dtype=torch.long)
            table_rows = table_rows.repeat_interleave(repeats, dim=0)
            lens = torch.cat([lens] + [torch.arange(c.start + 1 - f * bs, c.end + 1 - f * bs, dtype=torch.long)
                                       for c, f in zip(chunks, firsts[len(decodes):])])
        return AttentionMetadata(slot_mapping, positions, lens.numel(),
                                 KernelDecodeMetadata(table_rows, lens, window or 0), [], window=window)

    def _first_block(self, context_len: int, window: int | None) -> int:
        """The block holding the first position a row with this context length attends."""
        return max(0, context_len - window) // self.block_size if window else 0

    def rotary_tables(self, rotary, dtype: torch.dtype, positions: torch.Tensor):
        """The whole tables: the fused kernel indexes them by position itself."""
        return rotary.tables(dtype)

    def rope_and_cache(self, layer, qkv, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        self.kernels.rope_and_cache_(qkv, meta.positions, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                     layer.num_heads, layer.num_kv_heads, layer.head_dim)
        if meta.copy_slots is not None:
            copy_slots(k_cache, v_cache, meta.copy_slots)
        return qkv[:, :layer.num_heads * layer.head_dim].view(qkv.shape[0], layer.num_heads, layer.head_dim)

    def _decode(self, layer, q, k_cache, v_cache, dm: KernelDecodeMetadata) -> torch.Tensor:
        return self.kernels.decode_attention(q, k_cache, v_cache, dm.block_tables, dm.context_lens,
                                             layer.scale, self.block_size, dm.window)


class PagedAttention:
    """One layer's attention geometry; the work is the backend's (set once by the model runner)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
