"""The fused CPU kernels (tessera_engine/csrc/) against the torch ops they
replace, in float32 and bfloat16; and the engine with them against the engine without
them (TESSERA_CPU_KERNELS=0's path) on a small random Llama.

Each kernel is checked twice: in the build for this CPU (-march=native, its AVX-512
paths here) and in the image's baseline variant ("generic", built by `--variants`:
the scalar paths a CPU without AVX-512 runs). The variant choice is checked on
/proc/cpuinfo flag sets of real CPU generations."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from tessera_engine import cpu_kernels
from tessera_engine.models.rotary import apply_rotary_signed

from helpers.engine_fixtures import tiny_hf_llama, tiny_loaded

K = cpu_kernels.load()
pytestmark = [pytest.mark.unit, pytest.mark.skipif(K is None, reason="fused CPU kernels could not be built here")]

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=["native", "generic"])
def kernels(request):
    return K if request.param == "native" else request.getfixturevalue("generic_kernels")


def _ref_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
# g = 3, 1, 4, 2, 16 (a group size of 1-8 keeps its sums in registers, more takes the general
# loop), 48 the scalar path
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (10, 5, 64), (16, 1, 64),
                                                     (6, 2, 48)])
# 11 rows: a work item a sequence, its blocks' rows one range; 1 row: one a KV head
@pytest.mark.parametrize("n", [11, 1])
def test_decode_attention_matches_reference(dtype, heads, kv_heads, head_dim, n, kernels):
    torch.manual_seed(0)
    bs, num_blocks = 16, 400
    k_cache = torch.randn(num_blocks * bs, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, head_dim).to(dtype)
    lens = torch.tensor([1, 2, 15, 16, 17, 33, 100, 160, 5, 64, 250])[-n:]
    max_blocks = int(-(-lens.max() // bs))
    tables = torch.randperm(num_blocks)[:n * max_blocks].view(n, max_blocks).contiguous()
    # q as the model passes it: a view of the fused projection (row stride > heads * head_dim)
    q = torch.randn(n, heads + 2 * kv_heads, head_dim).to(dtype)[:, :heads]
    scale = head_dim ** -0.5
    out = kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale, bs)
    assert out.shape == (n, heads, head_dim) and out.dtype == dtype
    g = heads // kv_heads
    for i in range(n):
        slots = (tables[i].unsqueeze(1) * bs + torch.arange(bs)).flatten()[:int(lens[i])]
        k = k_cache[slots].float().transpose(0, 1).repeat_interleave(g, 0)
        v = v_cache[slots].float().transpose(0, 1).repeat_interleave(g, 0)
        s = (q[i].float().unsqueeze(1) @ k.transpose(1, 2)) * scale
        ref = (s.softmax(-1) @ v).squeeze(1)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[i].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 16, 20, 100])
def test_decode_attention_with_a_sliding_window_attends_the_last_positions_only(dtype, window, kernels):
    """Each row attends positions [len - window, len): the first block read is the one holding
    len - window (blocks before it may be freed: they are given as garbage ids here)."""
    torch.manual_seed(3)
    heads, kv_heads, head_dim, bs, num_blocks = 9, 3, 64, 16, 200
    k_cache = torch.randn(num_blocks * bs, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, head_dim).to(dtype)
    lens = torch.tensor([1, 2, 15, 16, 17, 21, 33, 100, 160, 250])
    n, max_blocks = len(lens), int(-(-lens.max() // bs))
    tables = torch.randperm(num_blocks)[:n * max_blocks].view(n, max_blocks).contiguous()
    freed = tables.clone()
    for i, L in enumerate(lens.tolist()):  # what the window let go must not be read
        freed[i, :max(0, L - window) // bs] = 10 ** 9
    q = torch.randn(n, heads, head_dim).to(dtype)
    out = kernels.decode_attention(q, k_cache, v_cache, freed, lens, head_dim ** -0.5, bs, window)
    g = heads // kv_heads
    for i, L in enumerate(lens.tolist()):
        slots = (tables[i].unsqueeze(1) * bs + torch.arange(bs)).flatten()[max(0, L - window):L]
        k = k_cache[slots].float().transpose(0, 1).repeat_interleave(g, 0)
        v = v_cache[slots].float().transpose(0, 1).repeat_interleave(g, 0)
        s = (q[i].float().unsqueeze(1) @ k.transpose(1, 2)) * head_dim ** -0.5
        ref = (s.softmax(-1) @ v).squeeze(1)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[i].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_attention_with_a_sliding_window_matches_torch_attention(dtype, kernels):
    """A mixed step under a 20-token window, blocks outside it freed (FREED_BLOCK): the kernel
    backend against the torch backend's masked SDPA and decode paths."""
    from tessera_engine.attention import CpuKernelAttention, DecodeEntry, PagedAttention, PrefillChunk, TorchAttention
    from tessera_engine.kv_cache import FREED_BLOCK as F_

    torch.manual_seed(4)
    bs, heads, kv_heads, d, window = 16, 9, 3, 64, 20
    layer = PagedAttention(heads, kv_heads, d)
    k_cache = torch.randn(64 * bs, kv_heads, d).to(dtype)
    v_cache = torch.randn(64 * bs, kv_heads, d).to(dtype)
    decodes = [DecodeEntry([3, 9], 20), DecodeEntry([F_, 8, 11], 40), DecodeEntry([F_, 10, 12, 13], 50)]
    chunks, q_start = [], len(decodes)
    for start, end, table in [(0, 37, [20, 21, 22]), (50, 70, [F_, 31, 32, 33, 34]), (0, 16, [40])]:
        chunks.append(PrefillChunk(q_start, start, end, table))
        q_start += end - start
    q = torch.randn(q_start, heads, d).to(dtype)
    outs = []
    for backend in (CpuKernelAttention(kernels, bs, kv_heads, dtype, torch.device("cpu")),
                    TorchAttention(bs, kv_heads, dtype, torch.device("cpu"))):
        meta = backend.build_metadata(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                                      decodes, chunks, window)
        outs.append(backend.forward(layer, q, k_cache, v_cache, meta).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
    # and the window matters: full attention gives other rows
    full = TorchAttention(bs, kv_heads, dtype, torch.device("cpu"))
    meta = full.build_metadata(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                               [], [PrefillChunk(0, 0, 37, [20, 21, 22])])
    unwindowed = full.forward(layer, q[3:40], k_cache, v_cache, meta).float()
    torch.testing.assert_close(unwindowed[:20], outs[1][3:23], atol=tol, rtol=tol)  # within the window
    assert not torch.allclose(unwindowed[36], outs[1][39], atol=0.1)  # past it


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_attention_of_a_mixed_step_matches_torch_attention(dtype, kernels):
    """One step holding decodes, a fresh prompt, a chunk continuing a cached context and a
    one-block prompt: the kernel backend (every token attends as a decode of its position)
    against the torch backend (padded SDPA groups with a causal mask), layer output rows."""
    from tessera_engine.attention import CpuKernelAttention, DecodeEntry, PagedAttention, PrefillChunk, TorchAttention

    torch.manual_seed(1)
    bs, heads, kv_heads, d = 16, 9, 3, 64
    layer = PagedAttention(heads, kv_heads, d)
    k_cache = torch.randn(64 * bs, kv_heads, d).to(dtype)
    v_cache = torch.randn(64 * bs, kv_heads, d).to(dtype)
    decodes = [DecodeEntry([3, 9], 20), DecodeEntry([5], 1), DecodeEntry([7, 8, 11], 40)]
    chunks, q_start = [], len(decodes)
    for start, end, table in [(0, 37, [20, 21, 22]), (32, 70, [30, 31, 32, 33, 34]), (0, 16, [40])]:
        chunks.append(PrefillChunk(q_start, start, end, table))
        q_start += end - start
    q = torch.randn(q_start, heads, d).to(dtype)
    outs = []
    for backend in (CpuKernelAttention(kernels, bs, kv_heads, dtype, torch.device("cpu")),
                    TorchAttention(bs, kv_heads, dtype, torch.device("cpu"))):
        meta = backend.build_metadata(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                                      decodes, chunks)
        outs.append(backend.forward(layer, q, k_cache, v_cache, meta).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_residual_add(dtype, kernels):
    torch.manual_seed(1)
    x, res, w = torch.randn(13, 576).to(dtype), torch.randn(13, 576).to(dtype), torch.randn(576).to(dtype)
    exact = dtype == torch.bfloat16  # float32: summation order differs by an ulp
    tol = {} if exact else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), _ref_rms_norm(x, w, 1e-5), **(tol or {"atol": 0, "rtol": 0}))
    res2 = res.clone()
    out = kernels.add_rms_norm_(x, res2, w, 1e-5)
    assert torch.equal(res2, res + x)  # the residual stream holds the rounded sum
    torch.testing.assert_close(out, _ref_rms_norm(res + x, w, 1e-5), **(tol or {"atol": 0, "rtol": 0}))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, kernels):
    torch.manual_seed(2)
    gu = (torch.randn(7, 2 * 1536) * 6).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    ref = F.silu(gu[:, :1536]) * gu[:, 1536:]
    if dtype == torch.bfloat16:
        assert torch.equal(kernels.silu_and_mul(gu), ref)
    else:
        torch.testing.assert_close(kernels.silu_and_mul(gu), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [64, 256, 48])  # AVX-512: 64 and 256 take the vector path, 48 the scalar loop
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache_rotates_q_k_and_writes_the_cache(dtype, d, kernels):
    torch.manual_seed(3)
    T, H, KVH = 9, 6, 2
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(torch.arange(512).float(), inv)] * 2, dim=-1)
    cos = emb.cos().to(dtype)
    sin = (emb.sin() * torch.cat([-torch.ones(d // 2), torch.ones(d // 2)])).to(dtype)
    qkv = torch.randn(T, (H + 2 * KVH) * d).to(dtype)
    pos = torch.randint(0, 512, (T,))
    slots = torch.randperm(64)[:T]
    ref = apply_rotary_signed(qkv[:, :(H + KVH) * d].view(T, H + KVH, d), cos[pos].unsqueeze(1),
                              sin[pos].unsqueeze(1))
    v_ref = qkv[:, (H + KVH) * d:].view(T, KVH, d).clone()
    k_cache, v_cache = torch.zeros(64, KVH, d, dtype=dtype), torch.zeros(64, KVH, d, dtype=dtype)
    kernels.rope_and_cache_(qkv, pos, cos, sin, k_cache, v_cache, slots, H, KVH, d)
    assert torch.equal(qkv[:, :H * d].view(T, H, d), ref[:, :H])
    assert torch.equal(k_cache[slots], ref[:, H:])
    assert torch.equal(v_cache[slots], v_ref)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_matches_torch_ties_nan_and_inf(dtype, kernels):
    torch.manual_seed(4)
    x = torch.randn(6, 49157).to(dtype)  # a width that is not a multiple of 16
    x[1, 9] = x[1, 20000] = x[1].max() + 1  # a tie: the first index wins
    x[2, 30000] = float("nan")
    x[2, 49156] = float("nan")
    x[3] = float("-inf")
    x[4, 49156] = 1e4  # the maximum in the scalar tail
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))


def test_bad_input_is_refused_with_a_clear_error(kernels):
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        kernels.rms_norm(torch.zeros(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="weight has 3 elements, rows have 4"):
        kernels.rms_norm(torch.zeros(2, 4), torch.ones(3), 1e-5)
    with pytest.raises(RuntimeError, match="residual and input shapes differ"):
        kernels.add_rms_norm_(torch.zeros(2, 4), torch.zeros(3, 4), torch.ones(4), 1e-5)
    q, cache = torch.zeros(1, 2, 8), torch.zeros(16, 2, 8)
    with pytest.raises(RuntimeError, match="context length 17 does not fit its block table"):
        kernels.decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([17]), 1.0, 16)
    with pytest.raises(RuntimeError, match="one block table row and one context length per query"):
        kernels.decode_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.long), torch.tensor([1]), 1.0, 16)
    with pytest.raises(RuntimeError, match="one position and one cache slot per token"):
        kernels.rope_and_cache_(torch.zeros(2, 32), torch.zeros(1, dtype=torch.long), torch.zeros(4, 8),
                                torch.zeros(4, 8), cache, cache, torch.zeros(2, dtype=torch.long), 2, 1, 8)
    with pytest.raises(RuntimeError, match="int64"):
        kernels.decode_attention(torch.zeros(1, 2, 8), torch.zeros(16, 2, 8), torch.zeros(16, 2, 8),
                                 torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.long), 1.0, 16)


