"""GGUF K-quants (Q4_K, Q5_K, Q6_K: the types of llama.cpp's Q4_K_M / Q5_K_M files) end to end:
a tiny random Llama-family model with every dimension a multiple of the 256-weight
super-block, written by tests/helpers/gguf_tiny.py with its linear layers in Q4_K (or Q5_K) and its
embedding / untied lm_head in Q6_K, loaded by the engine (the K-quant tensors kept as the file
has them for the CPU kernels' qlinear / qembedding) and compared token for token with HF's
greedy generate on the model transformers loads from the same file, in fp32. The kernels
themselves against gguf-py's dequantization: tests/engine/test_quantized.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera_engine.models.loader import load_model

from helpers import gguf_tiny
from helpers.gguf_tiny import T
from helpers.model_families import NEW_TOKENS, PROMPTS, assert_quantized_path, engine_greedy, hf_from_gguf

pytestmark = [pytest.mark.unit, pytest.mark.slow]

KQ = {"Q6_K+Q4_K": gguf_tiny.mixed(T.Q6_K, T.Q4_K, output=T.Q6_K),   # as a Q4_K_M file
      "Q6_K+Q5_K": gguf_tiny.mixed(T.Q6_K, T.Q5_K, output=T.Q6_K)}   # as a Q5_K_M file


def tiny(family: str, seed: int = 11):
    """A tiny random model whose linear layers' input sizes (hidden 256, intermediate 512) are
    whole super-blocks; initializer_range above HF's 0.02 for varied outputs."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=160, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.1)
    if family == "llama":  # untied lm_head (Q6_K, through qlinear)
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=False)).eval()
    if family == "qwen2":  # tied: the Q6_K embedding is the lm_head too; QKV bias
        hf = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True)).eval()
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        return hf
    raise ValueError(family)


def hf_argmax_greedy(hf, prompts=PROMPTS) -> list[list[int]]:
    """HF's greedy tokens as the engine's ignore_eos requests make them: argmax of the full
    forward's last logits, NEW_TOKENS times, the EOS token (2, the config's default) taken like
    any other. (hf.generate with min_new_tokens masks EOS out, and this model's llama greedy
    path does pick it: at prompt 0's 7th token.)"""
    refs = []
    for p in prompts:
        seq = torch.tensor([p])
        with torch.inference_mode():
            for _ in range(NEW_TOKENS):
                seq = torch.cat([seq, hf(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        refs.append(seq[0, len(p):].tolist())
    return refs


@pytest.mark.parametrize("quant", list(KQ))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_kquant_gguf_matches_hf_greedy(family, quant, tmp_path):
    """Exact token equality, with the quantized kernels (keep_quantized, the default) and
    without (transformers' dequantized weights only): along HF's greedy paths the top two
    logits are at least 6.7e-3 apart (qwen2 Q5_K; llama Q4_K 7.2e-3, 1.2e-2 or more
    elsewhere), where the quantized matmul stays within ~1e-5 of the dense one."""
    source = tiny(family)
    types = KQ[quant]
    path = gguf_tiny.write_gguf(source, tmp_path / f"{family}-{quant}.gguf", types)
    reference = hf_from_gguf(path, source)
    # transformers reads back exactly what the writer stored (gguf-py's dequantization)
    stored = gguf_tiny.expected_state_dict(source, types)
    read_back = reference.state_dict()
    for name, w in stored.items():
        assert torch.equal(read_back[name], w), name
    want = hf_argmax_greedy(reference)
    embed_type, linear_type = quant.split("+")
    for keep in (True, False):
        loaded = load_model(str(path), None, torch.float32, torch.device("cpu"), keep_quantized=keep)
        got = engine_greedy(loaded)  # the engine attaches the kernels to the layers
        model = loaded.model
        assert_quantized_path(model.layers[0].mlp.down_proj, linear_type if keep else None)
        if keep:
            assert model.layers[1].self_attn.qkv_proj.qweight.type_name == linear_type
            if family == "llama":
                assert model.lm_head.qweight.type_name == embed_type
            else:
                assert model.embed_q.type_name == embed_type
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"{family}, {quant}, keep_quantized={keep}, prompt {i}"


def test_kquant_writer_round_trips_within_its_step():
    """quantize_kquant's blocks are valid and close: gguf-py's dequantization is within a
    quantization step of the weight, and zero sub-blocks stay exactly zero."""
    import gguf

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 512)) * 0.05).astype(np.float32)
    w[0], w[1], w[2, :256] = np.abs(w[0]), -np.abs(w[1]), 0
    for qtype, bytes_, tol in ((T.Q4_K, 144, 0.012), (T.Q5_K, 176, 0.006), (T.Q6_K, 210, 0.004)):
        raw = gguf_tiny.quantize_kquant(w, qtype)
        assert raw.dtype == np.uint8 and raw.shape == (8, 2 * bytes_)
        back = gguf.dequantize(raw, qtype).reshape(w.shape)
        assert np.isfinite(back).all() and np.abs(back - w).max() < tol, qtype.name
        assert (back[2, :256] == 0).all()
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf_tiny._stored("x.weight", np.zeros((4, 96), np.float32), T.Q4_K)
