"""Measuring a running OpenAI-compatible server with `tessera bench`'s client (tessera.bench's
OpenAIBackend: streamed chat completions, temperature 0, ignore_eos, include_usage):

  burst   chat prompts all sent at once x max_tokens: output tok/s = completion tokens /
          (last token - first send); TTFT = send -> first chunk with content (median, p99,
          quartiles); TPOT = (last content - first content) / (tokens - 1), the median over requests
  single  requests one after another, each alone: tok/s = tokens / (last content - send), TTFT,
          decode tok/s = (tokens - 1) / (last content - first content); medians over the runs

`measure_server` starts a servers.Server, warms it up, measures a burst (with the server's RSS
and CPU over it) and the single requests, and stops it.
"""
from __future__ import annotations

import asyncio
import time

from common import log, wait_for_quiet
from proctree import CpuWindow

from tessera.bench.backends import OpenAIBackend, RequestResult, http_client
from tessera.bench.datasets import SampleRequest
from tessera.bench.metrics import median, percentile


def _sample(question: str, max_tokens: int) -> SampleRequest:
    return SampleRequest(prompt=question, prompt_len=0, expected_output_len=max_tokens)


async def burst(root_url: str, model: str, prompts: list[str], max_tokens: int) -> list[RequestResult]:
    """Every prompt at once (one connection each)."""
    async with http_client(max(1, len(prompts))) as client:
        send = OpenAIBackend(client, root_url, model, chat=True, ignore_eos=True)
        return list(await asyncio.gather(*(send(_sample(q, max_tokens)) for q in prompts)))


async def sequential(root_url: str, model: str, prompts: list[str], max_tokens: int) -> list[RequestResult]:
    """The prompts one after another, each alone."""
    async with http_client(1) as client:
        send = OpenAIBackend(client, root_url, model, chat=True, ignore_eos=True)
        return [await send(_sample(q, max_tokens)) for q in prompts]


def _complete(r: RequestResult, max_tokens: int) -> bool:
    return r.success and r.usage_reported and r.output_tokens == max_tokens and r.chunks > 0


def _first(r: RequestResult) -> float:
    return r.start + r.ttft


def _describe(r: RequestResult) -> dict:
    return {"error": r.error, "completion_tokens": r.output_tokens if r.usage_reported else None,
            "chunks": r.chunks, "text": r.text[:200]}


def batch_summary(reqs: list[RequestResult], max_tokens: int) -> dict:
    bad = [i for i, r in enumerate(reqs) if not _complete(r, max_tokens)]
    if bad:
        raise RuntimeError(f"requests {bad[:5]} did not stream {max_tokens} tokens: {_describe(reqs[bad[0]])}")
    t0 = min(r.start for r in reqs)
    t_end = max(r.last_token for r in reqs)
    total = sum(r.output_tokens for r in reqs)
    ttft = [r.ttft for r in reqs]
    tpot = [(r.last_token - _first(r)) / (r.output_tokens - 1) for r in reqs if r.output_tokens > 1]
    return {"requests": len(reqs), "output_tokens": total, "wall_s": t_end - t0, "tokens_per_s": total / (t_end - t0),
            "ttft_median_s": median(ttft), "ttft_p99_s": percentile(ttft, 99),
            "ttft_quartiles_s": [percentile(ttft, q) for q in (0, 25, 50, 75, 100)],
            "tpot_median_s": median(tpot), "prompt_tokens": [r.prompt_len for r in reqs],
            "ttft_s": ttft}


def single_summary(reqs: list[RequestResult], max_tokens: int) -> dict:
    runs = []
    for r in reqs:
        if not _complete(r, max_tokens):
            raise RuntimeError(f"a single request did not stream {max_tokens} tokens: {_describe(r)}")
        n = r.output_tokens
        runs.append({"tokens_per_s": n / (r.last_token - r.start), "ttft_s": r.ttft,
                     "decode_tokens_per_s": (n - 1) / (r.last_token - _first(r)) if n > 1 else None})
    return {"tokens_per_s": median(x["tokens_per_s"] for x in runs),
            "ttft_median_s": median(x["ttft_s"] for x in runs),
            "decode_tokens_per_s": median(x["decode_tokens_per_s"] for x in runs), "runs": runs}


def measure_server(server, wait_quiet_s: float, batch_prompts: list[str], warm_prompts: list[str],
                   single_prompts: list[str], max_tokens: int, single_tokens: int) -> dict:
    """Start the server, warm it up (a burst of warm_prompts x 8 tokens, one single request),
    measure a burst of batch_prompts and the single requests, stop it."""
    log(f"[{server.name}] starting (logs in {server.log_dir}) ...")
    wait_for_quiet(wait_quiet_s, log=log)
    server.start()
    try:
        url, model = server.root_url, server.model_id
        log(f"[{server.name}] serving {model!r} after {server.started_s:.1f} s; warm-up ...")
        asyncio.run(burst(url, model, warm_prompts, 8))
        asyncio.run(sequential(url, model, warm_prompts[:1], 8))
        time.sleep(1.0)
        wait_for_quiet(wait_quiet_s, log=log)  # the server idles: its own CPU counts as foreign here
        server.sampler.start_window()
        with CpuWindow(server.pids()) as cpu:
            reqs = asyncio.run(burst(url, model, batch_prompts, max_tokens))
        batch = batch_summary(reqs, max_tokens)
        batch.update(cpu.result)
        batch["peak_rss_mib"] = dict(server.sampler.window_peak)
        single = single_summary(asyncio.run(sequential(url, model, single_prompts, single_tokens)), single_tokens)
        time.sleep(0.2)
        life_peak = dict(server.sampler.life_peak)
        info = server.describe()
    finally:
        server.stop()
    rss = " ".join(f"{g} {v:.0f}" for g, v in life_peak.items())
    log(f"[{server.name}] batch {batch['tokens_per_s']:7.1f} tok/s  TTFT median {batch['ttft_median_s'] * 1e3:7.1f} ms "
        f"p99 {batch['ttft_p99_s'] * 1e3:7.1f} ms  TPOT {batch['tpot_median_s'] * 1e3:6.1f} ms  "
        f"single {single['tokens_per_s']:6.1f} tok/s (TTFT {single['ttft_median_s'] * 1e3:.1f} ms)  "
        f"peak RSS MiB: {rss}  foreign cores {batch['foreign_cores'] or 0:.2f}")
    return {"startup_s": server.started_s, "model_id": server.model_id, **info, "batch": batch, "single": single,
            "peak_rss_life_mib": life_peak, "logs": str(server.log_dir)}
