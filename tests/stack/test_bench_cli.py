"""`tessera serve` and `tessera bench` as a user runs them (subprocesses of the console entry).

serve: started on free ports with the default model, its printed endpoints answer a streamed
request, SIGTERM stops all three children with exit status 0.
bench: a few requests in each mode (concurrency, request rate, duration) over HTTP chat,
completions and gRPC; every figure present and consistent with the per-request records and
with the engine's own token counter; vLLM's custom JSONL dataset, --endpoint, --request-timeout
(a cancelled request fails and the server frees it); a bad option is a usage error that names it.
"""
from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx2
import psutil
import pytest

from helpers.metrics_util import wait_engine_gauges_idle
from helpers.stack import STARTUP_TIMEOUT_S, free_port, stack  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.integration

TESSERA = [sys.executable, "-m", "tessera.cli"]
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def test_serve_prints_endpoints_answers_and_stops_cleanly(tmp_path):
    tok, eng, front, http = free_port(), free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [*TESSERA, "serve", "--port", str(front), "--tokenizer-port", str(tok), "--engine-port", str(eng),
         "--http-port", str(http), "--metrics-port", "0", "--drain-timeout-s", "5", "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.err", "w"), text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, out), daemon=True).start()
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        serving = None
        lines = []
        while serving is None and time.monotonic() < deadline:
            try:
                line = out.get(timeout=1)
            except queue.Empty:
                continue
            err = (tmp_path / "serve.err").read_text()[-3000:] if line is None else ""
            assert line is not None, f"serve exited early: {''.join(lines)}{err}"
            lines.append(line)
            record = json.loads(line)  # stdout is no terminal: JSON lines
            if record["msg"] == "serving":
                serving = record
        assert serving is not None, "".join(lines)
        assert serving["grpc"] == f"127.0.0.1:{front}"
        assert serving["http"] == f"http://127.0.0.1:{http}/v1"
        children = psutil.Process(proc.pid).children()
        assert len(children) == 3

        body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx2.stream("POST", f"{serving['http']}/chat/completions", json=body, timeout=60) as reply:
            assert reply.status_code == 200
            chunks = [line for line in reply.iter_lines() if line.startswith("data:")]
        assert chunks[-1] == "data: [DONE]"
        assert json.loads(chunks[-2][5:])["usage"]["completion_tokens"] >= 1

        # a burst of signals, as `make run` gets from Ctrl-C or `timeout` (make and the
        # terminal each pass one on): the first stops, the others must not hang the drain
        for sig in (signal.SIGTERM, signal.SIGINT) * 10:
            proc.send_signal(sig)
        assert proc.wait(timeout=90) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"orphans: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def run_bench(tmp_path, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([*TESSERA, "bench", *args, "--save-result", "--result-dir", str(tmp_path),
                           "--result-filename", "result.json", "--disable-tqdm"],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads((tmp_path / "result.json").read_text())


