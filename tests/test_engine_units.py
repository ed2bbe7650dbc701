"""Unit tests of the engine's bookkeeping: KV block pool and prefix cache,
scheduler budget / caps / preemption order, and the sampler's filters."""
from __future__ import annotations

import math

import pytest
import torch

from tessera_engine.config import EngineConfig
from tessera_engine.kv_cache import KVCacheManager, KVCopy, PrefixHit
from tessera_engine.model_runner import ModelRunnerOutput
from tessera_engine.request import EngineCoreRequest, Request
from tessera_engine.sampler import Sampler
from tessera_engine.sampling_params import SamplingParams
from tessera_engine.scheduler import Scheduler


def make_req(rid: str, n_tokens: int, start: int = 0, arrival: float = 0.0, priority: int = 0,
             **params) -> Request:
    core = EngineCoreRequest(rid, list(range(start, start + n_tokens)), SamplingParams(**params),
                             priority=priority, arrival_time=arrival)
    return Request(core, 0, [2])


# -- KV cache ------------------------------------------------------------------------------
def test_allocate_grows_and_free_returns_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    r = make_req("a", 10)
    assert kv.allocate(r, 10)
    assert len(kv.block_table(r)) == 3 and kv.num_free_blocks == 7
    r.num_computed_tokens = 10
    r.append_output_token(5)
    assert kv.allocate(r, 1)  # 11 tokens still fit in 3 blocks
    assert len(kv.block_table(r)) == 3
    r.num_computed_tokens = 11
    for t in (6, 7):
        r.append_output_token(t)
    assert kv.allocate(r, 2)  # 13 tokens need a 4th block
    assert len(kv.block_table(r)) == 4
    kv.free(r)
    assert kv.num_free_blocks == 10 and kv.block_table(r) == []


def test_allocate_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a, b = make_req("a", 8), make_req("b", 8)
    assert kv.allocate(a, 8)
    assert not kv.allocate(b, 8)
    assert kv.num_free_blocks == 1 and kv.block_table(b) == []


def test_prefix_cache_reuses_full_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = make_req("a", 12)
    assert kv.find_cached_prefix(a) == PrefixHit([], 0)
    assert kv.allocate(a, 12)
    # same first 12 tokens plus more: 3 cached blocks
    b = make_req("b", 15)
    hit = kv.find_cached_prefix(b)
    assert hit == PrefixHit(kv.block_table(a), 12)
    # identical 12-token prompt: 2 whole blocks and 3 tokens of the third (copied), since
    # one token must be computed
    c = make_req("c", 12)
    assert kv.find_cached_prefix(c) == PrefixHit(kv.block_table(a)[:2], 11, kv.block_table(a)[2], 3)
    # a different first block breaks the chain even if later tokens agree
    d = make_req("d", 12, start=1)
    assert kv.find_cached_prefix(d).num_tokens == 0


def test_prompt_logprobs_request_reads_no_cached_prefix():
    """Prompt logprobs need every prompt position computed, so such a request skips the cache
    (its blocks are still cached for the others)."""
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = make_req("a", 12, prompt_logprobs=1)
    assert kv.find_cached_prefix(a) == PrefixHit([], 0)
    assert kv.allocate(a, 12)
    assert kv.find_cached_prefix(make_req("b", 13, prompt_logprobs=1)) == PrefixHit([], 0)
    assert kv.find_cached_prefix(make_req("c", 13)).num_tokens == 12


def test_shared_blocks_are_refcounted_and_cached_blocks_evicted_lru():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_req("a", 8)
    kv.allocate(a, 8)
    b = make_req("b", 9)
    hit = kv.find_cached_prefix(b)
    assert kv.allocate(b, 9 - hit.num_tokens, hit)
    assert kv.block_table(b)[:2] == kv.block_table(a)
    assert kv.num_free_blocks == 3
    kv.free(a)
    assert kv.num_free_blocks == 3  # still held by b
    kv.free(b)
    assert kv.num_free_blocks == 6
    # the cached prefix survives until its blocks are needed
    assert kv.find_cached_prefix(make_req("c", 9)).num_tokens == 8
    big = make_req("big", 24, start=100)
    assert kv.allocate(big, 24)  # takes every block, evicting the cache
    assert kv.find_cached_prefix(make_req("c2", 9)) == PrefixHit([], 0)


