"""Each architecture the loader accepts (the Llama family, Gemma 3), built here as a tiny random HF model,
saved as safetensors (the path a user's HF directory takes) and as GGUF files written as
llama.cpp would write them (tests/helpers/gguf_tiny.py: F32, and Q8_0 / Q4_1 / Q4_0 mixes), loaded by
the engine's loader and checked against HF transformers' greedy generate token for token in
fp32. Mistral's sliding window past its end: tests/engine/test_sliding_window.py; Gemma 3's
sliding and global layers past the window, chunked, preempted and cached, and the real
checkpoint: tests/engine/test_gemma3.py."""
from __future__ import annotations

import pytest
import torch

from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.models.llama import LlamaForCausalLM
from tessera_engine.models.loader import load_model
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

from helpers import gguf_tiny

from helpers.model_families import (COMMON, FAMILIES, NEW_TOKENS, PROMPTS, assert_quantized_path, build,  # noqa: F401
                                     engine_greedy, hf_from_gguf, hf_greedy, prepared)

pytestmark = [pytest.mark.unit, pytest.mark.slow]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf_greedy_through_the_safetensors_loader(family, tmp_path):
    hf = prepared(family)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path), None, torch.float32, torch.device("cpu"))
    want = hf_greedy(hf)
    for i, (got, ref) in enumerate(zip(engine_greedy(loaded), want)):
        assert got == ref, f"{family}, prompt {i}"
    # n-gram speculation (prompt 1 repeats one token: its guesses are taken) changes no token
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    for i, (got, ref) in enumerate(zip(engine_greedy(loaded, speculative_config=ngram), want)):
        assert got == ref, f"{family}, prompt {i}, speculating"
    # draft-model speculation: the model drafting for itself (every guess right), and another
    # random model of the same vocabulary (guesses mostly wrong): no token changes either way.
    # A draft mixing sliding and global layers (Gemma 3) is refused (draft_model.py): Gemma
    # takes the other model's guesses only.
    other = "llama" if family != "llama" else "qwen2"
    prepared(other, seed=12).save_pretrained(tmp_path / "draft", safe_serialization=True)
    for draft in (tmp_path, tmp_path / "draft")[1 if family == "gemma3" else 0:]:
        spec = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 3, "disable_by_batch_size": 8}}'
        for i, (got, ref) in enumerate(zip(engine_greedy(loaded, speculative_config=spec), want)):
            assert got == ref, f"{family}, prompt {i}, draft model {draft.name}"


def test_a_family_the_engine_cannot_run_is_refused_naming_it_and_those_it_can(tmp_path):
    import transformers as tf

    tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)).save_pretrained(
        tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match=r"'gpt2' not supported \(supported: \['gemma3_text', 'llama', 'mistral', "
                                         r"'qwen2', 'qwen3'\]\)"):
        load_model(str(tmp_path), None, torch.float32, torch.device("cpu"))


def test_families_that_come_close_are_refused_naming_what_they_lack(tmp_path):
    """Gemma 2 (attention logit soft-capping), a multimodal Gemma 3 checkpoint (its vision
    tower), and a Gemma 3 text config with attention soft-capping set: each refused with what
    the engine lacks, not just its type."""
    import transformers as tf

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    tf.Gemma2ForCausalLM(tf.Gemma2Config(**small)).save_pretrained(tmp_path / "gemma2", safe_serialization=True)
    with pytest.raises(ValueError, match=r"'gemma2' not supported: .*soft-capping \(attn_logit_softcapping\)"):
        load_model(str(tmp_path / "gemma2"), None, torch.float32, torch.device("cpu"))
    tf.Gemma3Config(text_config=small, vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                          num_attention_heads=2, image_size=28, patch_size=14)
                    ).save_pretrained(tmp_path / "gemma3-mm")
    with pytest.raises(ValueError, match=r"'gemma3' not supported: a multimodal Gemma 3 .*vision tower"):
        load_model(str(tmp_path / "gemma3-mm"), None, torch.float32, torch.device("cpu"))
    tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**small, attn_logit_softcapping=50.0)).save_pretrained(
        tmp_path / "capped", safe_serialization=True)
    with pytest.raises(ValueError, match=r"gemma3_text: attention logit soft-capping \(attn_logit_softcapping=50.0\)"):
        load_model(str(tmp_path / "capped"), None, torch.float32, torch.device("cpu"))


# -- the GGUF loader -----------------------------------------------------------------------

# GGUF weight layouts: every tensor F32; and two llama.cpp-style quantized mixes, the token
# embedding in Q8_0 and every linear layer (the untied lm_head too) in Q4_1 (as in the default
# model's file) or Q4_0; norms, biases and rope_freqs stay F32
GGUF_TYPES = {"F32": gguf_tiny.all_f32,
              "Q8_0+Q4_1": gguf_tiny.mixed(gguf_tiny.T.Q8_0, gguf_tiny.T.Q4_1),
              "Q8_0+Q4_0": gguf_tiny.mixed(gguf_tiny.T.Q8_0, gguf_tiny.T.Q4_0)}


