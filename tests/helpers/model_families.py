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
    if family == "gemma3":
        return tf.Gemma3ForCausalLM(gemma3_config())
    raise ValueError(family)


def gemma3_config(**overrides):
    """A tiny Gemma 3 text config: seven layers in the released models' pattern (five sliding,
    a global one, a sliding one after it), a 16-token window that these prompts and outputs
    pass, one KV head (as the 270M and 1B models have), head_dim 16 with an attention scalar
    of its own (24), and two rotary bases: the local 10000 (the only one a GGUF file can
    carry: llama.cpp's constant) and a global 1e6 with a linear scaling. No EOS token: HF's
    generate runs every reference to its length (a random model picks Gemma's EOS id, 1, now
    and then; the engine's requests ignore EOS)."""
    import transformers as tf

    cfg = {**COMMON, "num_hidden_layers": 7, "num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 24,
           "sliding_window": 16,
           "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
           "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
           "tie_word_embeddings": True, "eos_token_id": None, **overrides}
    return tf.Gemma3TextConfig(**cfg)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
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
    if family == "gemma3":
        randomize_gemma_norms(hf)
    return hf


def randomize_gemma_norms(hf) -> None:
    """HF initializes Gemma's norm weights to zeros (scaling by 1 + 0): give every norm (the
    four of each layer, q/k, the final one) values, so that the 1 + w is tested. The branches'
    post-norms scale by 2..5, so that the layers outweigh the sqrt(hidden)-scaled embedding in
    the residual stream, and the final norm by -1..1 per dimension, which breaks the tied
    embedding's pull toward repeating the last token (random weights otherwise just echo it)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name == "model.norm.weight":
                p.uniform_(-2.0, 0.0)
            elif ".post_" in name and name.endswith("norm.weight"):
                p.uniform_(1.0, 4.0)
            elif name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)


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
    return [hf_greedy_ignoring_eos(hf, p, NEW_TOKENS) for p in prompts]


def hf_greedy_ignoring_eos(hf, prompt: list[int], n: int) -> list[int]:
    """HF generate's n greedy tokens with no stop token, as the engine's ignore_eos runs (HF's
    min_new_tokens would instead forbid the EOS token, which a random model may well pick)."""
    config = hf.generation_config
    eos, config.eos_token_id = config.eos_token_id, None
    try:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    finally:
        config.eos_token_id = eos
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def hf_from_gguf(path, source):
    """HF transformers' own model from the GGUF file: its GGUF reader dequantizes the tensors
    and undoes llama.cpp's q/k row order, so it sees exactly the weights our loader does.
    Transformers does not read {arch}.attention.key_length for Qwen3 (its config would keep
    the class default head_dim 128), so there the head size is the source model's; nor the
    Llama 3 rope scaling a llama file stores as rope_freqs, so there the rope parameters are.
    Gemma 3: see gemma3_as_llama_cpp_reads_it."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if source.config.model_type == "gemma3_text":
        gemma3_as_llama_cpp_reads_it(config, source.config)
    if source.config.model_type == "qwen3":
        config.head_dim = source.config.head_dim
    if source.config.model_type == "llama":
        config.rope_parameters = dict(source.config.rope_parameters)
    return tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                   dtype=torch.float32).eval()


def gemma3_as_llama_cpp_reads_it(config, source_config) -> None:
    """What transformers' reading of a gemma3 GGUF file misses, set as llama.cpp reads the file:
    the linear rope scaling of the global layers (rope.scaling.*, which transformers does not
    read for gemma3: the source model's rope parameters) and the attention scalar, which llama.cpp
    derives from the head size (transformers keeps its class default, 256; the source model's
    own 24 is not in the file)."""
    config.rope_parameters = {k: dict(v) for k, v in source_config.rope_parameters.items()}
    config.query_pre_attn_scalar = source_config.head_dim
