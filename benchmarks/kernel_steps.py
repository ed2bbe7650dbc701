"""A decode step's two big CPU kernels alone, at the default model's shapes (bf16).

- matmuls: one step's dense products, QKV, o, gate/up and down of 30 layers (each layer
  its own packed weight, so they come from DRAM as in the engine) and the tied lm_head,
  on linear_bf16, at 64 rows (a 64-request decode) and 512 rows (a full prefill step).
- attention: decode_attention over 30 layers' caches (2912 blocks of 16 each, 3 KV heads
  of 64, like the engine's 1 GiB pool), 64 rows with contexts of 40-170 positions, 8 MB
  written between layers as the weights would evict the cache. Two block placements:
  round-robin (what a fresh burst of requests growing together gets) and random (what
  a long-running server's free queue hands out).

Medians of --repeats. No baseline: absolute figures of tessera's kernels (built as the
engine builds them), for what a kernel change buys, compared with a run of the code before
it on the same machine. Last line: `matmul_64_ms=`.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

from tessera_engine import cpu_kernels

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import environment, log, wait_for_quiet  # noqa: E402

from tessera.bench.metrics import median  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 576, 1536, 9, 3, 64, 30, 49152
BLOCK, BLOCKS = 16, 2912


def matmul_step(k, rows: int, repeats: int) -> dict:
    shapes = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HIDDEN),
              "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
    gen = torch.Generator().manual_seed(0)
    weights = {name: [k.pack_bf16_weight((torch.randn(n, kk, generator=gen) * 0.02).bfloat16())
                      for _ in range(LAYERS)] for name, (n, kk) in shapes.items()}
    lm_head = k.pack_bf16_weight((torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).bfloat16())
    xs = {name: torch.randn(rows, kk, generator=gen).bfloat16() for name, (_, kk) in shapes.items()}

    def step():
        for layer in range(LAYERS):
            for name, (n, _) in shapes.items():
                k.linear_bf16(xs[name], weights[name][layer], n)
        k.linear_bf16(xs["o"], lm_head, VOCAB)

    step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    flops = 2 * rows * (LAYERS * sum(n * kk for n, kk in shapes.values()) + VOCAB * HIDDEN)
    ms = median(times)
    return {"rows": rows, "ms": ms, "gflops": flops / ms / 1e6, "runs_ms": times}


def attention_step(k, placement: str, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    rows = 64
    caches = [(torch.randn(BLOCKS * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16(),
               torch.randn(BLOCKS * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()) for _ in range(LAYERS)]
    lens = torch.randint(40, 170, (rows,), generator=gen)
    per_row = [(int(n) + BLOCK - 1) // BLOCK for n in lens]
    tables = torch.zeros(rows, max(per_row), dtype=torch.long)
    order = torch.randperm(BLOCKS, generator=gen)
    used = 0
    for i, nb in enumerate(per_row):
        if placement == "random":
            tables[i, :nb] = order[used:used + nb]
            used += nb
        else:  # block j of row i: the j-th of the blocks the 64 rows took in turn
            tables[i, :nb] = torch.arange(nb) * rows + i
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).bfloat16()
    evict = torch.empty(8 << 20, dtype=torch.uint8)
    scale = HEAD_DIM ** -0.5

    def step() -> float:
        spent = 0.0
        for kc, vc in caches:
            evict.add_(1)
            t = time.perf_counter()
            k.decode_attention(q, kc, vc, tables, lens, scale, BLOCK, 0)
            spent += time.perf_counter() - t
        return spent * 1e3

    step()
    times = [step() for _ in range(repeats)]
    ms = median(times)
    kv_bytes = int(lens.sum()) * LAYERS * KV_HEADS * HEAD_DIM * 2 * 2
    return {"placement": placement, "ms": ms, "gb_per_s": kv_bytes / ms / 1e6, "runs_ms": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--wait-quiet", type=float, default=20.0,
                    help="before each measurement wait up to this many seconds for other processes to use "
                         "< 0.3 cores (0 = never wait)")
    ap.add_argument("--out", default=str(REPO / "results" / "kernel_steps.json"))
    args = ap.parse_args(argv)
    k = cpu_kernels.load()
    if k is None or not hasattr(k, "linear_bf16"):
        log("tessera's CPU kernels did not load here")
        return 1
    results = {"environment": environment(packages=("torch",)), "matmul": [], "attention": []}
    for rows in (64, 512):
        wait_for_quiet(args.wait_quiet, log=log)
        r = matmul_step(k, rows, args.repeats)
        results["matmul"].append(r)
        print(f"matmuls, {rows:3d} rows: {r['ms']:7.2f} ms a step, {r['gflops']:5.0f} GFLOPS", flush=True)
    for placement in ("round-robin", "random"):
        wait_for_quiet(args.wait_quiet, log=log)
        r = attention_step(k, placement, args.repeats)
        results["attention"].append(r)
        print(f"attention, 64 rows, blocks {placement:11s}: {r['ms']:6.2f} ms a step, K/V read at "
              f"{r['gb_per_s']:4.1f} GB/s", flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"matmul_64_ms={results['matmul'][0]['ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
