"""weight_arena.gather: the repacked weights a decode step streams, copied end to end into one block
of memory (huge-page aligned, advised as huge pages) in the order given."""
from __future__ import annotations

import pytest
import torch

from tessera_engine import weight_arena

pytestmark = pytest.mark.unit


def test_copies_lie_end_to_end_in_order_each_on_its_own_cache_line():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 256, (n, 40), dtype=torch.uint8, generator=gen) for n in (3, 17, 1, 64)]
    parts.append(torch.randn(5, 7, generator=gen))  # another dtype keeps its shape and values
    moved = weight_arena.gather(parts)
    assert len(moved) == len(parts)
    for src, dst in zip(parts, moved):
        assert dst.dtype == src.dtype and dst.shape == src.shape and torch.equal(dst, src)
        assert dst.data_ptr() != src.data_ptr() and dst.data_ptr() % 64 == 0
    assert moved[0].data_ptr() % weight_arena.HUGE_PAGE == 0
    for a, b in zip(moved, moved[1:]):  # the next one starts on the first cache line after
        end = a.data_ptr() + a.numel() * a.element_size()
        assert b.data_ptr() == -(-end // 64) * 64
    parts[1].zero_()  # copies, not views of the originals
    assert moved[1].any()


def test_a_copy_keeps_its_block_alive_and_nothing_in_gives_nothing():
    import gc

    def one():  # the originals and the list of copies go out of scope here
        return weight_arena.gather([torch.full((1000,), 7, dtype=torch.uint8), torch.ones(300)])[1]

    kept = one()
    gc.collect()
    assert float(kept.sum()) == 300.0
    assert weight_arena.gather([]) == []
