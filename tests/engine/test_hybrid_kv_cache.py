"""The hybrid KV cache (kv_layout.py, kv_cache.py): layers grouped by attention type, each group
with its own block tables in one paged pool; sliding-window groups free the blocks behind their
window while a full-attention group keeps them; a request allocates in every group or in none;
a prefix hit is the longest prefix every group serves. Then the engine on a model that mixes
sliding-window and full-attention layers (a tiny Qwen2 with `max_window_layers`, which HF runs
per `layer_types`) against HF transformers in fp32, past the window, with chunked prefill,
preemption and prefix-cache hits."""
from __future__ import annotations

import pytest
import torch

from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.kv_cache import FREED_BLOCK, KVCacheManager
from tessera_engine.kv_layout import KVGroup, plan_kv_layout
from tessera_engine.models.loader import load_model
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

from helpers.engine_requests import run_chunks, sample_of
from helpers.model_families import hf_greedy_ignoring_eos

pytestmark = pytest.mark.unit

F = FREED_BLOCK


# -- layout -------------------------------------------------------------------------------------

def test_gemma3_270m_layers_make_five_sliding_groups_and_one_global_group_of_three():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]  # 5 sliding : 1 global
    layout = plan_kv_layout(windows)
    assert layout.groups == (KVGroup(512, (0, 1, 2)), KVGroup(512, (3, 4, 6)), KVGroup(512, (7, 8, 9)),
                             KVGroup(512, (10, 12, 13)), KVGroup(512, (14, 15, 16)), KVGroup(None, (5, 11, 17)))
    assert layout.tensors == 3 and layout.hybrid
    assert layout.layer_group[5] == 5 and layout.layer_tensor[5] == 0 and layout.layer_tensor[17] == 2
    # every (group, tensor) page slot belongs to exactly one layer
    assert len({(g, t) for g, t in zip(layout.layer_group, layout.layer_tensor)}) == 18


def test_models_whose_layers_attend_alike_are_one_group_over_every_layer():
    for windows in ([None] * 4, [64] * 4):
        layout = plan_kv_layout(windows)
        assert layout.groups == (KVGroup(windows[0], (0, 1, 2, 3)),) and layout.tensors == 4
        assert layout.layer_tensor == (0, 1, 2, 3) and not layout.hybrid


def test_a_type_that_does_not_divide_evenly_leaves_a_smaller_last_group():
    windows = [None if i % 7 == 6 else 512 for i in range(26)]  # 3 global, 23 sliding
    layout = plan_kv_layout(windows)
    assert layout.tensors == 3 and [len(g.layers) for g in layout.groups] == [3] * 7 + [2] + [3]
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(26))


# -- bookkeeping (block size 4; group 0 sliding with window 6, group 1 full) ----------------------

def test_each_group_has_its_own_table_and_the_window_group_frees_behind_its_window():
    kv = KVCacheManager(num_blocks=20, block_size=4, windows=[6, None])
    r = sample_of("r", list(range(10, 34)))  # 24 tokens: 6 blocks
    run_chunks(kv, r, 4)
    window_table, full_table = kv.block_tables(r)
    assert len(window_table) == len(full_table) == 6
    assert F not in full_table and window_table[:3] == [F] * 3  # position 20's window starts at 15
    assert not set(b for b in window_table if b != F) & set(full_table)  # no page in two groups
    assert kv.held_blocks(r) == [3, 6] and kv.num_free_blocks == 20 - 9
    kv.free(r)
    assert kv.num_free_blocks == 20


