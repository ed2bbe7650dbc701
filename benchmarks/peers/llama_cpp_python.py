"""llama.cpp as a peer for single-request decode on the same GGUF file (issue 21, item 5).

llama.cpp runs the file's quantized weights as they are, which is what tessera's quantized
path does too. It is installed once from PyPI (llama-cpp-python, built from its source package
for this CPU, the AMX tile config patched as llama_server.py does: a few minutes) into its own
venv outside the project, and each measurement runs in a fresh worker process of that venv:
load the file, one warm-up generation, then one timed greedy generation of the same prompt
token ids and length as ours (through the binding's Python generate loop, as a user of
llama-cpp-python runs it), and the same tokens fed back one llama_decode at a time without
sampling (what llama.cpp's llama-bench times).

    python benchmarks/peers/llama_cpp_python.py --prompt-ids 1,504,3458 --tokens 256   # one measurement
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent
if str(BENCHMARKS) not in sys.path:  # run as a script (also the worker, in the llama.cpp venv)
    sys.path.insert(0, str(BENCHMARKS))

from peers import cache_dir, run  # noqa: E402

LLAMA_CPP_VERSION = "0.3.36"
READY_STAMP = ".tessera-ready"


def default_venv() -> pathlib.Path:
    return cache_dir() / "llama-cpp-venv"


def download_sdist(dest: pathlib.Path) -> pathlib.Path:
    """llama-cpp-python's source package (it vendors llama.cpp), downloaded from PyPI into dest
    once: the archive's path."""
    name = f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    if not (dest / name).exists():
        dest.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
             "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", dest])
    return dest / name


def patched_source(work: pathlib.Path) -> pathlib.Path:
    """The source package, unpacked, its vendored llama.cpp's AMX tile config patched as
    llama_server.py patches it (with GCC 12 the unpatched build crashes on AMX CPUs at start)."""
    import tarfile

    from peers.llama_server import AMX_TILE_CONFIG, patch_tile_config

    source = work / f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    if not (source / "pyproject.toml").exists():
        with tarfile.open(download_sdist(work)) as tar:
            tar.extractall(work, filter="data")
    if not patch_tile_config(source / "vendor" / "llama.cpp"):
        print(f"note: no _tile_loadconfig call found in {AMX_TILE_CONFIG}; AMX path left as it is", file=sys.stderr)
    return source


def ensure_llama_cpp(venv: pathlib.Path, skip_install: bool = False) -> pathlib.Path:
    """The venv's python, with llama-cpp-python installed (once)."""
    py = venv / "bin" / "python"
    if (venv / READY_STAMP).exists() or (skip_install and py.exists()):
        return py
    if skip_install:
        raise SystemExit(f"no llama.cpp venv at {venv}")
    print(f"installing llama-cpp-python=={LLAMA_CPP_VERSION} into {venv} (once; builds llama.cpp, minutes) ...",
          file=sys.stderr, flush=True)
    if not py.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(patched_source(venv.parent / f"llama-cpp-python-{LLAMA_CPP_VERSION}-src"))], check=True)
    check = subprocess.run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"the llama.cpp venv does not import llama_cpp:\n{check.stderr[-2000:]}")
    (venv / READY_STAMP).write_text(check.stdout)
    return py


