"""Sliding-window attention (Mistral): the KV cache frees the blocks a request's window has
left behind while it runs, a prefix-cache hit needs only the blocks the window reaches, and
the engine's greedy output past the window equals HF transformers' token for token in fp32,
on both attention backends, with chunked prefill and with prefix-cache hits."""
from __future__ import annotations

import pytest
import torch

from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.kv_cache import FREED_BLOCK, KVCacheManager
from tessera_engine.models.llama import attention_windows
from tessera_engine.models.loader import load_model
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

from helpers.engine_requests import run_chunks, sample_of

pytestmark = pytest.mark.unit

F = FREED_BLOCK


# -- KV cache bookkeeping (block size 4, window 6: a token sees itself and the 5 before) --------
def test_blocks_the_window_has_left_behind_are_freed_while_the_request_runs():
    kv = KVCacheManager(num_blocks=10, block_size=4, windows=[6])
    r = sample_of("a", list(range(30)))
    assert kv.allocate(r, 8)
    r.num_computed_tokens = 8
    assert kv.allocate(r, 8)  # position 8 sees 3..8: block 0 still needed
    assert F not in kv.block_table(r) and kv.num_free_blocks == 6
    r.num_computed_tokens = 16
    assert kv.allocate(r, 8)  # position 16 sees 11..16: blocks 0 and 1 go back
    assert kv.block_table(r)[:2] == [F, F] and F not in kv.block_table(r)[2:]
    assert len(kv.block_table(r)) == 6 and kv.num_free_blocks == 6
    r.num_computed_tokens = 24
    for t in range(24, 30):  # decode: at most the window's blocks and the new one are held
        assert kv.allocate(r, 1)
        r.num_computed_tokens += 1
        held = [b for b in kv.block_table(r) if b != F]
        assert len(held) <= 3, kv.block_table(r)
    kv.free(r)
    assert kv.num_free_blocks == 10


def test_a_long_request_runs_in_a_pool_smaller_than_its_context():
    kv = KVCacheManager(num_blocks=4, block_size=4, windows=[6])
    r = sample_of("a", list(range(100)))
    run_chunks(kv, r, 4)
    assert len(kv.block_table(r)) == 25 and sum(b != F for b in kv.block_table(r)) <= 3


def test_a_prefix_hit_needs_only_the_blocks_the_window_reaches():
    kv = KVCacheManager(num_blocks=20, block_size=4, windows=[6])
    prompt = list(range(100, 124))  # 6 full blocks
    a = sample_of("a", prompt)
    run_chunks(kv, a, 8)
    kv.free(a)  # all 6 blocks cached and free
    # evict the chain's first blocks: a later request that takes free blocks takes them first
    hashes = kv.req_blocks.get(a.key)
    assert hashes is None
    first_two = [kv.cached[0][h] for h in kv._block_hashes(sample_of("probe", prompt), 24)[:2]]
    for b in first_two:
        kv.free_queue.move_to_end(b, last=False)
    other = sample_of("other", list(range(500, 508)))
    assert kv.allocate(other, 8)  # two fresh blocks: the evicted first two
    b = sample_of("b", prompt + [7, 8, 9, 10])
    hit = kv.find_cached_prefix(b)
    blocks, n = hit.block_ids[0], hit.num_tokens
    # position 24's window starts at 19 (block 4): blocks 4 and 5 are enough
    assert n == 24 and blocks[:4] == [F] * 4 and F not in blocks[4:] and len(blocks) == 6
    assert kv.allocate(b, b.num_tokens - n, hit)
    b.num_computed_tokens = b.num_tokens
    # nothing was published under a FREED_BLOCK entry (Python's index -1 is the pool's last block)
    assert all(kv.blocks[bid].block_hash == h for h, bid in kv.cached[0].items())
    kv.free(b)
    kv.free(other)
    assert kv.num_free_blocks == 20
    # without a window the same state gives no hit: the chain's first block is gone
    plain = KVCacheManager(num_blocks=20, block_size=4)
    a2 = sample_of("a2", prompt)
    run_chunks(plain, a2, 8)
    plain.free(a2)
    for h in plain._block_hashes(sample_of("probe", prompt), 24)[:1]:
        plain.free_queue.move_to_end(plain.cached[0][h], last=False)
    assert plain.allocate(sample_of("o", list(range(500, 504))), 4)
    assert plain.find_cached_prefix(sample_of("b2", prompt + [7]))[1] == 0


