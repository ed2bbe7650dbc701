"""The Llama family (Llama, Qwen2, Mistral, SmolLM) in plain torch, over a paged KV cache.

RMSNorm, rotary embeddings (any rope scaling transformers supports, computed by
its own init functions), grouped-query attention, SwiGLU MLP, optional QKV bias
(Qwen2) and tied embeddings. Q, K and V share one matmul, as do gate and up.
"""
from __future__ import annotations

import os

import torch
from torch import nn
import torch.nn.functional as F

from tessera_engine.attention import AttentionMetadata, PagedAttention


def _packed_linear_available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and os.environ.get("TESSERA_PACKED_LINEAR", "1") != "0"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


_LINEAR = torch.ops.mkldnn._linear_pointwise.default if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None


class PackedWeight:
    """A bf16 CPU weight reordered once into oneDNN's blocked layout.

    F.linear on CPU bf16 goes through oneDNN too but reorders the weight on every
    call; prepacking it gives the same results, faster (same idea as inductor's
    weight prepacking). Repacked when the weight changes (its storage or version
    counter). Set TESSERA_PACKED_LINEAR=0 to turn it off. The per-call path is
    kept to a few attribute checks: at batch 1 a step makes ~120 of these calls.
    """

    def __init__(self) -> None:
        self.packed = None
        self.ptr = 0
        self.version = -1

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (self.packed is not None and weight._version == self.version and x.dtype == weight.dtype
                and weight.data_ptr() == self.ptr):
            if x.dim() == 2:
                return _LINEAR(x if x.is_contiguous() else x.contiguous(), self.packed, bias, "none", [], "")
            shape = x.shape
            out = _LINEAR(x.reshape(-1, shape[-1]).contiguous(), self.packed, bias, "none", [], "")
            return out.view(*shape[:-1], out.shape[-1])
        if x.dtype != weight.dtype or not _packed_linear_available(weight):
            return F.linear(x, weight, bias)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
        self.ptr, self.version = weight.data_ptr(), weight._version
        return self.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose bf16 CPU matmul runs on a prepacked weight (see PackedWeight), and
    for a single row (one sequence decoding) on the fused kernels' GEMV when set
    (`gemv`, by the model runner): a memory-bound pass over the weight."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pw = PackedWeight()
        self.gemv = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.shape[0] == 1 and x.dim() == 2 and x.dtype == self.weight.dtype:
            return self.gemv(x if x.is_contiguous() else x.contiguous(), self.weight, self.bias)
        return self._pw.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm as HF computes it; with `residual`, adds x to it first (vLLM's fused form).

    On CPU the fused kernels (tessera_engine.cpu_kernels) do either in one pass,
    rounding where the torch ops round; `kernels` is set by the model runner.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, with residual: (norm(residual + x), residual + x), the sum kept in residual."""
        k = self.kernels if x.dtype == self.weight.dtype else None
        if residual is None:
            return k.rms_norm(x, self.weight, self.eps) if k is not None else self._norm(x)
        if k is not None:
            return k.add_rms_norm_(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self._norm(residual), residual


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions (HF's rotate-half layout)."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            dim = int(dim * rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

        half = emb.shape[-1] // 2
        sign = torch.cat((-torch.ones(half), torch.ones(emb.shape[-1] - half)))
        self.register_buffer("sin_signed", self.sin * sign, persistent=False)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for every position ([max_positions, dim]) in dtype."""
        if self.cos.dtype != dtype:
            return self.cos.to(dtype), self.sin_signed.to(dtype)
        return self.cos, self.sin_signed

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ([T, 1, dim]) for apply_rotary_signed."""
        return (self.cos[positions].to(dtype).unsqueeze(1),
                self.sin_signed[positions].to(dtype).unsqueeze(1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def apply_rotary_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """apply_rotary with the sign of rotate-half folded into sin ([-sin, sin] halves).

    rotate_half(x) * sin == roll(x, half) * sin_signed exactly (negation is exact),
    in four ops instead of six.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class LlamaAttention(nn.Module):
    def __init__(self, config, block_size: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size,
                                bias=bool(getattr(config, "attention_bias", False)))
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, block_size)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if meta.kernels is not None:
            # fused CPU kernel: rotary on q and k in place, k and v written to the cache;
            # cos / sin are the whole tables, indexed by meta.positions
            meta.kernels.rope_and_cache_(qkv, meta.positions, cos, sin, kv_cache[0], kv_cache[1],
                                         meta.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)
            q = qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim)
            return self.o_proj(self.attn.forward(q, None, None, kv_cache[0], kv_cache[1], meta))
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # rotate q and k together: one set of elementwise ops for both
        qk = apply_rotary_signed(qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        o = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, config.hidden_size, bias=False)

    def forward(self, x, kernels=None):
        gate_up = self.gate_up_proj(x)
        if kernels is not None:
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, block_size: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, block_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """x: the previous layer's MLP output (or the embeddings, residual None) -> (this
        layer's MLP output, the residual stream before it); HF's two residual adds, fused
        into the norms that follow them."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, meta.kernels), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, block_size: int, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, block_size)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, max_positions)
        self._tied_pw = PackedWeight()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Flat batch of T tokens → final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        if meta.kernels is not None:  # the fused rotary kernel indexes the tables itself
            cos, sin = self.rotary.tables(x.dtype)
        else:
            cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv, meta)
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)

    def use_kernels(self, kernels) -> None:
        """Fused CPU kernels for the norms and single-row bf16 linears (None: torch ops)."""
        gemv = getattr(kernels, "gemv_bf16", None)  # built only where the CPU has AVX512-BF16
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.kernels = kernels
            elif isinstance(m, Linear):
                m.gemv = gemv if m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu" else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return self._tied_pw.linear(hidden, self.embed_tokens.weight, None)

    # -- weights -----------------------------------------------------------------
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights named as in HF transformers' LlamaForCausalLM, fusing QKV and gate/up."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor, rows: slice | None = None) -> None:
            p = params[name]
            with torch.no_grad():
                (p if rows is None else p[rows]).copy_(tensor.to(p.dtype))
            loaded.add(name)

        for hf_name, tensor in state.items():
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight":
                if self.lm_head is not None:
                    put("lm_head.weight", tensor)
                continue
            parts = name.split(".")
            if parts[0] == "layers":
                attn = self.layers[int(parts[1])].self_attn
                q, kv = attn.q_size, attn.kv_size
                which, kind = parts[3], parts[-1]
                prefix = f"layers.{parts[1]}."
                rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
                if which in rows:
                    put(f"{prefix}self_attn.qkv_proj.{kind}", tensor, rows[which])
                    continue
                inter = self.layers[0].mlp.inter
                if which == "gate_proj":
                    put(f"{prefix}mlp.gate_up_proj.weight", tensor, slice(0, inter))
                    continue
                if which == "up_proj":
                    put(f"{prefix}mlp.gate_up_proj.weight", tensor, slice(inter, 2 * inter))
                    continue
            if name not in params:
                raise KeyError(f"unexpected weight {hf_name!r}")
            put(name, tensor)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