def test_partial_block_hit_copies_the_shared_start_of_the_next_block():
    """A prompt sharing 2 whole blocks and 2 tokens of the third with a cached one gets the 2
    blocks and a copy of those 2 slots into its own third block."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", 12)
    kv.allocate(a, 12)
    src = kv.block_table(a)[2]
    b = Request(EngineCoreRequest("b", list(range(10)) + [50, 51, 52], SamplingParams()), 0, [2])
    hit = kv.find_cached_prefix(b)
    assert hit == PrefixHit(kv.block_table(a)[:2], 10, src, 2)
    assert kv.allocate(b, 13 - 10, hit)
    table = kv.block_table(b)
    assert table[:2] == kv.block_table(a)[:2] and table[2] not in kv.block_table(a) and len(table) == 4
    assert kv.copy_for(b, hit) == KVCopy(src, table[2], 2)
    # a third prompt sharing 1 token of that block: the longest shared start wins
    c = Request(EngineCoreRequest("c", list(range(9)) + [60, 61], SamplingParams()), 0, [2])
    assert kv.find_cached_prefix(c).copy_tokens == 1
    # no match past the first block boundary's tokens: nothing to copy
    d = Request(EngineCoreRequest("d", list(range(8)) + [70, 71], SamplingParams()), 0, [2])
    assert kv.find_cached_prefix(d) == PrefixHit(kv.block_table(a)[:2], 8)


def test_partial_hit_never_reads_a_block_copied_into_in_the_same_step():
    """A step's copies all read before any writes, so a prompt whose best source is another
    prompt's block filled by a copy in this same step reads from that copy's source instead,
    at most the copied tokens; in a later step the block is written and read directly."""
    kv = KVCacheManager(num_blocks=12, block_size=4)

    def admit(rid, tokens):
        r = Request(EngineCoreRequest(rid, tokens, SamplingParams()), 0, [2])
        hit = kv.find_cached_prefix(r)
        assert kv.allocate(r, len(tokens) - hit.num_tokens, hit)
        return r, hit, kv.copy_for(r, hit)

    a, _, _ = admit("a", [0, 1, 2, 3, 4, 5, 6, 7, 8])
    b, _, copy_b = admit("b", [0, 1, 2, 3, 4, 5, 30, 31, 32])  # 2 slots of a's second block
    assert copy_b == KVCopy(kv.block_table(a)[1], kv.block_table(b)[1], 2)
    # b's second block is the newest holding [4, 5, 30, ...]; c shares 3 tokens of it
    c, hit_c, copy_c = admit("c", [0, 1, 2, 3, 4, 5, 30, 40, 41])
    assert copy_c == KVCopy(kv.block_table(a)[1], kv.block_table(c)[1], 2) and hit_c.num_tokens == 6
    kv.release_copy_sources()  # the step ran: b's block holds all its tokens now
    _, hit_d, copy_d = admit("d", [0, 1, 2, 3, 4, 5, 30, 50, 51])
    assert copy_d.src in (kv.block_table(b)[1], kv.block_table(c)[1]) and hit_d.num_tokens == 7


def test_partial_hit_source_is_held_through_its_step():
    """A free cached block a partial hit copies from is not handed out by allocations of the
    same step (it would be overwritten before the copy), and is free again after the step."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_req("a", 8)
    kv.allocate(a, 8)
    kv.free(a)  # both blocks cached and free
    b = Request(EngineCoreRequest("b", [0, 1, 2, 3, 4, 5, 90], SamplingParams()), 0, [2])
    hit = kv.find_cached_prefix(b)
    assert hit.copy_from is not None and hit.copy_tokens == 2
    assert kv.allocate(b, 7 - hit.num_tokens, hit)
    assert kv.num_free_blocks == 1  # b's 2 blocks + the held source
    big = make_req("big", 4, start=100)
    assert kv.allocate(big, 4) and hit.copy_from not in kv.block_table(big)
    assert not kv.allocate(make_req("more", 4, start=200), 4)  # the source is not free to take
    kv.release_copy_sources()
    assert kv.num_free_blocks == 1 and kv.blocks[hit.copy_from].ref_cnt == 0
    # still cached: a later prompt finds it again
    assert kv.find_cached_prefix(Request(EngineCoreRequest("e", [0, 1, 2, 3, 4, 5, 91], SamplingParams()),
                                         0, [2])).copy_from == hit.copy_from


def test_stats_usage():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate(make_req("a", 8), 8)
    assert kv.stats().usage == pytest.approx(0.5)


