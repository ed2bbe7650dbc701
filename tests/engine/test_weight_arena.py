"""weight_arena.WeightArena: the repacked weights a decode step streams, copied end to end into one
block of memory (its start on a huge page, advised as huge pages) in the order they are put."""
from __future__ import annotations

import gc

import pytest
import torch

from tessera_engine import weight_arena

pytestmark = pytest.mark.unit


def test_copies_lie_end_to_end_in_order_each_on_its_own_cache_line():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 256, (n, 40), dtype=torch.uint8, generator=gen) for n in (3, 17, 1, 64)]
    parts.append(torch.randn(5, 7, generator=gen))  # another dtype keeps its shape and values
    arena = weight_arena.WeightArena(sum(p.numel() * p.element_size() + 64 for p in parts))
    moved = [arena.put(p) for p in parts]
    for src, dst in zip(parts, moved):
        assert dst.dtype == src.dtype and dst.shape == src.shape and torch.equal(dst, src)
        assert dst.data_ptr() != src.data_ptr() and dst.data_ptr() % 64 == 0
    assert moved[0].data_ptr() % weight_arena.HUGE_PAGE == 0
    for a, b in zip(moved, moved[1:]):  # the next one starts on the first cache line after
        end = a.data_ptr() + a.numel() * a.element_size()
        assert b.data_ptr() == -(-end // 64) * 64
    parts[1].zero_()  # copies, not views of the originals
    assert moved[1].any()


def test_a_copy_keeps_its_block_alive_and_what_does_not_fit_stays_where_it_is():
    def one():  # the arena object and the original go out of scope here
        arena = weight_arena.WeightArena(2000)
        arena.put(torch.full((1000,), 7, dtype=torch.uint8))
        return arena.put(torch.ones(200))

    kept = one()
    gc.collect()
    assert float(kept.sum()) == 200.0
    arena = weight_arena.WeightArena(100)
    big = torch.ones(weight_arena.HUGE_PAGE + 100, dtype=torch.uint8)  # past the capacity and its slack
    assert arena.put(big) is big
