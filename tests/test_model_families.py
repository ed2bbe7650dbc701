"""Each Llama-family architecture the loader accepts, built here as a tiny random HF model,
saved as safetensors, loaded by the engine's loader (the path a user's HF directory takes)
and checked against HF transformers' greedy generate token for token in fp32. Mistral runs
within its sliding window (the loader caps the context there)."""
from __future__ import annotations

import pytest
import torch

from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.models.loader import load_model
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

# initializer_range well above HF's 0.02, so that random weights give varied, position-
# sensitive outputs rather than one token repeated
COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              initializer_range=0.25)


def build(family: str):
    import transformers as tf

    if family == "llama":  # untied lm_head, Llama 3 rope scaling
        # a short original context, so that the scaled (long-wavelength) frequencies turn
        # within these prompts' positions
        cfg = tf.LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=10000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
        return tf.LlamaForCausalLM(cfg)
    if family == "qwen2":  # QKV bias, tied embeddings
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, tie_word_embeddings=True))
    if family == "qwen3":  # per-head q/k RMSNorm, head_dim set apart from hidden / heads
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True))
    if family == "mistral":  # a sliding window longer than these prompts + outputs
        return tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=64))
    raise ValueError(family)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_family_matches_hf_greedy_through_the_safetensors_loader(family, tmp_path):
    torch.manual_seed(11)
    hf = build(family).eval()
    if family == "qwen2":  # HF initializes biases to zero: give them values so they are tested
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if family == "qwen3":  # HF initializes the norms to ones: make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path), None, torch.float32, torch.device("cpu"))
    core = EngineCore(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64), loaded=loaded)
    prompts = [[3, 17, 42, 99, 5], [7] * 21, list(range(10, 40))]
    out = core.generate([EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12,
                                                                      ignore_eos=True))
                         for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long), pad_token_id=0)
        assert out[(f"r{i}", 0)] == ref[0, len(p):].tolist(), f"{family}, prompt {i}"


def test_a_family_the_engine_cannot_run_is_refused_naming_it_and_those_it_can(tmp_path):
    import transformers as tf

    tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)).save_pretrained(
        tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match=r"'gpt2' not supported \(supported: \['llama', 'mistral', 'qwen2', 'qwen3'\]\)"):
        load_model(str(tmp_path), None, torch.float32, torch.device("cpu"))
