"""Unit tests of the engine's scheduler: token budget, caps, preemption order (tessera_engine.scheduler)."""
from __future__ import annotations

import pytest

from helpers.engine_requests import make_req, make_scheduler, run_step

pytestmark = pytest.mark.unit


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
    got = [(x.sample.request_id, x.num_new_tokens) for x in out.scheduled]
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
    assert [x.sample.request_id for x in out.scheduled] == ["a"]
    assert s.num_preemptions == 1


def test_priority_policy_orders_waiting_and_preempts_lowest():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority", enable_prefix_caching=False)
    s.add_request(make_req("low", 4, arrival=0, priority=5))
    s.add_request(make_req("high", 4, arrival=1, priority=0))
    out = s.schedule()
    assert out.scheduled[0].sample.request_id == "high"


def test_with_prompt_apart_a_recomputed_sample_stops_its_chunk_at_the_end_of_its_prompt():
    """Prompt and output tokens take different matmuls (the plan's prompt_dense): a preempted
    sample's recomputation takes its prompt in one chunk and its outputs in the next."""
    from tessera_engine.config import EngineConfig
    from tessera_engine.kv_cache import KVCacheManager
    from tessera_engine.scheduler import Scheduler

    config = EngineConfig(block_size=4, enable_prefix_caching=False)
    s = Scheduler(config, KVCacheManager(100, 4, False, outputs_apart=True), 1000, 512, prompt_apart=True)
    a = make_req("a", 10, max_tokens=20)
    s.add_request(a)
    for _ in range(6):
        run_step(s)
    assert a.num_output_tokens == 6
    s._preempt(a)
    chunks = [(x.start, x.num_new_tokens) for x in run_step(s).scheduled]
    chunks += [(x.start, x.num_new_tokens) for x in run_step(s).scheduled]
    assert chunks == [(0, 10), (10, 6)]
    assert a.num_output_tokens == 7  # the output chunk reached the last token and sampled
