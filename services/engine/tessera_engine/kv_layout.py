"""How a model's layers share the one paged KV pool: KV cache groups (vLLM v1's hybrid
allocator, its KV cache groups).

Layers that attend alike (full attention, or one sliding window) need the same blocks at the
same times, so one block table serves them all: such a set of layers is a group. A block of the
pool is one page: `tensors` cache tensors' worth of block_size slots, and a group's block
holds its layers' K/V, layer j of the group in pool tensor j. A model whose layers all attend
alike is one group over all its layers (a page = every layer's block, as before). A model that
mixes attention types (Gemma 2/3: sliding-window and global layers) splits each type's layers
into groups of as many layers as its rarest type has, so that every page has one size: Gemma 3
270M (15 sliding, 3 global layers) is five sliding groups and one global group of three layers
each. Each group keeps its own block tables: a sliding group frees blocks behind its window
while the global one keeps them, and a 4k-token request holds ~window tokens' worth of pages
for each sliding group, not 4k.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KVGroup:
    window: int | None       # each token attends its last `window` positions; None: all of them
    layers: tuple[int, ...]  # the model's layer indices, in order (layer j uses pool tensor j)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    tensors: int                # cache tensor pairs in the pool: the layers of the largest group
    layer_group: tuple[int, ...]   # per model layer: its group
    layer_tensor: tuple[int, ...]  # per model layer: the pool tensor its K/V lives in

    @property
    def windows(self) -> list[int | None]:
        return [g.window for g in self.groups]

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1


def plan_kv_layout(windows: list[int | None]) -> KVLayout:
    """The groups for a model whose layer i attends with windows[i] (None: full attention)."""
    if not windows:
        raise ValueError("a model needs at least one layer")
    by_kind: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        by_kind.setdefault(w, []).append(i)
    size = min(len(layers) for layers in by_kind.values())
    groups = []
    for window, layers in by_kind.items():  # in order of each kind's first layer
        for start in range(0, len(layers), size):
            groups.append(KVGroup(window, tuple(layers[start:start + size])))
    layer_group = [0] * len(windows)
    layer_tensor = [0] * len(windows)
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            layer_group[layer], layer_tensor[layer] = g, j
    return KVLayout(tuple(groups), max(len(g.layers) for g in groups), tuple(layer_group), tuple(layer_tensor))
