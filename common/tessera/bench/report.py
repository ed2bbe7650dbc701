"""The result as a table on stdout (shaped like vLLM's) and as a JSON file."""
from __future__ import annotations

import json
import pathlib
from typing import TextIO

from tessera.bench.metrics import NAMES

WIDTH = 50


def _row(out: TextIO, label: str, value) -> None:
    text = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
    out.write(f"{label + ':':<40}{text}\n")


def print_table(figures: dict, selected: list[str], percentiles: list[float], out: TextIO) -> None:
    out.write("{s:{c}^{n}}\n".format(s=" Serving Benchmark Result ", n=WIDTH, c="="))
    _row(out, "Successful requests", figures["completed"])
    _row(out, "Failed requests", figures["failed"])
    if figures.get("max_concurrency"):
        _row(out, "Maximum request concurrency", figures["max_concurrency"])
    _row(out, "Benchmark duration (s)", figures["duration"])
    _row(out, "Total input tokens", figures["total_input_tokens"])
    _row(out, "Total generated tokens", figures["total_output_tokens"])
    _row(out, "Request throughput (req/s)", figures["request_throughput"])
    if "request_goodput" in figures:
        _row(out, "Request goodput (req/s)", figures["request_goodput"])
    _row(out, "Output token throughput (tok/s)", figures["output_throughput"])
    _row(out, "Total token throughput (tok/s)", figures["total_token_throughput"])
    for metric in selected:
        out.write("{s:{c}^{n}}\n".format(s=NAMES[metric], n=WIDTH, c="-"))
        _row(out, f"Mean {metric.upper()} (ms)", figures[f"mean_{metric}_ms"])
        _row(out, f"Median {metric.upper()} (ms)", figures[f"median_{metric}_ms"])
        for p in percentiles:
            if p != 50:  # the median, shown above
                _row(out, f"P{p:g} {metric.upper()} (ms)", figures[f"p{p:g}_{metric}_ms"])
    out.write("=" * WIDTH + "\n")
    out.flush()


def save(result: dict, directory: str | None, filename: str) -> pathlib.Path:
    path = pathlib.Path(directory or ".") / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path
