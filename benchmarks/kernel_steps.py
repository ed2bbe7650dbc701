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

--quantized MODEL instead: each quantized matmul of MODEL's GGUF file (smollm2: the default
model, Q4_1 layers and a Q8_0 lm_head; gemma3: Gemma 3 270M's Q4_K_M file, Q5_0 / Q4_K / Q6_K /
Q8_0; llama1b: Llama-3.2-1B's shapes, every matrix Q4_0, as benchmarks/peers/random_llama.py writes
them) at 1 and 64 rows (--rows), as one decode step runs it: each layer's own weight (random blocks of
the file's type), so they stream from memory as in the engine. Per shape, microseconds a call
on the int8 matmul (qlinear_i8, repacked), the exact one (qlinear on the file's blocks) and
the dense bfloat16 one (linear_bf16), and the GB/s of the file's bytes the int8 one reads.
--prebuilt FILE times another build of the kernels (a module file, e.g. the code before a
change) for a before / after table.
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


# (name, N, K, ggml type, layers that have one): the matmuls of one decode step
QUANTIZED_SHAPES = {
    "smollm2": [("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, 3, LAYERS), ("o", HIDDEN, HIDDEN, 3, LAYERS),
                ("gate_up", 2 * INTER, HIDDEN, 3, LAYERS), ("down", HIDDEN, INTER, 3, LAYERS),
                ("lm_head", VOCAB, HIDDEN, 8, 1)],
    # Gemma 3 270M: hidden 640, 4 heads and 1 KV head of 256, intermediate 2048, 18 layers; half
    # the layers' v and ffn_down in the higher type (Q4_K_M's rule), q / k / gate / up in Q5_0
    "gemma3": [("q", 1024, 640, 6, 18), ("k / v", 256, 640, 6, 18), ("gate_up", 4096, 640, 6, 18),
               ("o", 640, 1024, 12, 18), ("down", 640, 2048, 12, 9), ("down", 640, 2048, 14, 9),
               ("lm_head", 262144, 640, 8, 1)],
    # Llama-3.2-1B's shapes (benchmarks/peers/random_llama.py's Q4_0 file: every matrix Q4_0, the
    # tied embedding too): hidden 2048, 32 heads and 8 KV heads of 64, intermediate 8192, 16 layers
    "llama1b": [("qkv", 3072, 2048, 2, 16), ("o", 2048, 2048, 2, 16), ("gate_up", 16384, 2048, 2, 16),
                ("down", 2048, 8192, 2, 16), ("lm_head", 128256, 2048, 2, 1)],
}
QTYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}
# ggml type -> (weights, bytes) of a block, and where its float16 scale fields lie
BLOCK_FORMAT = {2: (32, 18, (0,)), 3: (32, 20, (0, 2)), 6: (32, 22, (0,)), 8: (32, 34, (0,)),
                12: (256, 144, (0, 2)), 14: (256, 210, (208,))}


def random_blocks(n: int, k: int, qtype: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, row bytes] of random quants with float16 scales of a weight's size: the
    kernels' speed does not depend on the values, only on their being normal floats."""
    weights, nbytes, scales = BLOCK_FORMAT[qtype]
    raw = torch.randint(0, 256, (n, k // weights, nbytes), generator=gen, dtype=torch.uint8)
    for at in scales:
        raw[..., at:at + 2] = (torch.rand(n, k // weights, 1, generator=gen) * 1e-3 + 1e-4).half().view(torch.uint8)
    return raw.reshape(n, -1)


def quantized_step(k, model: str, rows: int, repeats: int, wait: float) -> list[dict]:
    """Per shape of QUANTIZED_SHAPES[model]: microseconds a call of each path at `rows` rows."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for name, n, kk, qt, layers in QUANTIZED_SHAPES[model]:
        raw = [random_blocks(n, kk, qt, gen) for _ in range(layers)]
        x = torch.randn(rows, kk, generator=gen).bfloat16()
        paths = {"int8": ([k.qrepack_i8(w, qt, kk) for w in raw], lambda w: k.qlinear_i8(x, w, qt, None)),
                 "exact": (raw, lambda w: k.qlinear(x, w, qt, None))}
        if hasattr(k, "pack_bf16_weight"):
            dense = [k.pack_bf16_weight((torch.randn(n, kk, generator=gen) * 0.02).bfloat16()) for _ in range(min(layers, 4))]
            dense = [dense[i % len(dense)] for i in range(layers)]  # (4 copies: enough to leave the caches)
            paths["bf16"] = (dense, lambda w: k.linear_bf16(x, w, n))
        row = {"name": name, "N": n, "K": kk, "type": QTYPE_NAMES[qt], "layers": layers, "rows": rows}
        wait_for_quiet(wait, log=log)
        for path, (weights, call) in paths.items():
            for w in weights:
                call(w)
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                for w in weights:
                    call(w)
                times.append((time.perf_counter() - t) / layers * 1e6)
            row[f"{path}_us"] = median(times)
        row["int8_gb_per_s"] = raw[0].numel() / row["int8_us"] / 1e3
        out.append(row)
        del raw, paths
    return out


def quantized_main(k, args) -> int:
    results = {"environment": environment(packages=("torch",)), "model": args.quantized,
               "kernels": getattr(k, "__file__", None), "steps": []}
    print(f"{args.quantized}: microseconds a call (median of {args.repeats}); kernels {results['kernels']}")
    print(f"{'matmul':8s} {'N x K':>13s} {'type':5s} {'rows':>4s} {'int8':>8s} {'exact':>8s} {'bf16':>8s} {'int8 GB/s':>9s}")
    for rows in args.rows:
        for r in quantized_step(k, args.quantized, rows, args.repeats, args.wait_quiet):
            results["steps"].append(r)
            print(f"{r['name']:8s} {r['N']:>6d} x {r['K']:<5d} {r['type']:5s} {rows:4d} {r['int8_us']:8.1f} "
                  f"{r['exact_us']:8.1f} {r.get('bf16_us', float('nan')):8.1f} {r['int8_gb_per_s']:9.1f}", flush=True)
        step = [r for r in results["steps"] if r["rows"] == rows]
        total = {p: sum(r[f"{p}_us"] * r["layers"] for r in step) / 1e3
                 for p in ("int8", "exact", "bf16") if f"{p}_us" in step[0]}
        print("one step's matmuls, ms: " + ", ".join(f"{p} {v:.2f}" for p, v in total.items()), flush=True)
        results[f"step_ms_{rows}"] = total
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    first = args.rows[0]  # --rows 16 alone has no 1-row step
    print(f"int8_step_{first}_ms={results[f'step_ms_{first}']['int8']:.3f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--wait-quiet", type=float, default=20.0,
                    help="before each measurement wait up to this many seconds for other processes to use "
                         "< 0.3 cores (0 = never wait)")
    ap.add_argument("--out", default=None, help="JSON results (default: results/kernel_steps[_quantized_MODEL].json)")
    ap.add_argument("--quantized", choices=sorted(QUANTIZED_SHAPES), default=None,
                    help="time the quantized matmuls of this model's file instead (see above)")
    ap.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",")], default=[1, 64],
                    help="with --quantized: the batch sizes timed (default 1,64)")
    ap.add_argument("--prebuilt", default=None, help="a build of the kernels to load instead of this tree's")
    args = ap.parse_args(argv)
    args.out = args.out or str(REPO / "results" / (f"kernel_steps_quantized_{args.quantized}.json" if args.quantized
                                                  else "kernel_steps.json"))
    k = cpu_kernels.load(args.prebuilt)
    if args.quantized:
        if k is None or not k.int8_matmul_available():
            log("tessera's CPU kernels with the int8 matmul did not load here")
            return 1
        return quantized_main(k, args)
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