def test_kernels_run_without_the_gil():
    """Another Python thread runs while a kernel computes: the engine service's gRPC thread
    takes in requests and sends outputs during the core thread's kernels instead of
    waiting for them. A held GIL shows as one gap in the other thread's ticks as long as
    the whole call."""
    torch.manual_seed(2)
    bs, heads, kv_heads, d, n, ctx = 16, 8, 2, 64, 256, 2048
    k_cache, v_cache = torch.randn(ctx, kv_heads, d), torch.randn(ctx, kv_heads, d)
    tables = torch.arange(ctx // bs).repeat(n, 1)  # every query reads the same 2048 cached tokens
    lens = torch.full((n,), ctx)
    q = torch.randn(n, heads, d)
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = 0.0
        while not stop.is_set():
            now = time.perf_counter()
            if now - last >= 0.0002:
                ticks.append(now)
                last = now

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    worst = []
    try:
        time.sleep(0.02)
        for _ in range(3):
            t0 = time.perf_counter()
            K.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, bs)
            t1 = time.perf_counter()
            inside = [t0, *(t for t in list(ticks) if t0 < t < t1), t1]
            worst.append(max(b - a for a, b in zip(inside, inside[1:])) / (t1 - t0))
    finally:
        stop.set()
        ticker.join()
    # the longest pause of the ticking thread, as a fraction of the call (1.0: it never ran)
    assert min(worst) < 0.5, worst