def test_a_gap_inside_the_window_shortens_the_hit():
    kv = KVCacheManager(num_blocks=20, block_size=4, windows=[6])
    prompt = list(range(200, 224))
    a = sample_of("a", prompt)
    run_chunks(kv, a, 24)
    kv.free(a)
    block5 = kv.cached[0][kv._block_hashes(sample_of("probe", prompt), 24)[5]]
    kv.free_queue.move_to_end(block5, last=False)
    assert kv.allocate(sample_of("o", [1, 2, 3]), 3)  # evicts block 5 only
    hit = kv.find_cached_prefix(sample_of("b", prompt + [1, 2]))
    blocks, n = hit.block_ids[0], hit.num_tokens
    # 24 tokens would need block 5; 20 need blocks 3 and 4 (position 20 sees 15..20)
    assert n == 20 and blocks[:3] == [F] * 3 and len(blocks) == 5


def test_which_layers_of_which_configs_have_a_window():
    import transformers as tf

    assert attention_windows(tf.MistralConfig(sliding_window=64, num_hidden_layers=2)) == [64, 64]
    assert attention_windows(tf.MistralConfig(sliding_window=None, num_hidden_layers=2)) == [None, None]
    assert attention_windows(tf.LlamaConfig(num_hidden_layers=2)) == [None, None]
    assert attention_windows(tf.Qwen2Config(use_sliding_window=False, sliding_window=64,
                                            num_hidden_layers=2)) == [None, None]
    assert attention_windows(tf.Qwen2Config(use_sliding_window=True, sliding_window=64, num_hidden_layers=4,
                                            max_window_layers=0)) == [64] * 4
    # a window on some layers only: their own KV cache group (kv_layout.py)
    assert attention_windows(tf.Qwen2Config(use_sliding_window=True, sliding_window=64, num_hidden_layers=4,
                                            max_window_layers=2)) == [None, None, 64, 64]


# -- the engine against HF past the window -----------------------------------------------------
WINDOW = 20  # not a multiple of the block size (16): windows start inside blocks


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    import transformers as tf

    torch.manual_seed(5)
    cfg = tf.MistralConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           initializer_range=0.25, sliding_window=WINDOW)
    hf = tf.MistralForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("mistral-swa")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(str(path), None, torch.float32, torch.device("cpu"))


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[3, 17, 42, 99, 5], [(7 * i) % 150 + 3 for i in range(45)], [(11 * i) % 157 + 2 for i in range(70)]]


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("budget", [2048, 32], ids=["whole", "chunked"])
def test_greedy_past_the_window_matches_hf(mistral, cpu_kernels, budget):
    hf, loaded = mistral
    assert loaded.max_model_len == 256  # no longer capped to the window
    core = EngineCore(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, cpu_kernels=cpu_kernels,
                                   max_num_batched_tokens=budget), loaded=loaded)
    assert core.kv_cache.windows == [WINDOW]
    n = 40
    for i, p in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n,
                                                                       ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    most_held = 0
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        tables = [core.kv_cache.block_table(r) for r in core.scheduler.running]
        most_held = max([most_held] + [sum(b != F for b in t) for t in tables])
    for i, p in enumerate(PROMPTS):
        assert tokens[f"r{i}"] == hf_greedy(hf, p, n), f"prompt {i}"
    # 110 tokens of context held in at most the window's blocks and a step's chunk
    assert most_held <= -(-(WINDOW + min(budget, 110)) // 16) + 1
    if budget == 32:
        assert most_held <= 4
    assert core.kv_cache.num_free_blocks == 64


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_prefix_hits_past_the_window_match_hf(mistral, cpu_kernels):
    """A prompt sharing a 64-token prefix with one already served: the hit takes only the
    window's blocks, and the output is still HF's."""
    hf, loaded = mistral
    core = EngineCore(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, cpu_kernels=cpu_kernels),
                      loaded=loaded)
    base = [(13 * i) % 151 + 4 for i in range(64)]
    first = core.generate([EngineCoreRequest("a", base + [9, 8], SamplingParams(temperature=0.0, max_tokens=30,
                                                                                   ignore_eos=True))])
    assert first[("a", 0)] == hf_greedy(hf, base + [9, 8], 30)
    before = core.stats().prefix_cache_hits
    second = base + [1, 2, 3, 4, 5]
    out = core.generate([EngineCoreRequest("b", second, SamplingParams(temperature=0.0, max_tokens=30,
                                                                         ignore_eos=True))])
    assert core.stats().prefix_cache_hits - before == 64
    assert out[("b", 0)] == hf_greedy(hf, second, 30)
