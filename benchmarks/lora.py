#!/usr/bin/env python
"""LoRA adapters against the base model, in-process, same run, same machine.

A benchmark, not a test. The default model at the engine's defaults (bfloat16 where the CPU has
it, the CPU kernels, batch-invariant); --adapters PEFT adapters of rank --rank on every target
(q/k/v/o/gate/up/down; --targets qv: q and v only, PEFT's default for Llama), made once with peft into the cache directory (random weights: speed does
not depend on them). Sides:
  base       an engine without LoRA, requests for the base model
  lora       an engine with the adapters (--max-loras = --adapters), request i with adapter i mod N
  lora-idle  the same engine, requests for the base model (what serving adapters costs those)
Workloads: burst = the 64 chat questions x 128 tokens, greedy, ignore_eos, all at once (output
tok/s); single = one request x --single-tokens, alone (decode tok/s = (tokens - 1) / (last token -
first token)). --rounds rounds, the sides' order alternating; medians.

Targets (issue 36): burst lora >= 0.8x base; single lora >= 0.9x base.

    .venv/bin/python benchmarks/lora.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

BENCHMARKS = pathlib.Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from common import chat_prompts, environment, format_table, log, wait_for_quiet  # noqa: E402

from tessera.bench.metrics import median  # noqa: E402

TARGETS = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "qv": ["q_proj", "v_proj"]}  # qv: PEFT's default target_modules for Llama


def make_adapters(src, root: pathlib.Path, n: int, rank: int, targets: str) -> list[pathlib.Path]:
    """n PEFT LoRA adapters for the model, written once (reused when present)."""
    paths = [root / f"rank{rank}-{targets}-{i}" for i in range(n)]
    if all((p / "adapter_model.safetensors").is_file() for p in paths):
        return paths
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    base_cfg = AutoConfig.from_pretrained(src.directory, gguf_file=src.gguf_file)
    for i, path in enumerate(paths):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_config(base_cfg),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS[targets],
                                          init_lora_weights=False, task_type="CAUSAL_LM"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.02)
        model.save_pretrained(str(path))
        log(f"adapter written: {path}")
    return paths


def run(core, jobs: list[tuple[list[int], str]], params) -> dict:
    """jobs (prompt, adapter name) all at once on the engine: tokens, wall, per-request first/last."""
    from tessera_engine.request import EngineCoreRequest

    t0 = time.perf_counter()
    for i, (prompt, lora) in enumerate(jobs):
        core.add_request(EngineCoreRequest(f"b{time.monotonic_ns()}-{i}", prompt, params, lora_name=lora))
    tokens, first, last = 0, None, t0
    while core.has_unfinished():
        outs = core.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                tokens += len(o.new_token_ids)
                first = now if first is None else first
                last = now
    return {"tokens": tokens, "wall": time.perf_counter() - t0, "first": first or t0, "last": last}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=list(TARGETS), default="all",
                    help="the adapters' target modules: all seven, or q and v (PEFT's default for Llama)")
    ap.add_argument("--burst", type=int, default=64, help="requests in the burst")
    ap.add_argument("--burst-tokens", type=int, default=128)
    ap.add_argument("--single-tokens", type=int, default=256)
    ap.add_argument("--cache-dir", default=str(pathlib.Path.home() / ".cache" / "tessera-bench" / "lora"))
    ap.add_argument("--wait-quiet", type=float, default=20.0, help="wait up to this long for a quiet machine")
    ap.add_argument("--out", default="results/lora.json")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from tessera.common.model_source import resolve_model
    from tessera_engine.backend_plan import plan_backends
    from tessera_engine.config import EngineConfig
    from tessera_engine.core import EngineCore
    from tessera_engine.sampling_params import SamplingParams

    src = resolve_model(None)
    paths = make_adapters(src, pathlib.Path(args.cache_dir), args.adapters, args.rank, args.targets)
    names = [f"adapter{i}" for i in range(args.adapters)]
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    prompts = chat_prompts(tok, args.burst)
    wait_for_quiet(args.wait_quiet, log=log)
    _plan, loaded = plan_backends(EngineConfig())
    base = EngineCore(EngineConfig(), loaded)
    lora = EngineCore(EngineConfig(lora_modules=[(n, str(p)) for n, p in zip(names, paths)],
                                   max_loras=args.adapters, max_lora_rank=args.rank), loaded)
    sides = {"base": (base, [""] * args.burst), "lora": (lora, [names[i % len(names)] for i in range(args.burst)]),
             "lora-idle": (lora, [""] * args.burst)}
    burst = SamplingParams(temperature=0.0, max_tokens=args.burst_tokens, ignore_eos=True)
    single = SamplingParams(temperature=0.0, max_tokens=args.single_tokens, ignore_eos=True)
    for core, adapters in sides.values():  # warm-up: shapes, allocator, the adapters' slots
        run(core, list(zip(prompts[:8], adapters[:8])), SamplingParams(temperature=0.0, max_tokens=4))
    rounds = {side: {"burst_tok_s": [], "single_decode_tok_s": []} for side in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for side in order:
            core, adapters = sides[side]
            res = run(core, list(zip(prompts, adapters)), burst)
            rounds[side]["burst_tok_s"].append(res["tokens"] / res["wall"])
        for side in order:
            core, adapters = sides[side]
            res = run(core, [(prompts[1], adapters[1])], single)
            rounds[side]["single_decode_tok_s"].append((res["tokens"] - 1) / (res["last"] - res["first"]))
        log(f"round {r + 1}: " + json.dumps({s: {k: round(v[-1], 1) for k, v in m.items()} for s, m in rounds.items()}))
    result = {side: {k: median(v) for k, v in m.items()} for side, m in rounds.items()}
    ratios = {"burst_ratio": result["lora"]["burst_tok_s"] / result["base"]["burst_tok_s"],
              "single_ratio": result["lora"]["single_decode_tok_s"] / result["base"]["single_decode_tok_s"],
              "idle_burst_ratio": result["lora-idle"]["burst_tok_s"] / result["base"]["burst_tok_s"]}
    report = {"environment": environment(["torch", "transformers", "peft"]), "args": vars(args),
              "rounds": rounds, "medians": result, **ratios}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    rows = [[side, f"{m['burst_tok_s']:.1f}", f"{m['single_decode_tok_s']:.1f}"] for side, m in result.items()]
    print("\n".join(format_table(["side", f"burst {args.burst} x {args.burst_tokens} tok/s",
                                  f"single decode tok/s ({args.single_tokens})"], rows)))
    print(f"burst_ratio={ratios['burst_ratio']:.3f} (target 0.8) single_ratio={ratios['single_ratio']:.3f} "
          f"(target 0.9) idle_burst_ratio={ratios['idle_burst_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
