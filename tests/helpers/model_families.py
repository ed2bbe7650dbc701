"""Tiny random models of each family the engine runs (HF transformers builds them), the engine's
and HF's greedy tokens for a few prompts, and HF's model from a GGUF file (for tests/engine/
test_model_families.py and test_kquants.py)."""
from __future__ import annotations

import torch

from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
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


FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
PROMPTS = [[3, 17, 42, 99, 5], [7] * 21, list(range(10, 40))]
NEW_TOKENS = 12  # the longest prompt + these stay inside Mistral's 64-token window


def prepared(family: str, seed: int = 11):
    """build(family) in eval mode, with the parameters HF initializes to constants given values."""
    torch.manual_seed(seed)
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
    return hf


def engine_greedy(loaded, prompts=PROMPTS, **config) -> list[list[int]]:
    """EngineCore's greedy tokens for the prompts, batched (`config`: more EngineConfig fields).
    Layers with quantized blocks run the quantized matmul for every batch (batch-invariant)."""
    core = EngineCore(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, **config),
                      loaded=loaded)
    out = core.generate([EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                                      ignore_eos=True))
                         for i, p in enumerate(prompts)])
    return [out[(f"r{i}", 0)] for i in range(len(prompts))]


def assert_quantized_path(layer, type_name: str | None) -> None:
    """The linear layer keeps the file's weight in this quantized type and, where the CPU
    kernels are built, runs it through their qlinear; type_name None: dense weights only."""
    from tessera_engine import cpu_kernels

    if type_name is None:
        assert layer.qweight is None
        return
    assert layer.qweight is not None and layer.qweight.type_name == type_name
    if cpu_kernels.load() is not None:  # the kernels took the quantized weights
        assert layer.qlinear is not None


def hf_greedy(hf, prompts=PROMPTS) -> list[list[int]]:
    refs = []
    for p in prompts:
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              min_new_tokens=NEW_TOKENS, attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              pad_token_id=0)
        refs.append(ref[0, len(p):].tolist())
    return refs


def hf_from_gguf(path, source):
    """HF transformers' own model from the GGUF file: its GGUF reader dequantizes the tensors
    and undoes llama.cpp's q/k row order, so it sees exactly the weights our loader does.
    Transformers does not read {arch}.attention.key_length for Qwen3 (its config would keep
    the class default head_dim 128), so there the head size is the source model's; nor the
    Llama 3 rope scaling a llama file stores as rope_freqs, so there the rope parameters are."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if source.config.model_type == "qwen3":
        config.head_dim = source.config.head_dim
    if source.config.model_type == "llama":
        config.rope_parameters = dict(source.config.rope_parameters)
    return tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                   dtype=torch.float32).eval()
