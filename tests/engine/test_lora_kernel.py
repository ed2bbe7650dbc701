"""The batched LoRA kernel (csrc/lora.cpp, `lora_add`): y += scale * (x A^T) B^T for each row's
adapter slot, in place. Against a float64 torch reference in float32 and bfloat16, for fused
layers of 1, 2 and 3 sub-modules of unequal widths; rows without an adapter untouched bit for bit;
each row's result the same bits whatever batch, row order and thread count it is computed in;
the same bits from the scalar (generic) build; bad arguments refused, naming the argument."""
from __future__ import annotations

import pytest
import torch

from tessera_engine import cpu_kernels

K = cpu_kernels.load()
pytestmark = [pytest.mark.unit, pytest.mark.skipif(K is None, reason="fused CPU kernels could not be built here")]

DTYPES = [torch.float32, torch.bfloat16]
# sub-module bounds of a layer's output columns: one plain layer, gate/up-like, QKV-like; widths
# that are not multiples of 16 (masked vector tails) and a zero-width sub-module
LAYOUTS = [[0, 40], [0, 37, 100], [0, 64, 80, 101], [0, 0, 50]]


def lora_args(T, bounds, rank, dtype, *, S=3, n_in=70, seed=0, wdtype=torch.float32):
    """Random (y, x, a, b, slots, scales, bounds) for lora_add; slots in [-1, S); the adapter
    weights a and b in wdtype (the engine keeps them in bfloat16 when it computes in bfloat16)."""
    gen = torch.Generator().manual_seed(seed)
    subs, out = len(bounds) - 1, bounds[-1]
    y = torch.randn(T, out, generator=gen).to(dtype)
    x = torch.randn(T, n_in, generator=gen).to(dtype)
    a = (torch.randn(S, n_in, subs * rank, generator=gen) * 0.1).to(wdtype)
    b = (torch.randn(S, rank, out, generator=gen) * 0.1).to(wdtype)
    slots = torch.randint(-1, S, (T,), generator=gen, dtype=torch.int32)
    slots[0] = 0  # at least one row with an adapter, even at T = 1
    scales = torch.rand(S, subs, generator=gen) + 0.5
    return y, x, a, b, slots, scales, torch.tensor(bounds, dtype=torch.int64)


def reference(y, x, a, b, slots, scales, bounds):
    """y + scale * ((x A^T) B^T) per row and sub-module, in float64 (a holds A^T, b holds B^T)."""
    out = y.double().clone()
    subs = len(bounds) - 1
    rank = a.shape[2] // subs
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        h = x[t].double() @ a[s].double()
        for i in range(subs):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            out[t, lo:hi] += float(scales[s, i]) * (h[i * rank:(i + 1) * rank] @ b[s, :, lo:hi].double())
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", DTYPES)
@pytest.mark.parametrize("bounds", LAYOUTS)
@pytest.mark.parametrize("rank", [16, 32])
@pytest.mark.parametrize("T", [1, 5, 64, 300])
def test_lora_add_matches_the_float64_reference(dtype, wdtype, bounds, rank, T):
    y, x, a, b, slots, scales, bd = lora_args(T, bounds, rank, dtype, seed=T + rank, wdtype=wdtype)
    before = y.clone()
    want = reference(y, x, a, b, slots, scales, bd)
    K.lora_add(y, x, a, b, slots, scales, bd)
    assert y.dtype == dtype and y.shape == before.shape
    none = slots < 0
    assert torch.equal(y[none], before[none])  # no adapter: the base output, bit for bit
    # float32: the sums' rounding; bfloat16: the result's own rounding (half an ulp of |y| ~ 4)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * want.abs().max().item()
    assert (y.double() - want)[~none].abs().max().item() <= tol


def test_rows_without_an_adapter_are_left_alone():
    y, x, a, b, slots, scales, bd = lora_args(9, [0, 37, 100], 16, torch.bfloat16)
    y[0, 0] = float("nan")  # whatever is there stays
    slots.fill_(-1)
    before = y.clone()
    K.lora_add(y, x, a, b, slots, scales, bd)
    assert torch.equal(y.view(torch.int16), before.view(torch.int16))


def rows_alone(y, x, a, b, slots, scales, bd):
    """lora_add on each row by itself (T = 1)."""
    out = y.clone()
    for t in range(y.shape[0]):
        row = out[t:t + 1].clone()
        K.lora_add(row, x[t:t + 1], a, b, slots[t:t + 1], scales, bd)
        out[t] = row[0]
    return out