def test_tiles_taken_by_any_thread_give_the_same_results():
    """The matmuls and decode attention cut their work into tiles that the team's threads take
    from shared runs, a thread taking the rest of another's run when that one is preempted
    (tile_queue.h). Whichever thread computes a tile, every output is computed once and the
    same: one thread, two, and two sharing the cores with a busy process give equal results."""
    import gguf
    import numpy as np

    gen = torch.Generator().manual_seed(7)
    calls = []
    # decode attention: 64 rows of uneven contexts, and 1 row (a work item a KV head)
    bs, kvh, d = 16, 3, 64
    k_cache, v_cache = (torch.randn(400 * bs, kvh, d, generator=gen).bfloat16() for _ in range(2))
    for n in (64, 1):
        lens = torch.randint(1, 300, (n,), generator=gen)
        tables = torch.randint(0, 400, (n, 19), generator=gen)  # rows may share blocks: read only
        q = torch.randn(n, 9, d, generator=gen).bfloat16()
        calls.append(lambda q=q, t=tables, ln=lens: K.decode_attention(q, k_cache, v_cache, t, ln, d ** -0.5, bs))
    if K.int8_matmul_available():  # Q4_1 weights on int8 dot products: 64 rows, and 1 (many groups a tile)
        w = np.random.default_rng(0).standard_normal((1536, 576)).astype(np.float32) * 0.05
        packed = K.qrepack_i8(torch.from_numpy(gguf.quantize(w, gguf.GGMLQuantizationType.Q4_1)), 3, 576)
        for rows in (64, 1):
            x = torch.randn(rows, 576, generator=gen).bfloat16()
            calls.append(lambda x=x: K.qlinear_i8(x, packed, 3, None))
    from tessera_engine.models.packed_linear import BrgemmPacking
    if BrgemmPacking.checked(K) is not None:  # bfloat16 on oneDNN's micro-kernel, 200 rows: 4 x 24 tiles
        wb = K.pack_bf16_weight(torch.randn(1536, 576, generator=gen).bfloat16())
        xb = torch.randn(200, 576, generator=gen).bfloat16()
        calls.append(lambda: K.linear_bf16(xb, wb, 1536, None))

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [f() for f in calls]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.isfinite(o.float()).all() for o in alone)
    for _ in range(30):
        for f, want in zip(calls, alone):
            assert torch.equal(f(), want), f
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        end = time.monotonic() + 1.0  # the hog's scheduler slices fall inside many calls
        while time.monotonic() < end:
            for f, want in zip(calls, alone):
                assert torch.equal(f(), want), f
    finally:
        hog.kill()
        hog.wait()


