"""The weights a decode step streams, moved into one block of memory in the order it reads them.

At one row a step is bound by reading its weights: the default model's 96 MB, from an L3 that
holds most of it or from DRAM. Allocated one tensor at a time they lie scattered over 4 KB pages,
and every page is a TLB miss on the way; in one block advised to the kernel as huge pages (where
transparent huge pages are on for `madvise`, most Linux defaults) the step's stream crosses ~50
pages instead of ~24,000, and walks forward through memory from the first layer to the lm_head.
Measured on an Intel Xeon with AMX (a step's one-row int8 matmuls in engine order): 2.90 ms as
separate tensors, 2.79 in one block of 4 KB pages, 2.62 in one block of huge pages.
"""
from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_ALIGN = 64          # each tensor on a cache line of its own


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, contiguous) laid end to end, in this order, in one anonymous
    mapping aligned to a huge page and advised as huge pages; each copy keeps the mapping alive."""
    if not tensors:
        return []
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    # one huge page more than needed, so that the block can start on a huge page's boundary;
    # private (a shared anonymous mapping is shmem, which takes huge pages only where shmem does)
    block = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            block.madvise(advice)
        except OSError as e:  # a kernel without transparent huge pages: the block still helps
            log.debug("weight arena: no huge pages", extra={"error": str(e)})
    whole = torch.frombuffer(block, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    out = []
    for t, offset, size in zip(tensors, offsets, sizes):
        assert t.device.type == "cpu" and t.is_contiguous(), "weight arena: contiguous CPU tensors"
        copy = whole[start + offset:start + offset + size].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
    return out