# -- scheduler -------------------------------------------------------------------------------
def make_scheduler(num_blocks=100, block_size=4, **cfg) -> Scheduler:
    config = EngineConfig(block_size=block_size, **cfg)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, config.enable_prefix_caching), 1000)


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {x.request.key: token for x in out.scheduled if x.samples}
    s.update_from_output(out, ModelRunnerOutput(sampled, {}, {}))
    return out


def test_token_budget_chunks_long_prompts():
    s = make_scheduler(max_num_batched_tokens=10, enable_prefix_caching=False)
    r = make_req("a", 25, max_tokens=3)
    s.add_request(r)
    chunks = [run_step(s).scheduled[0].num_new_tokens for _ in range(3)]
    assert chunks == [10, 10, 5]
    assert r.num_output_tokens == 1  # only the last chunk samples


def test_chunked_prefill_with_prefix_caching_registers_only_computed_blocks():
    s = make_scheduler(max_num_batched_tokens=6, enable_prefix_caching=True)
    a = make_req("a", 25, max_tokens=2)
    s.add_request(a)
    run_step(s)  # 6 of 25 tokens: one full block of 4 is cached, not the 6 the lookup hashed
    assert len(s.kv.cached) == 1
    while s.has_unfinished():
        run_step(s)
    assert a.num_output_tokens == 2 and s.kv.num_free_blocks == s.kv.num_blocks
    b = make_req("b", 25, max_tokens=1)
    s.add_request(b)
    out = s.schedule()
    assert out.scheduled[0].start == 24  # 6 full blocks of a's prompt reused


