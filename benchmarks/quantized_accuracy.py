"""What the int8 quantized matmul costs in accuracy, against llama.cpp's own on the same file.

A benchmark, not a test. On the default GGUF (or --model), for --prompts chat prompts (the
64 questions of common.py, then styled copies), the next-token distribution at the end of
each prompt, computed by:

  reference     tessera in float32 with the exact quantized matmul (each block dequantized
                bit for bit as gguf-py does; the tests hold this path equal to HF transformers)
  int8          tessera at its defaults on this CPU: bfloat16, the int8 matmul where the plan
                chooses it (--quantized-matmul auto)
  bf16 exact    tessera in bfloat16 with the exact quantized matmul
  llama.cpp     llama-cpp-python 0.3.36 (peers/llama_cpp_python.py: built once from the source
                package for this CPU), all cores, each prompt alone from an empty cache

Every tessera side runs each prompt alone through its quantized kernels (the whole prompt
on the quantized matmul, as decode steps run it, not the dense copy big batches take).
Metrics of each side against the reference: KL(reference || side) in nats (mean, median,
p99, max) and top-1 agreement (the greedy token). Prints a table and saves JSON.

Last line: `int8_kl_vs_llama_cpp=<int8 mean KL / llama.cpp mean KL>` (issue 33: <= 1.0).

    python benchmarks/quantized_accuracy.py                  # 256 prompts, ~3 min (+ llama.cpp's first build)
    python benchmarks/quantized_accuracy.py --prompts 16 --no-llama-cpp   # smoke
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import torch

from common import chat_prompts, environment, format_table, log

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "results"


def tessera_logits(model: str | None, dtype: str, matmul: str, prompts: list[list[int]]) -> tuple[torch.Tensor, dict]:
    """[prompts, vocab] float32 logits at each prompt's end, and the backend plan used."""
    from tessera_engine.backend_plan import plan_backends
    from tessera_engine.config import EngineConfig
    from tessera_engine.model_runner import ModelRunner

    # rows unlimited: every prompt row on the quantized matmul
    plan, loaded = plan_backends(EngineConfig(model=model, device="cpu", dtype=dtype, quantized_matmul=matmul,
                                              quantized_max_rows=1 << 20))
    blocks = -(-max(map(len, prompts)) // 16) + 1
    runner = ModelRunner(loaded.model, loaded.hf_config, blocks, 16, plan)
    rows = [runner.last_logits(ids).float() for ids in prompts]
    return torch.stack(rows), {"dtype": dtype, "quantized_matmul": plan.quantized_matmul,
                               "why": plan.why["quantized_matmul"]}


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    ref_lp, got_lp = ref.log_softmax(-1), got.float().log_softmax(-1)
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1).clamp_min(0.0)
    q = torch.quantile(kl, torch.tensor([0.5, 0.99]))
    return {"kl_mean": kl.mean().item(), "kl_median": q[0].item(), "kl_p99": q[1].item(), "kl_max": kl.max().item(),
            "top1_agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded default model)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--no-llama-cpp", action="store_true", help="tessera's sides only")
    ap.add_argument("--llama-cpp-venv", default=None)
    ap.add_argument("--out", default=str(RESULTS / "quantized_accuracy.json"))
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from tessera.common.model_source import resolve_model

    source = resolve_model(args.model)
    gguf = str(source.path)
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    prompts = chat_prompts(tokenizer, args.prompts)
    log(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; {gguf}")

    t0 = time.perf_counter()
    sides: dict[str, torch.Tensor] = {}
    plans = {}
    for name, dtype, matmul in (("reference", "float32", "exact"), ("int8", "bfloat16", "auto"),
                                ("bf16 exact", "bfloat16", "exact")):
        sides[name], plans[name] = tessera_logits(args.model, dtype, matmul, prompts)
        log(f"{name}: {plans[name]}")
    if plans["int8"]["quantized_matmul"] != "int8":
        log(f"note: the plan did not choose the int8 matmul here: {plans['int8']['why']}")
    if not args.no_llama_cpp:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from peers.llama_cpp_python import default_venv, ensure_llama_cpp, prompt_logits

        py = ensure_llama_cpp(pathlib.Path(args.llama_cpp_venv) if args.llama_cpp_venv else default_venv())
        with tempfile.TemporaryDirectory(prefix="tessera-accuracy-") as tmp:
            sides["llama.cpp"] = torch.from_numpy(prompt_logits(py, gguf, prompts, pathlib.Path(tmp) / "logits.npy"))
        log("llama.cpp: done")

    ref = sides.pop("reference")
    results = {name: compare(ref, got) for name, got in sides.items()}
    header = ["side", "KL mean", "KL median", "KL p99", "KL max", "top-1 agree"]
    rows = [[name, f"{r['kl_mean']:.5f}", f"{r['kl_median']:.5f}", f"{r['kl_p99']:.5f}", f"{r['kl_max']:.4f}",
             f"{r['top1_agreement']:.3f}"] for name, r in results.items()]
    print(f"\nnext-token KL(reference || side), nats, over {len(prompts)} prompts; reference: tessera float32, "
          "exact quantized matmul")
    print("\n".join(format_table(header, rows)))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prompts": len(prompts), "model": gguf, "plans": plans, "results": results,
                               "environment": environment(), "wall_s": time.perf_counter() - t0}, indent=1))
    print(f"results: {out}")
    if "llama.cpp" in results:
        print(f"int8_kl_vs_llama_cpp={results['int8']['kl_mean'] / results['llama.cpp']['kl_mean']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
