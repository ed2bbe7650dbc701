"""Fixtures for the in-process engine tests: the default model loaded once, HF's
reference greedy outputs on the same weights, prompts of mixed lengths, and a tiny
random Llama for tests that need fast steps rather than real text."""
from __future__ import annotations

import functools

import pytest
import torch

from tessera.common.model_source import resolve_model
from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.models.llama import LlamaForCausalLM
from tessera_engine.models.loader import LoadedModel, load_model
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Write a haiku about the sea.",
    "hi",
    "Explain gravity to a child in two sentences.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Give me a short tip for learning to cook, and explain in detail why it helps beginners "
    "build confidence in the kitchen over the first few weeks.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Summarize this passage in one sentence: The city council met on Tuesday evening to discuss the "
    "proposed expansion of the public library. Supporters argued that the current building is too small "
    "for the growing number of visitors, especially families with young children and students who need "
    "quiet places to study after school. Opponents worried about the cost, which would be paid partly "
    "through a small increase in property taxes over the next ten years. After three hours of debate, "
    "the council voted five to two to approve a detailed study of the plan, with a final decision "
    "expected in the spring.",
    "Why do leaves change color in autumn? Please answer thoroughly, covering chlorophyll, "
    "carotenoids, anthocyanins, temperature, daylight and the role of weather in how vivid the colors are.",
    "Name a planet.",
    "What is the boiling point of water at sea level in Celsius?",
    "Suggest a name for a pet goldfish.",
    "Tell me a fun fact about octopuses.",
    "What does CPU stand for?",
]


def tiny_hf_llama(hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 1,
                  max_len: int = 128, seed: int = 3):
    """A random Hugging Face Llama (vocab 256, 4 heads, 2 KV heads) and its config, built here."""
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama

    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_len)
    torch.manual_seed(seed)
    return cfg, HFLlama(cfg).eval()


def tiny_loaded(cfg, hf_model, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """tessera's Llama with the weights of `hf_model` (from tiny_hf_llama), as the engine loads a model."""
    model = LlamaForCausalLM(cfg, cfg.max_position_embeddings)
    model.load_hf_state_dict(hf_model.state_dict().items())
    return LoadedModel(model.to(dtype=dtype).eval(), cfg, "tiny", cfg.max_position_embeddings)


@pytest.fixture(scope="session")
def model_source():
    return resolve_model(None)


@pytest.fixture(scope="session")
def hf_tokenizer(model_source):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_source.directory, gguf_file=model_source.gguf_file)


@pytest.fixture(scope="session")
def chat_prompts(hf_tokenizer):
    return [hf_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=False) for q in QUESTIONS]


@pytest.fixture(scope="session")
def loaded_fp32():
    return load_model(None, None, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def hf_greedy(model_source):
    """hf_greedy(prompt_ids, max_new_tokens) -> HF generate's greedy new tokens (cached)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_source.directory, gguf_file=model_source.gguf_file,
                                                 dtype=torch.float32).eval()

    @functools.lru_cache(maxsize=None)
    def run(prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        return out[0, len(prompt):].tolist()

    return lambda prompt, n: run(tuple(prompt), n)


@pytest.fixture
def make_core(loaded_fp32):
    def make(**overrides) -> EngineCore:
        # batch-invariant (the default): the tests compare tokens across batch sizes
        cfg = dict(dtype="float32", device="cpu", kv_cache_gib=0.25)
        cfg.update(overrides)
        return EngineCore(EngineConfig(**cfg), loaded=loaded_fp32)
    return make


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def requests(prompts, params, prefix="r") -> list[EngineCoreRequest]:
    return [EngineCoreRequest(f"{prefix}{i}", list(p), params) for i, p in enumerate(prompts)]
