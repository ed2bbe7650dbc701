"""Unit tests of the engine's KV block pool and prefix cache (tessera_engine.kv_cache)."""
from __future__ import annotations

import pytest

from tessera_engine.kv_cache import KVCacheManager, KVCopy, PrefixHit
from tessera_engine.request import EngineCoreRequest, Sample
from tessera_engine.sampling_params import SamplingParams

from helpers.engine_requests import make_req

pytestmark = pytest.mark.unit


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
    assert kv.find_cached_prefix(a) == PrefixHit(([],), 0)
    assert kv.allocate(a, 12)
    # same first 12 tokens plus more: 3 cached blocks
    b = make_req("b", 15)
    hit = kv.find_cached_prefix(b)
    assert hit == PrefixHit((kv.block_table(a),), 12)
    # identical 12-token prompt: 2 whole blocks and 3 tokens of the third (copied), since
    # one token must be computed
    c = make_req("c", 12)
    assert kv.find_cached_prefix(c) == PrefixHit((kv.block_table(a)[:2],), 11, kv.block_table(a)[2], 3)
    # a different first block breaks the chain even if later tokens agree
    d = make_req("d", 12, start=1)
    assert kv.find_cached_prefix(d).num_tokens == 0


def test_prompt_logprobs_request_reads_no_cached_prefix():
    """Prompt logprobs need every prompt position computed, so such a request skips the cache
    (its blocks are still cached for the others)."""
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = make_req("a", 12, prompt_logprobs=1)
    assert kv.find_cached_prefix(a) == PrefixHit(([],), 0)
    assert kv.allocate(a, 12)
    assert kv.find_cached_prefix(make_req("b", 13, prompt_logprobs=1)) == PrefixHit(([],), 0)
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
    assert kv.find_cached_prefix(make_req("c2", 9)) == PrefixHit(([],), 0)


def test_partial_block_hit_copies_the_shared_start_of_the_next_block():
    """A prompt sharing 2 whole blocks and 2 tokens of the third with a cached one gets the 2
    blocks and a copy of those 2 slots into its own third block."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", 12)
    kv.allocate(a, 12)
    src = kv.block_table(a)[2]
    b = Sample(EngineCoreRequest("b", list(range(10)) + [50, 51, 52], SamplingParams()), 0, [2])
    hit = kv.find_cached_prefix(b)
    assert hit == PrefixHit((kv.block_table(a)[:2],), 10, src, 2)
    assert kv.allocate(b, 13 - 10, hit)
    table = kv.block_table(b)
    assert table[:2] == kv.block_table(a)[:2] and table[2] not in kv.block_table(a) and len(table) == 4
    assert kv.copy_for(b, hit) == KVCopy(src, table[2], 2)
    # a third prompt sharing 1 token of that block: the longest shared start wins
    c = Sample(EngineCoreRequest("c", list(range(9)) + [60, 61], SamplingParams()), 0, [2])
    assert kv.find_cached_prefix(c).copy_tokens == 1
    # no match past the first block boundary's tokens: nothing to copy
    d = Sample(EngineCoreRequest("d", list(range(8)) + [70, 71], SamplingParams()), 0, [2])
    assert kv.find_cached_prefix(d) == PrefixHit((kv.block_table(a)[:2],), 8)


def test_partial_hit_never_reads_a_block_copied_into_in_the_same_step():
    """A step's copies all read before any writes, so a prompt whose best source is another
    prompt's block filled by a copy in this same step reads from that copy's source instead,
    at most the copied tokens; in a later step the block is written and read directly."""
    kv = KVCacheManager(num_blocks=12, block_size=4)

    def admit(rid, tokens):
        r = Sample(EngineCoreRequest(rid, tokens, SamplingParams()), 0, [2])
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
    b = Sample(EngineCoreRequest("b", [0, 1, 2, 3, 4, 5, 90], SamplingParams()), 0, [2])
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
    assert kv.find_cached_prefix(Sample(EngineCoreRequest("e", [0, 1, 2, 3, 4, 5, 91], SamplingParams()),
                                         0, [2])).copy_from == hit.copy_from


def test_stats_usage():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate(make_req("a", 8), 8)
    assert kv.stats().usage == pytest.approx(0.5)



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


def test_with_outputs_apart_a_block_of_output_tokens_serves_only_the_sample_that_made_them():
    """Prompt rows on the dense matmul, output rows on the quantized one (outputs_apart): a
    block holding output tokens has other K/V than the same tokens in a prompt, so a prompt
    never hits it, whole or partly; the sample that made it (recomputing after a preemption)
    does."""
    kv = KVCacheManager(num_blocks=16, block_size=4, outputs_apart=True)
    a = make_req("a", 6)  # prompt 0..5: block 0 all prompt, block 1 half prompt
    assert kv.allocate(a, 6)
    a.num_computed_tokens = 6
    for t in (6, 7, 8, 9, 10):  # outputs that continue the count: 0..10
        a.append_output_token(t)
        assert kv.allocate(a, 1)
        a.num_computed_tokens += 1
    table = kv.block_table(a)
    # a prompt of the same tokens: block 0 only, and of block 1 the 2 tokens that were a's prompt
    b = make_req("b", 12)
    assert kv.find_cached_prefix(b) == PrefixHit(([table[0]],), 6, table[1], 2)
    # without outputs apart the same prompt takes blocks 0 and 1 whole
    plain = KVCacheManager(num_blocks=16, block_size=4)
    assert plain.allocate(a, 11) and plain.find_cached_prefix(b).num_tokens == 8
    # a itself, preempted and back: its own whole blocks, outputs included; a partial hit copies
    # prompt tokens only, so none into its third block (outputs only)
    kv.free(a)
    a.num_computed_tokens = 0
    assert kv.find_cached_prefix(a) == PrefixHit((table[:2],), 8)


def test_without_outputs_apart_block_hashes_name_tokens_only():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", 6)
    kv.allocate(a, 6)
    a.num_computed_tokens = 6
    a.append_output_token(6)
    a.append_output_token(7)
    b = make_req("b", 8)
    assert kv._block_hashes(a, 8) == kv._block_hashes(b, 8)
    apart = KVCacheManager(num_blocks=8, block_size=4, outputs_apart=True)
    assert apart._block_hashes(a, 8)[0] == kv._block_hashes(a, 8)[0]  # all prompt: the same hash
    assert apart._block_hashes(a, 8)[1] != apart._block_hashes(b, 8)[1]
