"""The run's figures from its per-request records: throughputs, latency statistics (ms), goodput;
and the statistics they use (percentile, median, summarize), for other measurements too."""
from __future__ import annotations

from typing import Iterable

import numpy as np

from tessera.bench.backends import RequestResult

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
         "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """["ttft:500", "tpot:100"] -> {"ttft": 500.0, "tpot": 100.0} (ms); ValueError naming a bad one."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"{item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"{item!r}: a negative SLO")
    return slos


def percentile(values: Iterable[float | None], p: float) -> float:
    """The p-th percentile (0..100, linear interpolation between the closest ranks, as numpy's
    default) of the values that are not None; NaN when there are none."""
    vals = np.array([v for v in values if v is not None], dtype=float)
    return float(np.percentile(vals, p)) if vals.size else float("nan")


def median(values: Iterable[float | None]) -> float:
    """The median of the values that are not None (the mean of the middle two of an even count);
    NaN when there are none."""
    vals = np.array([v for v in values if v is not None], dtype=float)
    return float(np.median(vals)) if vals.size else float("nan")


def summarize(values: Iterable[float | None]) -> dict:
    """{"median", "min", "max", "values"} of the values that are not None (None figures when none)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "values": []}
    return {"median": median(vals), "min": min(vals), "max": max(vals), "values": vals}


def _values(results: list[RequestResult], metric: str) -> list[float]:
    """Seconds of one metric over the successful requests (ITL: every gap of every request)."""
    ok = [r for r in results if r.success]
    if metric == "ttft":
        return [r.ttft for r in ok]
    if metric == "tpot":
        return [r.tpot for r in ok if r.output_tokens > 1]
    if metric == "itl":
        return [gap for r in ok for gap in r.itl]
    return [r.latency for r in ok]


def meets(result: RequestResult, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": result.ttft * 1e3, "tpot": result.tpot * 1e3, "e2el": result.latency * 1e3}
    return result.success and all(values_ms[name] <= limit for name, limit in slos.items())


def compute(results: list[RequestResult], duration_s: float, percentiles: list[float],
            selected: list[str], slos: dict[str, float]) -> dict:
    """Every figure of the report, JSON-ready."""
    ok = [r for r in results if r.success]
    completed = len(ok)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    out: dict = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(results) - completed,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": completed / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s > 0 else 0.0,
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
    }
    if slos:
        good = sum(meets(r, slos) for r in ok)
        out["goodput_slos_ms"] = slos
        out["good_requests"] = good
        out["request_goodput"] = good / duration_s if duration_s > 0 else 0.0
    for metric in selected:
        values_ms = np.array(_values(results, metric), dtype=float) * 1e3
        empty = values_ms.size == 0
        out[f"mean_{metric}_ms"] = 0.0 if empty else float(values_ms.mean())
        out[f"median_{metric}_ms"] = 0.0 if empty else float(np.median(values_ms))
        out[f"std_{metric}_ms"] = 0.0 if empty else float(values_ms.std())
        for p in percentiles:
            out[f"p{p:g}_{metric}_ms"] = 0.0 if empty else percentile(values_ms, p)
    return out


def per_request(results: list[RequestResult]) -> dict:
    """The per-request records, as vLLM's result files keep them (seconds; start_times: each
    send's time.perf_counter(), as vLLM's)."""
    return {"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "e2els": [r.latency for r in results], "start_times": [r.start for r in results],
            "chunks": [r.chunks for r in results],
            "errors": [r.error for r in results]}