def test_a_4k_token_request_holds_its_window_in_each_sliding_group_and_everything_in_the_global_one():
    """Gemma 3 270M's shape: five sliding groups (window 512) and one global group, block size 16,
    a 4096-token request prefilled in 512-token chunks: each sliding group holds about the window
    (plus a chunk while it runs), the global group all 256 blocks."""
    windows = [512] * 5 + [None]
    kv = KVCacheManager(num_blocks=2000, block_size=16, windows=windows)
    r = sample_of("long", [(7 * i) % 1000 + 3 for i in range(4096)])
    most = [0] * 6
    while r.num_computed_tokens < r.num_tokens:
        n = min(512, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate(r, n)
        r.num_computed_tokens += n
        most = [max(a, b) for a, b in zip(most, kv.held_blocks(r))]
    for _ in range(64):  # decode past the prompt
        r.append_output_token(5)
        assert kv.allocate(r, 1)
        r.num_computed_tokens += 1
    held = kv.held_blocks(r)
    assert held[5] == -(-4160 // 16)  # the global group: every block
    assert all(h <= 512 // 16 + 2 for h in held[:5]), held  # a sliding group: its window's blocks
    assert all(m <= (512 + 512) // 16 + 2 for m in most[:5]), most  # the window behind a chunk + the chunk
    assert kv.blocks_needed(4160, 512) >= sum(most)


def test_a_request_allocates_in_every_group_or_in_none():
    kv = KVCacheManager(num_blocks=5, block_size=4, windows=[6, None])
    a = sample_of("a", list(range(12)))  # 3 blocks in each group: 6 > 5
    assert not kv.allocate(a, 12)
    assert kv.num_free_blocks == 5 and kv.block_tables(a) == ([], [])
    assert kv.allocate(a, 8)  # 2 + 2
    assert kv.num_free_blocks == 1
    a.num_computed_tokens = 8
    assert not kv.allocate(a, 4)  # the next block in both groups: 2 > 1, nothing taken
    assert kv.num_free_blocks == 1 and [len(t) for t in kv.block_tables(a)] == [2, 2]


def test_a_prefix_hit_needs_every_block_of_the_full_group_and_the_windows_blocks_of_the_sliding_one():
    kv = KVCacheManager(num_blocks=40, block_size=4, windows=[6, None])
    prompt = list(range(100, 124))  # 6 blocks
    a = sample_of("a", prompt)
    run_chunks(kv, a, 24)  # one chunk: the window group holds all 6 blocks during it
    a_tables = [list(t) for t in kv.block_tables(a)]
    kv.free(a)
    b = sample_of("b", prompt + [1, 2])
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 24
    # position 24's window starts at 19 (block 4): the sliding group takes blocks 4 and 5 only
    assert hit.block_ids[0] == [F] * 4 + a_tables[0][4:] and hit.block_ids[1] == a_tables[1]
    # the sliding group's early blocks evicted: no matter. The full group's block 2 evicted: the hit
    # stops before it.
    for block in a_tables[0][:4]:
        kv.free_queue.move_to_end(block, last=False)
    assert kv.allocate(sample_of("o1", list(range(500, 516))), 8)  # 2 + 2 pages: the sliding group's first four
    assert kv.find_cached_prefix(sample_of("b2", prompt + [1])).num_tokens == 24
    kv.free_queue.move_to_end(a_tables[1][2], last=False)
    assert kv.allocate(sample_of("o2", list(range(600, 604))), 2)  # takes the full group's block 2
    hit = kv.find_cached_prefix(sample_of("b3", prompt + [1]))
    # 8 tokens: the full group has blocks 0-1; the window of position 8 (3..8) needs sliding blocks 0-1,
    # which were evicted: no hit at all; 4 tokens would need sliding block 0: gone too
    assert hit.num_tokens == 0


def test_groups_cache_their_own_pages_for_the_same_tokens():
    kv = KVCacheManager(num_blocks=40, block_size=4, windows=[None, None])
    prompt = list(range(12))
    a = sample_of("a", prompt)
    run_chunks(kv, a, 12)
    t0, t1 = (list(t) for t in kv.block_tables(a))
    kv.free(a)
    hit = kv.find_cached_prefix(sample_of("b", prompt + [5]))
    assert hit.block_ids == (t0, t1) and hit.num_tokens == 12 and hit.copy_from is None


# -- the engine on a model mixing sliding-window and full-attention layers, against HF ----------
WINDOW = 20  # not a multiple of the block size (16)


@pytest.fixture(scope="module")
def hybrid_qwen2(tmp_path_factory):
    """Qwen2 with use_sliding_window: layers from max_window_layers on attend a window, those
    before it everything (transformers' Qwen2Config.layer_types)."""
    import transformers as tf

    torch.manual_seed(7)
    cfg = tf.Qwen2Config(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.25, use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1, tie_word_embeddings=True)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    hf = tf.Qwen2ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("qwen2-hybrid")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(str(path), None, torch.float32, torch.device("cpu"))


PROMPTS = [[3, 17, 42, 99, 5], [(7 * i) % 150 + 3 for i in range(45)], [(11 * i) % 157 + 2 for i in range(70)]]


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("budget,num_blocks", [(2048, 64), (32, 64), (32, 18)],
                         ids=["whole", "chunked", "preempting"])
def test_greedy_of_a_hybrid_model_matches_hf(hybrid_qwen2, cpu_kernels, budget, num_blocks):
    hf, loaded = hybrid_qwen2
    core = EngineCore(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=num_blocks,
                                   cpu_kernels=cpu_kernels, max_num_batched_tokens=budget), loaded=loaded)
    assert core.kv_cache.windows == [None, WINDOW, WINDOW]  # groups of one layer: the rarer type has one
    n = 40
    for i, p in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n,
                                                                       ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    most_sliding = 0
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        for r in core.scheduler.running:
            most_sliding = max(most_sliding, core.kv_cache.held_blocks(r)[1])
    for i, p in enumerate(PROMPTS):
        assert tokens[f"r{i}"] == hf_greedy_ignoring_eos(hf, p, n), f"prompt {i}"
    assert most_sliding <= -(-(WINDOW + min(budget, 110)) // 16) + 1
    if num_blocks == 18:
        assert core.scheduler.num_preemptions > 0
    assert core.kv_cache.num_free_blocks == num_blocks


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_prefix_hits_on_a_hybrid_model_match_hf(hybrid_qwen2, cpu_kernels):
    hf, loaded = hybrid_qwen2
    core = EngineCore(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, cpu_kernels=cpu_kernels),
                      loaded=loaded)
    base = [(13 * i) % 151 + 4 for i in range(64)]
    first = core.generate([EngineCoreRequest("a", base + [9, 8], SamplingParams(temperature=0.0, max_tokens=30,
                                                                                   ignore_eos=True))])
    assert first[("a", 0)] == hf_greedy_ignoring_eos(hf, base + [9, 8], 30)
    before = core.stats().prefix_cache_hits
    second = base + [1, 2, 3, 4, 5]
    out = core.generate([EngineCoreRequest("b", second, SamplingParams(temperature=0.0, max_tokens=30,
                                                                         ignore_eos=True))])
    assert core.stats().prefix_cache_hits - before == 64
    assert out[("b", 0)] == hf_greedy_ignoring_eos(hf, second, 30)
