"""Write a (tiny) HF transformers Llama-family model to a GGUF file with gguf-py, laid out as
llama.cpp's convert_hf_to_gguf.py lays out such a model, so that tests can load it through
the GGUF loaders (ours and transformers') without llama.cpp or a download.

What the file gets, per llama.cpp's conventions:
  - architecture: "llama" for Llama and Mistral (llama.cpp has no separate Mistral text
    architecture: a Mistral model is a llama file), "qwen2", "qwen3", "gemma3" (Gemma 3 text);
  - metadata: general.name / file_type / quantization_version, {arch}.vocab_size,
    context_length, embedding_length, block_count, feed_forward_length,
    attention.head_count(_kv), attention.layer_norm_rms_epsilon, rope.freq_base,
    rope.dimension_count (llama: the head size), attention.key_length / value_length (where
    the config sets a head size other than hidden / heads, as Qwen3 does; always for gemma3),
    gemma3's attention.sliding_window and its global layers' linear rope scaling
    (rope.scaling.type / factor), as convert_hf_to_gguf.py writes them (llama.cpp fixes the
    rest itself: every sixth layer global, the local rotary base 10000, the attention scale);
  - tensors: token_embd, blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm,
    ffn_gate, ffn_up, ffn_down}, blk.N.attn_{q,k,v}.bias (Qwen2), blk.N.attn_{q,k}_norm
    (Qwen3, Gemma 3), output_norm, and output only when lm_head is not tied to the embedding;
    gemma3's four norms a layer: attn_norm, post_attention_norm, ffn_norm (before the MLP) and
    post_ffw_norm, every norm stored as 1 + w (transformers' reader subtracts the 1 again);
  - for the llama architecture, the rows of attn_q / attn_k regrouped per head from HF's
    rotate-half order (first half of the rotary pairs, then the second) to the interleaved
    pair order llama.cpp's rope uses; transformers' GGUF reader (LlamaTensorProcessor)
    undoes exactly this, and only for files whose architecture is "llama";
  - Llama 3 rope scaling as llama.cpp stores it: a rope_freqs tensor of one divisor per
    rotary frequency (there is no GGUF metadata key for the llama3 rope type).

No tokenizer is written: neither loader needs one when {arch}.vocab_size is there.

Weights are stored in the type `types(gguf_name, array)` chooses; F32, F16, Q8_0 / Q4_0 /
Q4_1 quantized by gguf-py's reference quantizer (2-D tensors with rows a multiple of 32 only),
and the K-quants Q4_K / Q5_K / Q6_K (rows a multiple of 256), for which gguf-py has no
quantizer: quantize_kquant below makes valid super-blocks with a plain min/max scheme (not
llama.cpp's error-minimizing search; the readers only need valid blocks, and every reader
dequantizes them with gguf-py's reference).
"""
from __future__ import annotations

import math
import pathlib
from typing import Callable

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as T

KQUANTS = {T.Q4_K, T.Q5_K, T.Q6_K}
QUANTIZED = {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0} | KQUANTS
FILE_TYPES = {T.F32: gguf.LlamaFileType.ALL_F32, T.F16: gguf.LlamaFileType.MOSTLY_F16,
              T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, T.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
              T.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1, T.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
              T.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
              T.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_M, T.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K}
QK_K = 256
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}

TypeChooser = Callable[[str, np.ndarray], T]


def all_f32(name: str, array: np.ndarray) -> T:
    return T.F32


def quantizable(array: np.ndarray, qtype: T | None = None) -> bool:
    """A 2-D tensor whose rows are whole blocks of `qtype` (32 weights; K-quants 256; any
    block type when None)."""
    return array.ndim == 2 and array.shape[1] % (QK_K if qtype in KQUANTS else 32) == 0


def _f16(x: np.ndarray) -> np.ndarray:
    """float16 as stored, and its float32 value."""
    h = x.astype(np.float16)
    return h, h.astype(np.float32)