def test_kernels_called_from_two_threads_give_the_same_results():
    """The kernels' helper threads are one process-wide pool (tile_queue.h): a second Python
    thread calling a kernel while the pool is busy with another's computes it alone; each call
    gives the results of a lone call, and none waits forever."""
    gen = torch.Generator().manual_seed(11)
    bs, kvh, d, n = 16, 3, 64, 48
    k_cache, v_cache = (torch.randn(300 * bs, kvh, d, generator=gen).bfloat16() for _ in range(2))
    lens = torch.randint(1, 250, (n,), generator=gen)
    tables = torch.randint(0, 300, (n, 16), generator=gen)
    q = torch.randn(n, 9, d, generator=gen).bfloat16()
    x, w = torch.randn(300, 576, generator=gen).bfloat16(), torch.randn(576, generator=gen).bfloat16()

    def call():
        return K.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, bs), K.rms_norm(x, w, 1e-5)

    want = call()
    failures: list[str] = []

    def hammer() -> None:
        for _ in range(200):
            got = call()
            if not all(torch.equal(g, e) for g, e in zip(got, want)):
                failures.append("different")

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a kernel call never returned"
    assert not failures


@pytest.mark.parametrize("dtype", ["float32"])
def test_engine_with_kernels_equals_engine_with_torch_ops(dtype):
    """The same greedy tokens with the fused kernels and with the plain torch ops (a mixed
    batch: prefills, chunked prefill and decodes in one step). float32 only: in bfloat16
    the kernel keeps attention probabilities in float32 where the torch path rounds them,
    which flips near-ties of a random model (each kernel's bf16 rounding is tested above)."""
    from tessera_engine.config import EngineConfig
    from tessera_engine.core import EngineCore
    from tessera_engine.request import EngineCoreRequest
    from tessera_engine.sampling_params import SamplingParams

    cfg, hf = tiny_hf_llama(hidden_size=128, intermediate_size=256, num_layers=2, max_len=256, seed=5)
    tdtype = getattr(torch, dtype)
    prompts = [[int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 40, 17, 90, 5, 64)]

    def run(kernels_on: bool) -> list[list[int]]:
        core = EngineCore(EngineConfig(model="tiny", dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=48,
                                       block_size=16, cpu_kernels=kernels_on), tiny_loaded(cfg, hf, dtype=tdtype))
        assert core.executor.runner.ops.name == ("cpu_kernels" if kernels_on else "torch")
        assert core.executor.runner.attention.name == ("cpu_kernels" if kernels_on else "torch")
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24,
                                                                          ignore_eos=True)))
        out: dict[str, list[int]] = {}
        while core.has_unfinished():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [out[f"r{i}"] for i in range(len(prompts))]

    with_kernels, without = run(True), run(False)
    assert all(len(t) == 24 for t in with_kernels)
    assert with_kernels == without


