"""Rotary position embeddings: cos/sin tables (any rope scaling transformers supports, computed
by its own init functions, or a GGUF file's per-frequency divisors) and their application in
HF's rotate-half layout."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions (HF's rotate-half layout).

    layer_type: for configs whose rope parameters are per attention type (Gemma 3's
    `rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}`: a local base
    for sliding-window layers, the global base and its scaling for full ones), the tables of
    that type, as transformers computes them for it."""

    def __init__(self, config, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if layer_type is not None:
            if layer_type not in rope:
                raise ValueError(f"{config.model_type}: no rope parameters for {layer_type!r} layers "
                                 f"(rope_parameters has {sorted(rope)})")
            rope = rope[layer_type]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            dim = int(dim * rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        else:
            per_type = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **per_type)
        factors = getattr(config, "rope_freq_factors", None)
        if factors is not None:  # a GGUF file's rope_freqs (Llama 3 scaling, as llama.cpp applies it)
            inv_freq = inv_freq.float() / torch.tensor(factors, dtype=torch.float32)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        # only the sign-folded sin is read: no plain copy kept (a table is [max_positions, dim])
        half = emb.shape[-1] // 2
        sign = torch.cat((-torch.ones(half), torch.ones(emb.shape[-1] - half)))
        self.register_buffer("sin_signed", (emb.sin() * scaling) * sign, persistent=False)

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