def test_running_first_then_waiting_within_budget():
    s = make_scheduler(max_num_batched_tokens=12, enable_prefix_caching=False)
    a = make_req("a", 8, max_tokens=5)
    s.add_request(a)
    run_step(s)
    b, c = make_req("b", 8, arrival=1), make_req("c", 8, arrival=2)
    s.add_request(b)
    s.add_request(c)
    out = s.schedule()
    got = [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]
    assert got == [("a", 1), ("b", 8), ("c", 3)]  # decode first, then prefill, then a chunk
    assert out.num_batched_tokens == 12


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_seqs=2, enable_prefix_caching=False)
    for i in range(4):
        s.add_request(make_req(f"r{i}", 4, arrival=i))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_preemption_takes_latest_and_requeues_it_first():
    s = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = make_req("a", 8, arrival=0, max_tokens=20), make_req("b", 8, arrival=1, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prefilled: 4 blocks used, both have 9 tokens, next needs a 3rd block each
    out = s.schedule()
    assert [p.request_id for p in out.preempted] == ["b"]
    assert s.waiting[0] is b and b.num_computed_tokens == 0
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    assert s.num_preemptions == 1


def test_priority_policy_orders_waiting_and_preempts_lowest():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority", enable_prefix_caching=False)
    s.add_request(make_req("low", 4, arrival=0, priority=5))
    s.add_request(make_req("high", 4, arrival=1, priority=0))
    out = s.schedule()
    assert out.scheduled[0].request.request_id == "high"


# -- sampler ---------------------------------------------------------------------------------
def sample(logits, **params):
    reqs = [make_req(f"s{i}", 3, **params) for i in range(logits.shape[0])]
    return Sampler(logits.shape[1], torch.device("cpu"))(logits, reqs)


def test_greedy_and_top_k_one():
    logits = torch.randn(4, 50)
    assert sample(logits.clone(), temperature=0).token_ids == logits.argmax(-1).tolist()
    assert sample(logits.clone(), temperature=1.0, top_k=1).token_ids == logits.argmax(-1).tolist()


def test_top_p_and_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    picked = set(sample(logits.clone(), temperature=1.0, top_p=0.7).token_ids)
    assert picked == {0, 1}
    picked = set(sample(logits.clone(), temperature=1.0, min_p=0.5).token_ids)
    assert picked == {0, 1}  # 0.15 < 0.5 * 0.5
    picked = set(sample(logits.clone(), temperature=1.0).token_ids)
    assert picked >= {0, 1, 2}


def test_penalties_and_min_tokens():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 5.0
    logits[0, 2] = 4.0  # the EOS id used by make_req
    # request tokens are 0,1,2 (prompt): repetition penalty pushes 2 down
    r = make_req("p", 3, temperature=0, repetition_penalty=10.0)
    out = Sampler(10, torch.device("cpu"))(logits.clone(), [r])
    assert out.token_ids == [3]
    r = make_req("f", 3, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    r.append_output_token(3)
    assert Sampler(10, torch.device("cpu"))(logits.clone(), [r]).token_ids == [2]
    # min_tokens blocks EOS until reached
    logits2 = torch.zeros(1, 10)
    logits2[0, 2] = 9.0
    r = make_req("m", 3, temperature=0, min_tokens=2, max_tokens=5)
    assert Sampler(10, torch.device("cpu"))(logits2.clone(), [r]).token_ids != [2]


def test_logprobs_are_log_softmax_with_rank():
    logits = torch.randn(2, 30)
    out = sample(logits.clone(), temperature=0, logprobs=4)
    ref = torch.log_softmax(logits, -1)
    for i in range(2):
        tok, lp, rank, top_ids, top_lps = out.logprobs[i]
        assert rank == 1 and math.isclose(lp, ref[i, tok].item(), abs_tol=1e-5)
        assert top_ids == ref[i].topk(4).indices.tolist()


def test_seeded_rows_ignore_batch_mates():
    logits = torch.randn(1, 100)
    a = make_req("a", 3, temperature=1.0, seed=5)
    alone = [Sampler(100, torch.device("cpu"))(logits.clone(), [a]).token_ids[0] for _ in range(1)]
    b = make_req("b", 3, temperature=1.0, seed=5)
    batch = torch.cat([torch.randn(3, 100), logits])
    others = [make_req(f"o{i}", 3, temperature=1.0) for i in range(3)]
    mixed = Sampler(100, torch.device("cpu"))(batch, others + [b]).token_ids[3]
    assert alone[0] == mixed


def test_greedy_rows_beside_sampled_and_logprob_rows():
    """A batch mixing plain greedy rows with a seeded sampled row and a logprobs row: the
    greedy rows take the argmax fast path, the others the full path on their rows alone,
    and each row's token is what it gets in a batch of its own."""
    logits = torch.randn(5, 100)
    params = [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0),
              dict(temperature=0, logprobs=2), dict(temperature=0, logit_bias={7: 100.0})]
    batch = Sampler(100, torch.device("cpu"))(logits.clone(), [make_req(f"r{i}", 3, **p) for i, p in enumerate(params)])
    for i, p in enumerate(params):
        alone = Sampler(100, torch.device("cpu"))(logits[i:i + 1].clone(), [make_req(f"r{i}", 3, **p)])
        assert batch.token_ids[i] == alone.token_ids[0]
        assert (batch.logprobs[i] is None) == ("logprobs" not in p)
    assert batch.token_ids[4] == 7 and batch.token_ids[0] == int(logits[0].argmax())


# -- dtype -----------------------------------------------------------------------------------
def test_auto_dtype_is_bf16_where_the_cpu_computes_it_natively(monkeypatch):
    from tessera_engine import cpu_kernels

    cfg = EngineConfig(device="cpu")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    dtype, why = cfg.dtype_choice()
    assert dtype == torch.bfloat16 and "avx512_bf16" in why
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    assert cfg.resolved_dtype() == torch.bfloat16
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx2"}))
    dtype, why = cfg.dtype_choice()
    assert dtype == torch.float32 and "no native bfloat16" in why
    assert EngineConfig(device="cpu", dtype="float32").dtype_choice() == (torch.float32, "set by --dtype")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        EngineConfig(dtype="int8").resolved_dtype()


def test_token_budget_defaults_by_device_and_takes_an_explicit_value():
    assert EngineConfig(device="cpu").token_budget() == 512
    assert EngineConfig(device="cpu", max_num_batched_tokens=4096).token_budget() == 4096
    assert make_scheduler().token_budget == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        EngineConfig(max_num_batched_tokens=0).validate()


def test_block_hashes_are_sha256_chained_over_fixed_width_inputs():
    import hashlib
    from array import array

    from tessera_engine.kv_cache import hash_block

    first = hash_block(None, [1, 2, 3, 4])
    assert first == hashlib.sha256(array("q", [1, 2, 3, 4]).tobytes()).digest() and len(first) == 32
    second = hash_block(first, [5, 6, 7, 8])
    assert second == hashlib.sha256(first + array("q", [5, 6, 7, 8]).tobytes()).digest()
    assert hash_block(None, [5, 6, 7, 8]) != second  # the parent is part of the name
    assert hash_block(first, [5, 6, 7, 9]) != second
    assert hash_block(None, (1, 2, 3, 4)) == first  # any sequence of ids