def single_decode(py: pathlib.Path, gguf: str, prompt_ids: list[int], num_tokens: int) -> dict:
    """One timed greedy generation in a fresh llama.cpp worker: decode tok/s (1 / median
    time between tokens), time to first token, the tokens."""
    out = subprocess.run([str(py), __file__, "--worker", "--gguf", gguf, "--tokens", str(num_tokens),
                          "--prompt-ids", ",".join(map(str, prompt_ids))],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _worker(gguf: str, prompt_ids: list[int], num_tokens: int) -> dict:
    from llama_cpp import Llama

    # all cores, for decode too (the binding's default is half the cores for decode; on a
    # 2-core machine 1 and 2 threads decoded alike), the prompt in one batch
    cores = os.cpu_count() or 1
    llm = Llama(model_path=gguf, n_ctx=max(2048, len(prompt_ids) + num_tokens), n_batch=512, n_threads=cores,
                n_threads_batch=cores, verbose=False)

    def run() -> dict:
        stamps, tokens = [], []
        t0 = time.perf_counter()
        for tok in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            tokens.append(tok)
            if len(tokens) >= num_tokens:
                break
        gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
        tpot = gaps[len(gaps) // 2]
        return {"ttft_median_s": stamps[0] - t0, "tpot_median_s": tpot, "decode_tokens_per_s": 1.0 / tpot,
                "tokens_per_s": len(tokens) / (stamps[-1] - t0), "output_tokens": len(tokens), "tokens": tokens,
                "threads": llm.n_threads}

    def decode_only(tokens: list[int]) -> float:
        """Median time of one llama_decode of a single token (llm.eval), no sampling: what
        llama.cpp's own llama-bench "tg" figure times. The same tokens, fed back in turn."""
        llm.reset()
        llm.eval(prompt_ids)
        gaps = []
        for tok in tokens[:-1]:
            t = time.perf_counter()
            llm.eval([tok])
            gaps.append(time.perf_counter() - t)
        gaps.sort()
        return gaps[len(gaps) // 2]

    run()  # warm-up: first use of each batch shape
    res = run()
    res["eval_tpot_median_s"] = decode_only(res["tokens"])
    res["eval_decode_tokens_per_s"] = 1.0 / res["eval_tpot_median_s"]
    return res


def resident_command(py: pathlib.Path, gguf: str, prompt_ids: list[int], num_tokens: int) -> list[str]:
    """A llama.cpp worker that stays up (single_overhead.py --peer llama.cpp): it prints READY once
    loaded, then for each line read on stdin one greedy generation of the prompt, timed as
    _worker's, as `TPOT <through generate> <one llama_decode alone> <tokens>`."""
    return [str(py), __file__, "--resident-worker", "--gguf", gguf, "--tokens", str(num_tokens),
            "--prompt-ids", ",".join(map(str, prompt_ids))]


def _resident_worker(gguf: str, prompt_ids: list[int], num_tokens: int) -> None:
    from llama_cpp import Llama

    cores = os.cpu_count() or 1  # as _worker
    llm = Llama(model_path=gguf, n_ctx=max(2048, len(prompt_ids) + num_tokens), n_batch=512, n_threads=cores,
                n_threads_batch=cores, verbose=False)
    print("READY", flush=True)
    for _ in sys.stdin:
        stamps, tokens = [], []
        for tok in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            tokens.append(tok)
            if len(tokens) >= num_tokens:
                break
        # the mean time a token (first to last), as the served TPOT is taken; then the same
        # tokens fed back one llama_decode at a time, no sampling (llama-bench's tg)
        llm.reset()
        llm.eval(prompt_ids)
        t = time.perf_counter()
        for tok in tokens[:-1]:
            llm.eval([tok])
        evals = (time.perf_counter() - t) / (len(tokens) - 1)
        print(f"TPOT {(stamps[-1] - stamps[0]) / (len(stamps) - 1)} {evals} {len(tokens)}", flush=True)


def prompt_logits(py: pathlib.Path, gguf: str, prompts: list[list[int]], out: pathlib.Path) -> "np.ndarray":
    """llama.cpp's next-token logits at the end of each prompt (float32 [prompts, vocab]), each
    prompt evaluated alone from an empty cache, all cores, in a fresh worker of the llama.cpp
    venv; written to `out` (.npy) and read back."""
    spec = out.with_suffix(".prompts.json")
    spec.write_text(json.dumps(prompts))
    subprocess.run([str(py), __file__, "--logits-worker", "--gguf", gguf, "--prompt-ids", "0",
                    "--prompts-file", str(spec), "--out", str(out)], check=True)
    import numpy as np

    return np.load(out)


def _logits_worker(gguf: str, prompts_file: str, out: str) -> None:
    import numpy as np
    from llama_cpp import Llama

    prompts = json.loads(pathlib.Path(prompts_file).read_text())
    cores = os.cpu_count() or 1
    # logits_all: the binding copies logits into llm.scores only then
    llm = Llama(model_path=gguf, n_ctx=max(512, max(map(len, prompts)) + 8), n_batch=512, n_threads=cores,
                n_threads_batch=cores, logits_all=True, verbose=False)
    rows = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        rows.append(np.array(llm.scores[len(ids) - 1], dtype=np.float32))
    np.save(out, np.stack(rows))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the embedded default model)")
    ap.add_argument("--prompt-ids", required=True, help="comma-separated prompt token ids")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--venv", default=None, help="the llama.cpp venv (default <TESSERA_BENCH_CACHE>/llama-cpp-venv)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--logits-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resident-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.logits_worker:
        _logits_worker(a.gguf, a.prompts_file, a.out)
        return
    ids = [int(t) for t in a.prompt_ids.split(",") if t.strip()]
    if a.worker:
        print(json.dumps(_worker(a.gguf, ids, a.tokens)))
        return
    if a.resident_worker:
        _resident_worker(a.gguf, ids, a.tokens)
        return
    if a.gguf is None:
        from tessera.common.model_source import resolve_model

        a.gguf = str(resolve_model(None).path)
    py = ensure_llama_cpp(pathlib.Path(a.venv) if a.venv else default_venv())
    res = single_decode(py, a.gguf, ids, a.tokens)
    res.pop("tokens")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