def check_figures(proc: subprocess.CompletedProcess, r: dict) -> None:
    """Every figure is there and agrees with the per-request records."""
    assert "Serving Benchmark Result" in proc.stdout and "Request throughput (req/s)" in proc.stdout
    n = r["completed"]
    assert n >= 1 and r["failed"] == 0 and r["duration"] > 0
    assert r["usage_reported"] is True
    assert len(r["output_lens"]) == len(r["ttfts"]) == len(r["itls"]) == len(r["e2els"]) == n
    assert r["total_output_tokens"] == sum(r["output_lens"])
    assert r["total_input_tokens"] == sum(r["input_lens"])
    assert math.isclose(r["request_throughput"], n / r["duration"], rel_tol=1e-9)
    assert math.isclose(r["output_throughput"], r["total_output_tokens"] / r["duration"], rel_tol=1e-9)
    assert math.isclose(r["total_token_throughput"],
                        (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"], rel_tol=1e-9)
    for out_len, chunks, itls, ttft, e2el in zip(r["output_lens"], r["chunks"], r["itls"], r["ttfts"], r["e2els"]):
        assert 1 <= chunks <= out_len          # a chunk carries one token or more
        assert len(itls) == chunks - 1
        assert 0 < ttft <= e2el
        assert math.isclose(ttft + sum(itls), e2el, rel_tol=0.2, abs_tol=0.05)
    for metric in METRICS:
        keys = [f"mean_{metric}_ms", f"median_{metric}_ms"] + [f"p{p}_{metric}_ms" for p in PERCENTILES]
        for key in keys:
            assert key in r and r[key] >= 0, key
        assert r[f"median_{metric}_ms"] == r[f"p50_{metric}_ms"]
        assert r[f"p50_{metric}_ms"] <= r[f"p90_{metric}_ms"] <= r[f"p99_{metric}_ms"]
        assert f"P99 {metric.upper()} (ms)" in proc.stdout
    assert math.isclose(r["mean_e2el_ms"], 1e3 * sum(r["e2els"]) / n, rel_tol=1e-6)


def engine_tokens(stack) -> float:  # noqa: F811
    return wait_engine_gauges_idle(stack.engine.metrics_url).get("tessera:generation_tokens_total")


SMALL = ["--random-input-len", "16", "--random-output-len", "6", "--ignore-eos"]


def test_chat_at_fixed_concurrency_counts_what_the_server_generated(stack, tmp_path):  # noqa: F811
    before = engine_tokens(stack)
    proc, r = run_bench(tmp_path, "--backend", "openai-chat", "--base-url", stack.http_url,
                        "--num-prompts", "4", "--max-concurrency", "2", *SMALL)
    check_figures(proc, r)
    assert r["completed"] == 4 and r["max_concurrency"] == 2
    assert r["output_lens"] == [6] * 4  # ignore_eos: max tokens each
    # the engine's counter saw these plus the one test request sent before the run
    assert engine_tokens(stack) - before == r["total_output_tokens"] + 6
    assert "Maximum request concurrency" in proc.stdout


def test_completions_at_a_request_rate_with_goodput_and_shared_prefix(stack, tmp_path):  # noqa: F811
    proc, r = run_bench(tmp_path, "--backend", "openai", "--base-url", stack.http_url + "/v1",
                        "--num-prompts", "4", "--request-rate", "20", "--burstiness", "0.5",
                        "--dataset-name", "prefix", "--prefix-len", "24", "--goodput", "ttft:600000", "tpot:600000",
                        *SMALL)
    check_figures(proc, r)
    assert r["completed"] == 4 and r["request_rate"] == 20
    assert r["good_requests"] == 4 and math.isclose(r["request_goodput"], r["request_throughput"])
    assert all(n > 24 for n in r["input_lens"])  # the shared prefix counts in every prompt
    assert "Request goodput (req/s)" in proc.stdout


def test_grpc_for_a_duration_with_the_tokenizer_service_vocabulary(stack, tmp_path):  # noqa: F811
    before = engine_tokens(stack)
    proc, r = run_bench(tmp_path, "--backend", "grpc", "--addr", stack.frontend.addr,
                        "--tokenizer-addr", stack.tokenizer.addr, "--num-prompts", "2", "--duration", "2",
                        "--max-concurrency", "2", *SMALL)
    check_figures(proc, r)
    assert r["completed"] >= 2  # the two prompts cycle for two seconds
    assert r["duration"] >= 2 and r["duration_limit"] == 2
    assert engine_tokens(stack) - before == r["total_output_tokens"] + 6


def test_sharegpt_file(stack, tmp_path):  # noqa: F811
    conversations = [{"conversations": [{"from": "human", "value": f"Tell me about the number {i} in a few words."},
                                        {"from": "gpt", "value": "It is a number that comes after another one."}]}
                     for i in range(3)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    proc, r = run_bench(tmp_path, "--backend", "openai-chat", "--base-url", stack.http_url, "--dataset-name",
                        "sharegpt", "--dataset-path", str(path), "--num-prompts", "3", "--sharegpt-output-len", "5",
                        "--ignore-eos")
    check_figures(proc, r)
    assert r["completed"] == 3 and r["output_lens"] == [5] * 3


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_custom_jsonl_dataset_on_an_endpoint_with_headers_and_warmups(stack, tmp_path):  # noqa: F811
    # vLLM's custom format: a prompt per line, output_tokens optional (taken with --custom-output-len -1)
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Name a colour.", "output_tokens": 3},
                                                    {"prompt": "Name a fruit.", "output_tokens": 5},
                                                    {"prompt": "Name a tree.", "output_tokens": 4}])
    before = engine_tokens(stack)
    proc, r = run_bench(tmp_path, "--backend", "openai-chat", "--base-url", stack.http_url,
                        "--endpoint", "/v1/chat/completions", "--dataset-name", "custom", "--dataset-path", path,
                        "--custom-output-len", "-1", "--disable-shuffle", "--num-prompts", "3", "--ignore-eos",
                        "--request-rate", "50", "--burstiness", "inf", "--header", "X-Bench-Run=1",
                        "--num-warmups", "2", "--metadata", "run=custom")
    check_figures(proc, r)
    assert r["completed"] == 3 and r["output_lens"] == [3, 5, 4]  # the file's order and lengths
    assert r["endpoint"] == "/v1/chat/completions" and r["dataset_name"] == "custom" and r["run"] == "custom"
    # the chat template is the server's: each prompt counts more tokens than its words
    assert all(n > 4 for n in r["input_lens"])
    # the run's tokens, the test request's and the two warm-ups' (copies of the first prompt)
    assert engine_tokens(stack) - before == r["total_output_tokens"] + 3 * 3
    # the records in the order sent; the last was due 3 / 50 s after the start (evenly spaced)
    assert r["start_times"] == sorted(r["start_times"]) and r["duration"] > 3 / 50

    # the same file over completions, shuffled by the seed and repeated up to --num-prompts
    proc, r = run_bench(tmp_path, "--backend", "openai", "--base-url", stack.http_url,
                        "--dataset-name", "custom", "--dataset-path", path, "--custom-output-len", "2",
                        "--num-prompts", "5", "--ignore-eos")
    check_figures(proc, r)
    assert r["completed"] == 5 and r["output_lens"] == [2] * 5 and r["endpoint"] == "/v1/completions"


def test_endpoint_is_the_path_requests_go_to(stack, tmp_path):  # noqa: F811
    proc = subprocess.run([*TESSERA, "bench", "--backend", "openai-chat", "--base-url", stack.http_url,
                           "--endpoint", "/v1/no-such-path", "--num-prompts", "1", "--disable-tqdm", *SMALL],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the test request failed: HTTP 404" in proc.stderr


def test_request_timeout_cancels_a_long_request_and_counts_it_failed(stack, tmp_path):  # noqa: F811
    # the first prompt (the test request) is short; the other would decode for minutes
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Say yes.", "output_tokens": 2},
                                                    {"prompt": "Count to a million.", "output_tokens": 2000}])
    proc, r = run_bench(tmp_path, "--backend", "openai-chat", "--base-url", stack.http_url, "--dataset-name",
                        "custom", "--dataset-path", path, "--custom-output-len", "-1", "--disable-shuffle",
                        "--num-prompts", "2", "--ignore-eos", "--request-timeout", "4")
    assert r["completed"] == 1 and r["failed"] == 1 and r["request_timeout"] == 4
    assert r["errors"][1] == "timed out after 4 s (--request-timeout)" and 4 <= r["e2els"][1] < 6
    assert "1 requests failed; the first: timed out after 4 s" in proc.stderr
    wait_engine_gauges_idle(stack.engine.metrics_url)  # the cancelled stream aborted the request on the server


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _valid_png(path) -> bool:
    data = path.read_bytes()
    return data.startswith(PNG_MAGIC) and data.rstrip().endswith(b"IEND\xaeB`\x82") and len(data) > 1000