def test_cpu_kernels_flag_and_env(monkeypatch):
    """--cpu-kernels (env TESSERA_CPU_KERNELS) reaches EngineConfig; nothing else reads the env."""
    from tessera_engine.server import config_from_args, parse_args

    monkeypatch.delenv("TESSERA_CPU_KERNELS", raising=False)
    monkeypatch.delenv("TESSERA_CPU_KERNELS_PREBUILT", raising=False)
    assert config_from_args(parse_args([])).cpu_kernels is True
    assert config_from_args(parse_args(["--cpu-kernels", "false"])).cpu_kernels is False
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("TESSERA_CPU_KERNELS", off)
        assert config_from_args(parse_args([])).cpu_kernels is False
    monkeypatch.setenv("TESSERA_CPU_KERNELS_PREBUILT", "/opt/k")
    assert config_from_args(parse_args([])).cpu_kernels_prebuilt == "/opt/k"


# /proc/cpuinfo flags (the instruction-set part) of a few CPU generations
_HASWELL = frozenset("fpu sse sse2 pni ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm movbe xsave avx f16c fma "
                     "abm bmi1 avx2 bmi2".split())
_SKYLAKE_SP = _HASWELL | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
_SAPPHIRE_RAPIDS = _SKYLAKE_SP | {"avx512_bf16", "avx512_vnni", "amx_tile"}
_NEHALEM = frozenset("fpu sse sse2 pni ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm".split())


