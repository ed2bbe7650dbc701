"""Gemma 3's text model (HF `Gemma3ForCausalLM`, model_type "gemma3_text"; a GGUF file of
architecture "gemma3") in torch, over the paged KV cache, built on the Llama classes so that
everything the engine calls on a model (use_backend, the quantized paths, packing, LoRA,
compute_logits, the loaders) works unchanged.

What Gemma 3 does differently from Llama, each as HF transformers computes it:
  - RMSNorm scales by (1 + w): the weights are stored as HF has them (w, around 0), and 1 is
    added once at load, in float32, which is the number HF's norm multiplies by;
  - four norms a layer: input and post-attention around the attention, pre- and
    post-feedforward around the MLP, each branch's output normed before the residual add;
  - per-head q/k RMSNorm (also 1 + w) before the rotary embedding;
  - GeLU (tanh approximation) gating the MLP instead of SiLU;
  - the embeddings multiplied by sqrt(hidden), that scale rounded to the model's dtype first;
  - the attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
  - sliding-window and global layers (config.layer_types, 5 : 1 in the released models), each
    with its own rotary tables: the local base for sliding layers, the global base and its
    scaling for full ones (config.rope_parameters per layer type);
  - the lm_head tied to the embedding; final-logit soft-capping when the config sets it.
Attention-logit soft-capping (Gemma 2, attn_logit_softcapping) is not supported: the loader
refuses such a config.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tessera_engine.attention import AttentionMetadata, TorchAttention
from tessera_engine.models.llama import (Linear, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                         LlamaMLP, RMSNorm, RowSplit, attention_windows)
from tessera_engine.models.packed_linear import PackedWeight
from tessera_engine.models.quantized import QuantizedWeight
from tessera_engine.models.rotary import RotaryEmbedding
from tessera_engine.ops import QuantizedPath

SLIDING, FULL = "sliding_attention", "full_attention"


def unsupported(config) -> str | None:
    """What of this Gemma 3 config the engine cannot run (None: nothing)."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return (f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping}) "
                "is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention) is not supported"
    act = getattr(config, "hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_python_tanh"):
        return f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)"
    return None


class Gemma3Attention(LlamaAttention):
    """Llama's attention with per-head q/k norms (1 + w) and the scale query_pre_attn_scalar ** -0.5."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.qk_norm = True
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn.scale = config.query_pre_attn_scalar ** -0.5


class Gemma3MLP(LlamaMLP):
    def forward(self, x):
        return self._down(self.ops.gelu_tanh_and_mul(self._gate_up(x)))


class Gemma3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_type: str) -> None:
        nn.Module.__init__(self)
        eps = config.rms_norm_eps
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        # bound once, as LlamaDecoderLayer does
        self._steps = (self.input_layernorm.forward, self.self_attn.forward,
                       self.post_attention_layernorm.forward, self.pre_feedforward_layernorm.forward,
                       self.mlp.forward, self.post_feedforward_layernorm.forward)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """x: the previous layer's normed MLP output (or the scaled embeddings, residual None)
        -> (this layer's normed MLP output, the residual stream before it). HF adds each
        branch's normed output to the residual; that add is fused into the norm that follows."""
        norm_in, attn, norm_post_attn, norm_pre_ff, mlp, norm_post_ff = self._steps
        if residual is None:
            residual, h = x, norm_in(x)
        else:
            h, residual = norm_in(x, residual)
        h = norm_post_attn(attn(h, cos, sin, kv_cache, meta))
        h, residual = norm_pre_ff(h, residual)
        return norm_post_ff(mlp(h)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_stack_ok = False  # its own forward (embedding scale, per-kind rotary tables, 1 + w norms)

    def __init__(self, config, max_positions: int) -> None:
        problem = unsupported(config)
        if problem:
            raise ValueError(f"{config.model_type}: {problem}")
        nn.Module.__init__(self)
        self.config = config
        self.attention_windows = attention_windows(config)
        kinds = [SLIDING if w is not None else FULL for w in self.attention_windows]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # HF keeps sqrt(hidden) as a float32 tensor and rounds it to the weights' dtype
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32),
                             persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, k) for k in kinds)
        self._layer_steps = [layer.forward for layer in self.layers]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        # one rotary table per attention type the layers use (a model of one type has one)
        self.rotaries = nn.ModuleDict({k: RotaryEmbedding(config, max_positions, layer_type=k)
                                       for k in dict.fromkeys(kinds)})
        self._layer_kinds = kinds
        self._tied_pw = PackedWeight()
        self.embed_q: QuantizedWeight | None = None
        self.embed_qpath: QuantizedPath | None = None
        self.qembedding = None
        self.tied_qlinear = None
        self.tied_q_max_rows = 0
        self.attention: TorchAttention | None = None
        self.split = RowSplit()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                metas: list[AttentionMetadata], dense_from: int | None = None) -> torch.Tensor:
        """Flat batch of T tokens → final hidden states [T, hidden]. kv_caches, metas: each
        layer's cache tensors and its KV cache group's step metadata; dense_from: as Llama's."""
        self.split.dense_from = dense_from
        dtype = self.embed_tokens.weight.dtype
        x = (self.embed_tokens(input_ids) if self.qembedding is None else
             self.qembedding(input_ids, self.embed_q.data, self.embed_q.qtype, self.config.hidden_size, dtype))
        x = x * self.embed_scale.to(dtype)
        tables = {k: self.attention.rotary_tables(r, x.dtype, positions) for k, r in self.rotaries.items()}
        residual = None
        for layer, kind, kv, meta in zip(self._layer_steps, self._layer_kinds, kv_caches, metas):
            cos, sin = tables[kind]
            x, residual = layer(x, residual, cos, sin, kv, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:  # as HF: logits / cap, tanh, * cap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_hf_state_dict(self, state: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF Gemma3ForCausalLM's weights; every norm weight w stored as 1 + w (in float32, the
        value HF's norms multiply by)."""
        super().load_hf_state_dict((name, 1.0 + tensor.float() if name.endswith("norm.weight") else tensor)
                                   for name, tensor in state)
