"""Paged attention over the flat KV cache, behind one small interface.

The cache of a layer is two tensors [num_blocks * block_size, num_kv_heads,
head_dim]; token t of a request lives in slot block_table[t // bs] * bs + t % bs.
A step's tokens are flattened: the first `num_decodes` are single-token decodes,
the rest are prefill chunks.

Everything that depends only on the step (not on the layer) is built once per
step by the model runner and shared by all layers through AttentionMetadata:

- decodes, on CPU with the fused kernels (tessera_engine.cpu_kernels): the block
  tables and context lengths; the kernel reads K/V from the cache blocks in
  place, float32 scores and softmax, one pass per (request, KV head).
- decodes otherwise: the cache rows of every request's padded context, head-major
  ([D * KVH * L], L = the longest context rounded up to whole blocks) and an
  additive mask [D, 1, 1, L] (0 = attend, -inf = padding). Per layer, K/V are
  gathered with one index_select each straight into [D, KVH, L, d], and the
  query heads that share a KV head are folded into the query length; with one
  query row per head, two batched matmuls and a float32 softmax are several
  times faster on CPU than SDPA's flash kernel.
- prefill chunks are padded into groups of similar context length and attended
  with one SDPA call per group: queries gathered from the flat batch, keys and
  values gathered from the cache (already holding this step's K/V) straight
  into [N, KVH, Lk, d], with a causal + length mask; so a chunk that continues
  a request (chunked prefill, prefix-cache hit) sees its cached context.
GQA is handled by SDPA's enable_gqa. torch's scaled_dot_product_attention picks
the kernel: its CPU flash kernel on CPU, flash / memory-efficient on CUDA.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class PrefillGroup:
    """Prefill chunks attended together by one SDPA call, padded to the longest.

    Queries are gathered from the step's flat batch; keys and values from the
    cache (which already holds this step's K/V), so a chunk sees the context
    cached before it (chunked prefill, prefix-cache hits) and its own tokens.
    """
    q_gather: torch.Tensor  # [N * Lq] flat token rows of the padded queries (padding repeats a real row)
    kv_rows: torch.Tensor   # [N * KVH * Lk] rows of the cache seen as [slots * KVH, d], head-major
    valid: torch.Tensor     # [n] rows of the padded [N * Lq] queries that are real tokens
    out_rows: torch.Tensor  # [n] flat token rows those outputs go to
    bias: torch.Tensor | None  # [N, 1, Lq, Lk] additive mask; None = plain causal (one chunk, nothing cached)
    num: int
    q_len: int              # Lq
    kv_len: int             # Lk


@dataclasses.dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] where each new token's K/V is written
    num_decodes: int
    # [D * KVH * L] rows of the cache seen as [slots * KVH, d]: each decode's padded context, head-major
    decode_rows: torch.Tensor | None = None
    decode_bias: torch.Tensor | None = None   # [D, 1, 1, L] float32 additive mask, 0 = attend
    decode_len: int = 0                       # L
    # fused CPU kernel path (decode_rows/decode_bias unused): [D, max blocks] int64, [D] int64
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    # fused CPU kernels (tessera_engine.cpu_kernels) for this step, or None: torch ops
    kernels: object | None = None
    positions: torch.Tensor | None = None     # [T] int64, for the fused rotary kernel
    prefill_groups: list[PrefillGroup] = dataclasses.field(default_factory=list)


class PagedAttention:
    """Writes the step's K/V into the cache and attends over each request's context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] → [T, H * D]."""
        T = q.shape[0]
        if k is not None:  # (None: the fused rotary kernel wrote them)
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)
        nd = meta.num_decodes
        if nd == T:  # decode-only step: no output assembly
            return self._decode(q, k_cache, v_cache, meta).view(T, self.num_heads * self.head_dim)
        out = torch.empty(T, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for grp in meta.prefill_groups:
            out[grp.out_rows] = self._prefill_group(q, k_cache, v_cache, grp)
        return out.view(T, self.num_heads * self.head_dim)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        nd = q.shape[0]
        if meta.decode_block_tables is not None:
            return meta.kernels.decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                 meta.decode_context_lens, self.scale, self.block_size)
        kvh, g, d, L = self.num_kv_heads, self.group, self.head_dim, meta.decode_len
        # gather straight into [D, KVH, L, d] (contiguous) from the cache seen as [slots * KVH, d]
        kc = k_cache.view(-1, d).index_select(0, meta.decode_rows).view(nd, kvh, L, d)
        vc = v_cache.view(-1, d).index_select(0, meta.decode_rows).view(nd, kvh, L, d)
        # the query heads of one KV head share its keys: fold them into the query length
        qg = q.reshape(nd, kvh, g, d)
        # one query row per head: plain batched matmuls beat the flash kernel here
        # scores in float32 (bf16 scores lose too much); probabilities back in the cache dtype
        scores = torch.matmul(qg.float(), kc.float().transpose(-1, -2))   # [D, KVH, g, L]
        scores.mul_(self.scale).add_(meta.decode_bias)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, vc).reshape(nd, self.num_heads, d)

    def _prefill_group(self, q, k_cache, v_cache, grp: PrefillGroup) -> torch.Tensor:
        n, Lq, Lk, d = grp.num, grp.q_len, grp.kv_len, self.head_dim
        qp = q.index_select(0, grp.q_gather).view(n, Lq, self.num_heads, d).transpose(1, 2)
        kp = k_cache.view(-1, d).index_select(0, grp.kv_rows).view(n, self.num_kv_heads, Lk, d)
        vp = v_cache.view(-1, d).index_select(0, grp.kv_rows).view(n, self.num_kv_heads, Lk, d)
        gqa = self.group > 1
        if grp.bias is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=grp.bias, scale=self.scale, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(n * Lq, self.num_heads, d)
        return o if grp.valid is None else o.index_select(0, grp.valid)