def quantize_kquant(w: np.ndarray, qtype: T) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> uint8 [rows, K / 256 * block bytes]: valid
    Q4_K / Q5_K / Q6_K super-blocks in llama.cpp's layout (that gguf-py's dequantize reads).
    Q4_K / Q5_K: per sub-block of 32, an offset (minus the minimum, or 0) and a step covering
    its range in 15 / 31 levels; both as 6-bit multiples of the super-block's float16 dmin / d.
    Q6_K: per sub-block of 16, a signed step (max |w| / 31) as an int8 multiple of d; quants
    -32..31 stored plus 32."""
    rows, k = w.shape
    assert k % QK_K == 0, f"{qtype.name} needs rows a multiple of {QK_K}"
    x = w.astype(np.float32).reshape(-1, QK_K)  # one super-block per row
    nb = x.shape[0]
    if qtype == T.Q6_K:
        sub = x.reshape(nb, 16, 16)
        step = np.abs(sub).max(axis=-1) / 31                     # [nb, 16]
        d16, d = _f16(np.abs(step).max(axis=-1, keepdims=True) / 127)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.where(d > 0, np.round(step / d), 0).clip(-127, 127).astype(np.int8)
            eff = (d * sc.astype(np.float32))[..., None]
            q = np.where(eff != 0, np.round(sub / eff), 0).clip(-32, 31).astype(np.int16) + 32
        q = q.reshape(nb, 2, 4, 32).astype(np.uint8)              # c, t, l: weight 128 c + 32 t + l
        lo, hi = q & 15, q >> 4
        ql = (lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)).reshape(nb, 128)  # ql[64 c + 32 (t & 1) + l] >> 4 (t / 2)
        qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(nb, 64)
        blocks = np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8)], axis=-1)
        return blocks.reshape(rows, -1)
    levels = 15 if qtype == T.Q4_K else 31
    sub = x.reshape(nb, 8, 32)
    offset = np.maximum(-sub.min(axis=-1), 0)                    # [nb, 8], w + offset >= 0
    step = (sub.max(axis=-1) + offset) / levels
    d16, d = _f16(step.max(axis=-1, keepdims=True) / 63)
    m16, dmin = _f16(offset.max(axis=-1, keepdims=True) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.round(step / d), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin > 0, np.round(offset / dmin), 0).clip(0, 63).astype(np.uint8)
        eff_d = (d * sc.astype(np.float32))[..., None]
        eff_m = (dmin * mn.astype(np.float32))[..., None]
        q = np.where(eff_d > 0, np.round((sub + eff_m) / eff_d), 0).clip(0, levels).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=-1)
    lo = (q & 15).reshape(nb, 4, 2, 32)                          # sub-block 2 i + s: nibble s of qs[32 i ..]
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)
    parts = [d16.view(np.uint8), m16.view(np.uint8), scales]
    if qtype == T.Q5_K:                                          # bit j of qh[l]: sub-block j's fifth bit
        bits = (q >> 4).reshape(nb, 8, 32)
        parts.append(np.bitwise_or.reduce(bits << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    blocks = np.concatenate(parts + [qs], axis=-1)
    return blocks.reshape(rows, -1)


def mixed(embedding: T = T.Q8_0, linear: T = T.Q4_1, output: T | None = None) -> TypeChooser:
    """Like the default model's file: the token embedding in `embedding`, every linear layer's
    weight in `linear` (the untied lm_head in `output`, default `linear`); norms, biases,
    rope_freqs and anything a block quantizer cannot take stay F32."""
    def choose(name: str, array: np.ndarray) -> T:
        if not quantizable(array) or not name.endswith(".weight") or "norm" in name:
            return T.F32
        if name == "token_embd.weight":
            return embedding
        if name == "output.weight":
            return output or linear
        return linear
    return choose


def _rope_theta(cfg) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base is the file's
    return float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _rope_scaling(cfg) -> dict:
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope = rope.get("full_attention", rope)
    return rope if rope.get("rope_type", rope.get("type", "default")) != "default" else {}


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def llama3_rope_divisors(cfg) -> np.ndarray:
    """One divisor per rotary frequency (head_dim / 2 of them), which llama.cpp applies to the
    base frequencies: 1 for short wavelengths, `factor` for long ones, and a blend between
    the two over the band between the high- and low-frequency wavelengths."""
    rope = _rope_scaling(cfg)
    dim = _head_dim(cfg)
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    divisors = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi * _rope_theta(cfg) ** (i / dim)
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            blend = (original / wavelength - low) / (high - low)  # 0 at the long end, 1 at the short
            divisors.append(1.0 / ((1.0 - blend) / factor + blend))
    return np.array(divisors, dtype=np.float32)


def _to_llama_cpp_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Per head, HF keeps a projection's rows as [pair halves 0..d/2-1 | d/2..d-1]; llama.cpp
    wants row pairs (i, i + d/2) next to each other."""
    rows = w.shape[0]
    per_half = rows // heads // 2
    return (w.reshape(heads, 2, per_half, *w.shape[1:])  # head, which half, pair index
            .swapaxes(1, 2)                                # head, pair index, which half
            .reshape(w.shape))


