"""Engines in-process, each side in a fresh subprocess: tessera's EngineCore at its defaults
(driven as engine_throughput.py drives it; this file is its worker script) and vLLM's offline
LLM.generate (peers/vllm_cpu.py), on the same prompt token ids, a batch and a single request;
and how far two sides' greedy outputs agree.

    python benchmarks/inprocess.py SPEC.json   # the tessera worker: prints `RESULT {json}`
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

BENCHMARKS = pathlib.Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from common import log, wait_for_quiet  # noqa: E402
from peers import vllm_cpu  # noqa: E402

from tessera.bench.metrics import median  # noqa: E402


def worker_tessera(spec: str) -> None:
    """tessera's EngineCore at its defaults on the spec's prompts; prints RESULT."""
    import gc

    import torch

    from tessera_engine.backend_plan import plan_backends
    from tessera_engine.config import EngineConfig
    from tessera_engine.core import EngineCore
    from tessera_engine.request import EngineCoreRequest
    from tessera_engine.sampling_params import SamplingParams

    cfg_in = json.loads(pathlib.Path(spec).read_text())
    config = EngineConfig()
    t = time.perf_counter()
    plan, loaded = plan_backends(config)  # every engine below reuses the plan's weights
    load_s = time.perf_counter() - t
    dtype, why = plan.dtype, plan.why["dtype"]

    def run(prompts, max_tokens):
        gc.collect()
        core = EngineCore(config, loaded)
        tokens = {f"r{i}": [] for i in range(len(prompts))}
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                          ignore_eos=True)))
        while core.has_unfinished():
            for o in core.step():
                tokens[o.request_id].extend(o.new_token_ids)
        wall = time.perf_counter() - t0
        n = [len(v) for v in tokens.values()]
        del core
        return {"output_tokens": sum(n), "wall_s": wall, "tokens_per_s": sum(n) / wall,
                "tokens_ok": all(k == max_tokens for k in n), "_tokens": list(tokens.values())}

    run(cfg_in["prompts"], 4)
    run(cfg_in["prompts"][:1], 4)
    batch = run(cfg_in["prompts"], cfg_in["max_tokens"])
    single = run([cfg_in["single_prompt"]], cfg_in["single_tokens"])
    print("RESULT " + json.dumps({"load_s": load_s, "batch": batch, "single": single, "dtype": str(dtype),
                                  "dtype_why": why, "threads": torch.get_num_threads()}), flush=True)


def run_inprocess(side: str, prompt_ids: list[list[int]], single_ids: list[int], max_tokens: int,
                  single_tokens: int, wait_quiet_s: float, vllm_venv: pathlib.Path | None = None,
                  model_dir: pathlib.Path | None = None, vllm_env: dict | None = None) -> dict:
    """One side ("tessera" or "vllm") in a fresh subprocess: its RESULT (batch, single, dtype, ...)."""
    work = pathlib.Path(tempfile.mkdtemp(prefix="serve-vs-vllm-inprocess-"))
    spec = work / "spec.json"
    spec.write_text(json.dumps({"model": str(model_dir), "prompts": prompt_ids, "max_tokens": max_tokens,
                                "single_prompt": single_ids, "single_tokens": single_tokens}))
    if side == "tessera":
        from tessera_engine import openmp_env

        cmd = [sys.executable, __file__, str(spec)]
        # as the engine service runs (its __main__ applies them)
        run_env = openmp_env.apply({k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")})
    else:
        cmd = vllm_cpu.offline_command(vllm_venv, work, spec)
        run_env = vllm_env
    wait_for_quiet(wait_quiet_s, log=log)
    log(f"[{side} in-process] ...")
    with open(work / "log.txt", "wb") as logf:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=logf, env=run_env, timeout=3600)
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{side} in-process run failed ({proc.returncode}):\n"
                           + (work / "log.txt").read_text(errors="replace")[-3000:])
    res = json.loads(lines[-1][len("RESULT "):])
    for part in ("batch", "single"):
        if not res[part].pop("tokens_ok"):
            raise RuntimeError(f"{side} in-process {part}: wrong number of output tokens")
    res["log"] = str(work / "log.txt")
    log(f"[{side} in-process] batch {res['batch']['tokens_per_s']:7.1f} tok/s  single "
        f"{res['single']['tokens_per_s']:6.1f} tok/s  ({res['dtype']})")
    return res


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many outputs are identical, and the median common prefix, of two sides' token lists."""
    prefix = []
    for x, y in zip(a, b):
        n = 0
        for p, q in zip(x, y):
            if p != q:
                break
            n += 1
        prefix.append(n)
    return {"identical": sum(len(x) == len(y) == n for x, y, n in zip(a, b, prefix)), "of": len(prefix),
            "median_common_prefix": median(prefix)}


if __name__ == "__main__":
    worker_tessera(sys.argv[1])
