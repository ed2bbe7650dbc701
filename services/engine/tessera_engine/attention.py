"""Paged attention over the flat KV cache, behind one small interface.

The cache of a layer is two tensors [num_blocks * block_size, num_kv_heads,
head_dim]; token t of a request lives in slot block_table[t // bs] * bs + t % bs.
A step's tokens are flattened: the first `num_decodes` are single-token decodes
(batched into one SDPA call with a padding mask), the rest are prefill chunks
(one SDPA call each, causal over the cached context plus the chunk).
torch's scaled_dot_product_attention picks the kernel: its CPU flash kernel on
CPU, flash / memory-efficient kernels on CUDA.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class PrefillChunk:
    q_start: int            # offset of the chunk in the flat token batch
    q_len: int
    start_pos: int          # tokens of this request already in the cache before the chunk
    ctx_slots: torch.Tensor | None  # slots of all start_pos + q_len tokens; None when start_pos == 0
    mask: torch.Tensor | None       # [q_len, ctx] bool (True = attend); None when start_pos == 0


@dataclasses.dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] where each new token's K/V is written
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks]
    decode_mask: torch.Tensor | None          # [D, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]


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
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty(T, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for p in meta.prefills:
            sl = slice(p.q_start, p.q_start + p.q_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], k_cache, v_cache, p)
        return out.view(T, self.num_heads * self.head_dim)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        nd = q.shape[0]
        kvh, g, d, bs = self.num_kv_heads, self.group, self.head_dim, self.block_size
        tables = meta.decode_block_tables
        # [D, max_blocks, bs, KVH, d] -> [D, KVH, L, d]
        kc = k_cache.view(-1, bs, kvh, d)[tables].view(nd, -1, kvh, d).transpose(1, 2)
        vc = v_cache.view(-1, bs, kvh, d)[tables].view(nd, -1, kvh, d).transpose(1, 2)
        # the query heads of one KV head share its keys: fold them into the query length
        qg = q.view(nd, kvh, g, d)
        o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=meta.decode_mask, scale=self.scale)
        return o.reshape(nd, self.num_heads, d)

    def _prefill(self, q, k, v, k_cache, v_cache, p: PrefillChunk) -> torch.Tensor:
        g = self.group
        if p.ctx_slots is None:
            keys, values = k, v
        else:
            keys, values = k_cache[p.ctx_slots], v_cache[p.ctx_slots]
        # [L, KVH, d] -> [H, L, d]
        keys = keys.transpose(0, 1).repeat_interleave(g, dim=0)
        values = values.transpose(0, 1).repeat_interleave(g, dim=0)
        qh = q.transpose(0, 1)
        if p.mask is None:
            o = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=p.mask, scale=self.scale)
        return o.transpose(0, 1)