def test_concurrency_sweep_saves_runs_and_charts_and_plot_draws_several(stack, tmp_path):  # noqa: F811
    proc = subprocess.run([*TESSERA, "bench", "--backend", "openai-chat", "--base-url", stack.http_url,
                           "--num-prompts", "2", "--sweep-max-concurrency", "1,2", "--result-dir", str(tmp_path),
                           "--label", "ours", "--disable-tqdm", *SMALL],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("Serving Benchmark Result") == 2
    [sweep_file] = tmp_path.glob("sweep-max_concurrency-*.json")
    sweep = json.loads(sweep_file.read_text())
    assert sweep["label"] == "ours" and [r["max_concurrency"] for r in sweep["runs"]] == [1, 2]
    assert all(r["completed"] == 2 and r["total_output_tokens"] == 12 for r in sweep["runs"])
    for name in ("sweep-max_concurrency_throughput.png", "sweep-max_concurrency_latency.png"):
        assert _valid_png(tmp_path / name), name

    other = tmp_path / "other.json"  # a second series (as vLLM's would be) on the same charts
    other.write_text(json.dumps({**sweep, "label": "other"}))
    out = tmp_path / "compare"
    proc = subprocess.run([*TESSERA, "bench", "--plot", str(sweep_file), str(other), "--result-dir", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("compare-max_concurrency_throughput.png", "compare-max_concurrency_latency.png"):
        assert _valid_png(out / name), name


@pytest.mark.parametrize("args, named", [
    (["--sweep-max-concurrency", "1,0"], "--sweep-max-concurrency"),
    (["--sweep-max-concurrency", "1", "--sweep-request-rate", "1"], "--sweep-request-rate"),
    (["--bogus-flag"], "--bogus-flag"),
    (["--backend", "nope"], "--backend"),
    (["--request-rate", "0"], "--request-rate"),
    (["--goodput", "ttft=500"], "--goodput"),
    (["--percentile-metrics", "ttft,speed"], "--percentile-metrics"),
    (["--dataset-name", "sharegpt"], "--dataset-path"),
    (["--dataset-name", "custom", "--dataset-path", "prompts.json"], "--dataset-path"),
    (["--request-timeout", "-1"], "--request-timeout"),
    (["--backend", "grpc", "--endpoint", "/v1/completions"], "--endpoint"),
    (["--duration", "5"], "--duration"),
])
def test_bad_bench_option_is_a_usage_error_naming_it(args, named):
    proc = subprocess.run([*TESSERA, "bench", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr and "usage: tessera bench" in proc.stderr


def test_bad_serve_option_is_a_usage_error_naming_it():
    proc = subprocess.run([*TESSERA, "serve", "--no-such-flag", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--no-such-flag" in proc.stderr