# (T, bounds, rank, n_in): small layers; and a QKV-shaped one with few rows, whose shrink and
# expand are shared out between the threads column by column (the kernel's other schedule)
INVARIANCE_CASES = [(37, [0, 40], 32, 70), (37, [0, 64, 80, 101], 32, 70), (12, [0, 576, 768, 960], 16, 576)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, bounds, rank, n_in", INVARIANCE_CASES)
def test_a_rows_result_does_not_depend_on_its_batch(dtype, T, bounds, rank, n_in):
    for wdtype in DTYPES:
        _check_invariance(dtype, T, bounds, rank, n_in, wdtype)


def _check_invariance(dtype, T, bounds, rank, n_in, wdtype):
    """Each row's sums run in one fixed order whatever the rows beside it, the tiles and groups
    they are cut into, the schedule and the threads: a request's output does not change with its
    batch."""
    y, x, a, b, slots, scales, bd = lora_args(T, bounds, rank, dtype, S=4, n_in=n_in, seed=7, wdtype=wdtype)
    if T > 20:
        slots[:20] = 2  # a slot with rows enough for whole groups and tiles, and a remainder
    else:
        slots[:] = 1  # one slot: one group, so the columns are shared out
        slots[2] = -1
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            full = y.clone()
            K.lora_add(full, x, a, b, slots, scales, bd)
            perm = torch.randperm(T, generator=torch.Generator().manual_seed(n))
            shuffled = y[perm].clone()
            K.lora_add(shuffled, x[perm].contiguous(), a, b, slots[perm].contiguous(), scales, bd)
            unshuffled = torch.empty_like(shuffled)
            unshuffled[perm] = shuffled
            assert torch.equal(full, rows_alone(y, x, a, b, slots, scales, bd))
            assert torch.equal(full, unshuffled)
            results.append(full)
        assert torch.equal(results[0], results[1])
        assert not torch.equal(results[0], y)  # it did add something
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_generic_build_gives_the_same_bits(dtype, generic_kernels):
    """The scalar path (std::fma, the same order) is the AVX-512 path's arithmetic exactly."""
    y, x, a, b, slots, scales, bd = lora_args(21, [0, 64, 80, 101], 16, dtype, seed=3, wdtype=dtype)
    native, generic = y.clone(), y.clone()
    K.lora_add(native, x, a, b, slots, scales, bd)
    generic_kernels.lora_add(generic, x, a, b, slots, scales, bd)
    assert torch.equal(native, generic)


def _bad(name):
    """A valid call's arguments with `name` broken, and the text the refusal must hold."""
    y, x, a, b, slots, scales, bd = lora_args(4, [0, 37, 100], 32, torch.float32)
    args = dict(y=y, x=x, a=a, b=b, slots=slots, scales=scales, bounds=bd)
    broken = {
        "y": lambda: y.t(),                                   # not contiguous
        "x": lambda: x[:3].contiguous(),                      # T differs from y's
        "x dtype": lambda: x.to(torch.bfloat16),              # dtype differs from y's
        "a": lambda: a[:, :10].contiguous(),                  # in differs from x's
        "a rank": lambda: a[:, :, :40].contiguous(),          # R 40: rank 20, not a multiple of 16
        "b": lambda: b[:, :, :99].contiguous(),               # out differs from y's
        "b dtype": lambda: b.to(torch.bfloat16),              # differs from a's
        "slots": lambda: slots.long(),                        # int64, not int32
        "slots range": lambda: torch.tensor([0, 3, 1, -1], dtype=torch.int32),  # slot 3 of S = 3
        "scales": lambda: scales[:, :1].contiguous(),         # one sub-module's, not two
        "bounds": lambda: torch.tensor([0, 37, 99]),          # does not end at out
        "bounds order": lambda: torch.tensor([0, 60, 50, 100]),  # decreasing (and 3 subs)
    }[name]()
    args[name.split()[0]] = broken
    return args, name.split()[0]


@pytest.mark.parametrize("name", ["y", "x", "x dtype", "a", "a rank", "b", "b dtype", "slots", "slots range",
                                  "scales", "bounds", "bounds order"])
def test_bad_arguments_are_refused_by_name(name):
    args, arg = _bad(name)
    before = args["y"].clone()
    with pytest.raises(RuntimeError, match=rf"^lora_add: {arg}\b"):
        K.lora_add(**args)
    if name != "y":
        assert torch.equal(args["y"], before)  # refused before writing anything