def gguf_tensors(model) -> list[tuple[str, str | None, np.ndarray]]:
    """(GGUF name, HF parameter name or None, float32 array as the file holds it) for every
    tensor of the file, in llama.cpp's order."""
    cfg = model.config
    arch = ARCH[cfg.model_type]
    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    out = [("token_embd.weight", "model.embed_tokens.weight", state["model.embed_tokens.weight"])]
    if arch == "llama" and _rope_scaling(cfg).get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", None, llama3_rope_divisors(cfg)))
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    if arch == "gemma3":  # a norm after each branch too: the pre-MLP norm is ffn_norm there
        names.update({"post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"})
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        for hf, short in names.items():
            for kind in ("weight", "bias"):
                hf_name = f"model.layers.{i}.{hf}.{kind}"
                w = state.get(hf_name)
                if w is None:
                    continue
                if arch == "llama" and short in ("attn_q", "attn_k"):
                    w = _to_llama_cpp_rope_rows(w, heads if short == "attn_q" else kv_heads)
                out.append((f"blk.{i}.{short}.{kind}", hf_name, _as_stored(arch, short, w)))
    out.append(("output_norm.weight", "model.norm.weight",
                _as_stored(arch, "output_norm", state["model.norm.weight"])))
    if not getattr(cfg, "tie_word_embeddings", False):
        out.append(("output.weight", "lm_head.weight", state["lm_head.weight"]))
    return out


def _as_stored(arch: str, short: str, w: np.ndarray) -> np.ndarray:
    """Gemma's norms scale by 1 + w; llama.cpp stores the 1 + w (as convert_hf_to_gguf.py does)."""
    return w + np.float32(1) if arch == "gemma3" and short.endswith("norm") else w


def _as_read(arch: str, name: str, w: np.ndarray) -> np.ndarray:
    """What transformers' reader makes of a stored tensor: for Gemma, the norms less 1 again
    (in float32: not always bit for bit the w that was written)."""
    return w - np.float32(1) if arch == "gemma3" and name.endswith("norm.weight") else w


def _stored(name: str, w: np.ndarray, qtype: T) -> tuple[np.ndarray, T | None]:
    """(the array to write, its raw ggml type or None for a plain F32 / F16 array)."""
    if qtype in QUANTIZED:
        if not quantizable(w, qtype):
            raise ValueError(f"{name} {w.shape}: {qtype.name} needs a 2-D tensor with rows a multiple of "
                             f"{QK_K if qtype in KQUANTS else 32}")
        if qtype in KQUANTS:
            return quantize_kquant(np.ascontiguousarray(w), qtype), qtype
        return gguf.quants.quantize(np.ascontiguousarray(w), qtype), qtype
    if qtype == T.F16:
        return w.astype(np.float16), None
    if qtype == T.F32:
        return np.ascontiguousarray(w, dtype=np.float32), None
    raise ValueError(f"{name}: type {qtype.name} not supported here")


def expected_state_dict(model, types: TypeChooser = all_f32) -> dict[str, torch.Tensor]:
    """What a faithful reader of write_gguf(model, ..., types) gets back, by HF parameter name,
    in HF's row order: each weight as stored (F32 exactly; F16 rounded; quantized and then
    dequantized by gguf-py: a row permutation commutes with row-wise block quantization)."""
    state = model.state_dict()
    arch = ARCH[model.config.model_type]
    out = {}
    for name, hf_name, w in gguf_tensors(model):
        if hf_name is None:
            continue
        hf_w = _as_stored(arch, name.split(".")[-2], state[hf_name].detach().float().cpu().numpy())
        data, raw = _stored(name, hf_w, types(name, w))
        back = gguf.quants.dequantize(data, raw) if raw is not None else data.astype(np.float32)
        back = _as_read(arch, name, back)
        out[hf_name] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32).reshape(hf_w.shape))
    return out


def write_gguf(model, path: str | pathlib.Path, types: TypeChooser = all_f32, name: str | None = None) -> pathlib.Path:
    """Write `model` (an HF LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM /
    Qwen3ForCausalLM) to `path`; `name` is general.name (default: the model type, capitalized
    as a model card would have it, e.g. "Mistral", which transformers reads as a llama file)."""
    cfg = model.config
    arch = ARCH[cfg.model_type]
    tensors = [(tname, *_stored(tname, w, types(tname, w))) for tname, _, w in gguf_tensors(model)]
    # the file type names the linear layers' type, as llama.cpp's does (norms are always F32)
    main = next((types(n, w) for n, _, w in gguf_tensors(model) if ".ffn_down." in n), T.F32)

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or cfg.model_type.capitalize())
    writer.add_file_type(int(FILE_TYPES[main]))
    if main in QUANTIZED:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(_rope_theta(cfg))
    if arch == "llama":
        writer.add_rope_dimension_count(_head_dim(cfg))
    if arch == "gemma3":  # as convert_hf_to_gguf.py's Gemma3Model: the rest llama.cpp fixes itself
        writer.add_sliding_window(cfg.sliding_window)
        if _rope_scaling(cfg):
            assert _rope_scaling(cfg)["rope_type"] == "linear", "llama.cpp's gemma3 takes linear rope scaling only"
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(_rope_scaling(cfg)["factor"]))
    if arch == "gemma3" or _head_dim(cfg) != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(_head_dim(cfg))
        writer.add_value_length(_head_dim(cfg))
    for tname, data, raw_dtype in tensors:
        writer.add_tensor(tname, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