def test_prebuilt_variant_is_the_most_capable_this_cpu_runs():
    every = cpu_kernels.buildable_variants("x86_64")
    assert every == ["avx512bf16", "avx512", "avx2", "generic"]
    choose = cpu_kernels.choose_variant
    assert choose(every, _SAPPHIRE_RAPIDS) == "avx512bf16"
    assert choose(every, _SKYLAKE_SP) == "avx512"  # AVX-512 without BF16 (most cloud Xeons)
    assert choose(every, _HASWELL) == "avx2"
    assert choose(every, _NEHALEM) == "generic"
    assert choose(every, frozenset()) == "generic"  # no /proc/cpuinfo: the baseline
    assert choose(["avx2"], _NEHALEM) is None  # nothing here runs on that CPU
    assert choose(["avx2", "generic"], _SAPPHIRE_RAPIDS) == "avx2"
    assert cpu_kernels.buildable_variants("aarch64") == ["generic"]  # no x86-64 levels there
    # this machine: its own flags choose a variant it runs (the native build is what it runs now)
    assert choose(every, cpu_kernels.cpu_flags()) in every


def test_prebuilt_directory_without_a_runnable_variant_is_refused(tmp_path, monkeypatch):
    (tmp_path / "tessera_cpu_kernels_avx512bf16.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: _HASWELL)
    with pytest.raises(RuntimeError, match="no build of the CPU kernels this CPU can run"):
        cpu_kernels._load_prebuilt(str(tmp_path))


def test_variants_without_a_directory_is_a_usage_error():
    for argv in (["--variants"], ["--variants", "--require"]):
        done = subprocess.run([sys.executable, "-m", "tessera_engine.cpu_kernels", *argv],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "--variants needs the directory to build into" in done.stderr, done


def _brgemm_packing(kernels):
    from tessera_engine.models.packed_linear import BrgemmPacking

    packing = BrgemmPacking.checked(kernels)
    if packing is None:
        pytest.skip("oneDNN's bf16 brgemm micro-kernel does not run on this CPU")
    return packing


@pytest.mark.parametrize("rows", [1, 7, 64, 65, 200])
@pytest.mark.parametrize("n,k,bias", [(100, 96, True), (576, 576, False), (130, 1536, True)])
def test_linear_bf16_is_the_float32_product_rounded_once(rows, n, k, bias, kernels):
    """The float32 product (+ bias) rounded to bfloat16 once: almost every element equal to
    it, the rest where the float32 sums, taken in another order, round the other way; for
    row counts within one tile, over one and several tiles, and column counts short of a
    whole block."""
    _brgemm_packing(kernels)
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    got = kernels.linear_bf16(x, kernels.pack_bf16_weight(w), n, b)
    exact = F.linear(x.float(), w.float(), b.float() if bias else None)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert (got == exact.bfloat16()).float().mean() > 0.98
    # one bfloat16 rounding, plus float32 summation-order slack where terms cancel
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-4 * k)


def test_linear_bf16_reads_rows_of_a_wider_tensor(kernels):
    """x may be a column slice of a wider tensor (rows further apart than K), as a fused
    projection's output is sliced; zero rows give an empty result."""
    _brgemm_packing(kernels)
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(9, 200, generator=gen).bfloat16()
    x = wide[:, 40:136]
    w = torch.randn(70, 96, generator=gen).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    assert torch.equal(kernels.linear_bf16(x, packed, 70), kernels.linear_bf16(x.contiguous(), packed, 70))
    assert kernels.linear_bf16(x[:0], packed, 70).shape == (0, 70)


def test_linear_bf16_refuses_bad_input(kernels):
    w = torch.zeros(64, 96, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="K must be even"):
        kernels.pack_bf16_weight(torch.zeros(8, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="W must be bfloat16"):
        kernels.pack_bf16_weight(torch.zeros(8, 4))
    packed = kernels.pack_bf16_weight(w)
    with pytest.raises(RuntimeError, match="x has K=32, the packed weight 96"):
        kernels.linear_bf16(torch.zeros(2, 32, dtype=torch.bfloat16), packed, 64)
    with pytest.raises(RuntimeError, match="N=65 does not fit the packed weight"):
        kernels.linear_bf16(torch.zeros(2, 96, dtype=torch.bfloat16), packed, 65)
    with pytest.raises(RuntimeError, match="bias must have N elements"):
        kernels.linear_bf16(torch.zeros(2, 96, dtype=torch.bfloat16), packed, 64, torch.zeros(3))
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        kernels.linear_bf16(torch.zeros(2, 96), packed, 64)


def test_bf16_engine_packs_its_weights_once_for_the_brgemm_matmul():
    """On a CPU where the micro-kernel runs, a bfloat16 engine's linear layers are packed for
    it and hold no other dense copy; the greedy tokens equal those of oneDNN's own matmul on
    a tiny model (whose logits have no near-ties at this size)."""
    from tessera_engine.models.llama import Linear
    from tessera_engine.models.packed_linear import ONEDNN, BrgemmPacking

    from tessera_engine.config import EngineConfig
    from tessera_engine.core import EngineCore
    from tessera_engine.request import EngineCoreRequest
    from tessera_engine.sampling_params import SamplingParams

    _brgemm_packing(K)
    cfg, hf = tiny_hf_llama(hidden_size=128, intermediate_size=256, num_layers=2, max_len=256, seed=5)
    prompts = [[int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 40, 90)]

    def run(core) -> list[list[int]]:
        reqs = [EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
                for i, p in enumerate(prompts)]
        out = core.generate(reqs)
        return [out[(f"r{i}", 0)] for i in range(len(prompts))]

    def make():
        return EngineCore(EngineConfig(model="tiny", dtype="bfloat16", num_kv_blocks=64, block_size=16),
                          tiny_loaded(cfg, hf, dtype=torch.bfloat16))

    core = make()
    assert core.executor.runner.ops.dense_packing.name == "brgemm"
    linears = [m for m in core.executor.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m._pw.frozen and m._pw.packing.name == "brgemm" and m.weight.numel() == 0
                           for m in linears)
    with_brgemm = run(core)
    checked = BrgemmPacking.checked
    try:
        BrgemmPacking.checked = classmethod(lambda cls, kernels: None)
        core = make()
        assert core.executor.runner.ops.dense_packing is ONEDNN
        with_onednn = run(core)
    finally:
        BrgemmPacking.checked = checked
    assert with_brgemm == with_onednn