@pytest.mark.parametrize("weights", list(GGUF_TYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf_greedy_through_the_gguf_loader(family, weights, tmp_path):
    """The model above written as llama.cpp would write it (tests/helpers/gguf_tiny.py), loaded by our
    loader with the quantized kernels (the default: Q4_0 / Q4_1 / Q8_0 tensors kept as the file
    has them for the CPU qlinear / qembedding) and without (keep_quantized=False: transformers'
    dequantized weights only), and checked token for token against HF's greedy generate on
    the model transformers loads from the same file, in fp32.

    The quantized path computes the same dequantized weights in another summation order, so a
    near-tie between two logits could in principle fork it. With the safetensors test's seed
    and prompts every case matched exactly at the first try, so the comparison is exact: along
    HF's greedy paths the top two logits are at least 2.2e-4 apart (qwen3 Q8_0+Q4_1; 8e-4 for
    qwen3 Q8_0+Q4_0, 5e-3 or more elsewhere), where the quantized matmul stays within ~1e-5
    of the dense one (test_quantized).

    What the GGUF route carries differently:
      - Llama 3 rope scaling: llama.cpp stores it as a rope_freqs tensor (no metadata key names
        the llama3 rope type), which transformers' GGUF reader ignores; our loader applies it.
        The HF reference gets the source model's rope parameters (see hf_from_gguf).
      - Mistral's sliding window: a Mistral model is a "llama" file for llama.cpp, with no
        sliding-window key, so it loads as a Llama (full attention); these prompts stay
        inside the source model's 64-token window, where the two are the same.
      - Qwen3's head size is read by our loader (key_length) but not by transformers: see
        hf_from_gguf.
      - Gemma 3: the file has no attention scalar (llama.cpp derives it from the head size, as
        our loader does; transformers keeps its default 256) and transformers does not read its
        global layers' linear rope scaling: the HF reference gets both as llama.cpp reads them
        (model_families.gemma3_as_llama_cpp_reads_it); its norms are stored as 1 + w."""
    source = prepared(family)
    path = gguf_tiny.write_gguf(source, tmp_path / f"{family}-{weights}.gguf", GGUF_TYPES[weights])
    reference = hf_from_gguf(path, source)
    # the file holds the source weights as its types store them, in the layout transformers
    # reads back (names, q/k row order, shapes from the metadata): HF's own GGUF reading
    # checks the writer, before the engine is compared with HF
    stored = gguf_tiny.expected_state_dict(source, GGUF_TYPES[weights])
    assert set(stored) == {n for n in source.state_dict() if n in dict(source.named_parameters())}
    read_back = reference.state_dict()
    for name, w in stored.items():
        assert torch.equal(read_back[name], w), name
    want = hf_greedy(reference)
    quantized = weights != "F32"
    for keep in (True, False) if quantized else (True,):  # an F32 file has nothing to keep quantized
        loaded = load_model(str(path), None, torch.float32, torch.device("cpu"), keep_quantized=keep)
        assert loaded.hf_config.model_type == {"mistral": "llama", "gemma3": "gemma3_text"}.get(family, family)
        assert hasattr(loaded.hf_config, "rope_freq_factors") == (family == "llama")
        got = engine_greedy(loaded)
        assert_quantized_path(loaded.model.layers[0].mlp.down_proj,
                              weights.split("+")[1] if keep and quantized else None)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"{family}, {weights}, keep_quantized={keep}, prompt {i}"


def test_gguf_file_named_exactly_mistral_loads_as_the_llama_file_it_is(tmp_path):
    """transformers turns a "llama" file whose general.name is exactly "mistral" into a
    MistralConfig (sliding window 4096, its class default, which the file does not state) and
    then cannot map its tensors (gguf-py has no "mistral" architecture): its own
    from_pretrained raises NotImplementedError on such a file. Our loader reads it as the
    llama file it is, like the same file under another name."""
    source = prepared("mistral")
    named = gguf_tiny.write_gguf(source, tmp_path / "a" / "m.gguf", name="mistral")
    other = gguf_tiny.write_gguf(source, tmp_path / "b" / "m.gguf", name="Mistral 7B Tiny")
    loaded = load_model(str(named), None, torch.float32, torch.device("cpu"))
    assert loaded.hf_config.model_type == "llama"
    assert not getattr(loaded.hf_config, "sliding_window", None)
    assert engine_greedy(loaded) == hf_greedy(hf_from_gguf(other, source))


def test_gguf_llama3_rope_scaling_reaches_the_engine(tmp_path):
    """The F32 GGUF holds the source model's weights exactly, and its Llama 3 rope scaling as
    llama.cpp stores it (rope_freqs: one divisor per rotary frequency), which the loader puts
    on the config and the rotary tables apply: the engine's tokens are the source model's
    (scaling on). Without the divisors they differ (the safetensors test shows the scaling
    matters for these prompts)."""
    source = prepared("llama")
    path = gguf_tiny.write_gguf(source, tmp_path / "llama.gguf")
    loaded = load_model(str(path), None, torch.float32, torch.device("cpu"))
    assert len(loaded.hf_config.rope_freq_factors) == 8  # head_dim 16
    assert engine_greedy(loaded) == hf_greedy(source)
    del loaded.hf_config.rope_freq_factors
    unscaled = LlamaForCausalLM(loaded.hf_config, loaded.max_model_len).rotary
    assert not torch.equal(unscaled.cos, loaded.model.rotary.cos)


def test_the_written_rope_freqs_are_hf_llama3_frequencies():
    """What the file's rope_freqs holds, for whoever applies it: the base inverse frequencies
    divided by it are transformers' Llama 3 ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = build("llama").config
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))  # head_dim 16
    divisors = torch.from_numpy(gguf_tiny.llama3_rope_divisors(cfg))
    # this model's short original context leaves no frequency unscaled: one blended, the rest x8
    assert divisors.max() == 8.0 and ((divisors > 1) & (divisors < 8)).any()
    torch.testing.assert_close(base / divisors, scaled.float(), rtol=1e-6, atol=0)
