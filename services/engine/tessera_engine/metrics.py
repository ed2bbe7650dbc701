"""The engine's Prometheus metrics (vLLM's engine metrics, prefix `tessera:`) and its
one structured 'request finished' log line per sample.

EngineCore knows nothing of Prometheus: its run loop hands the server, once per step, the
scheduler snapshot (EngineStats), the step's IterationStats and the outputs; finished
outputs carry a RequestTiming. `EngineMetrics` turns those into metrics on the server's
event-loop thread: a few gauge sets and counter increments per step, histogram
observations per step and per finished sample, nothing per token.

See docs/metrics.md for the table of names, types, labels and vLLM equivalents.
"""
from __future__ import annotations

import logging

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from tessera.common.logs import client_request_id
from tessera.common.metrics import (ITERATION_TOKENS_BUCKETS, REQUEST_LATENCY_BUCKETS, STEP_TIME_BUCKETS,
                                    build_1_2_5_buckets)
from tessera_engine.outputs import EngineCoreOutput, EngineStats, IterationStats

request_log = logging.getLogger("tessera.engine.requests")

FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    """Every engine metric, bound to the served model's name (label `model_name`, as vLLM)."""

    def __init__(self, model_name: str, max_model_len: int, *, block_size: int, num_blocks: int,
                 enable_prefix_caching: bool, registry: CollectorRegistry = REGISTRY) -> None:
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=registry).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

        # scheduler state (set from each step's EngineStats)
        self.running = gauge("tessera:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("tessera:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("tessera:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("tessera:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("tessera:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("tessera:num_preemptions", "Cumulative number of preemption from the engine.")
        # per step
        self.prompt_tokens = counter("tessera:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("tessera:generation_tokens", "Number of generation tokens processed.")
        self.iteration_tokens = histogram("tessera:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        # speculative decoding (vLLM's spec_decode counters)
        self.spec_drafts = counter("tessera:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("tessera:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = counter("tessera:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.step_time = histogram("tessera:engine_step_duration_seconds",
                                   "Histogram of engine step (schedule + execute) time in seconds.",
                                   STEP_TIME_BUCKETS)
        # LoRA (vLLM's lora_requests_info): one series, its labels the adapters of the running and
        # of the waiting requests (comma-separated) and max_lora, its value when they last changed
        self.lora_info = Gauge("tessera:lora_requests_info", "Running stats on lora requests.",
                               ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=registry)
        self._lora_labels: tuple[str, str, str] | None = None
        self.max_lora = 0  # set by the server when LoRA is on
        # per finished sample
        success = Counter("tessera:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=registry)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("tessera:request_prompt_tokens",
                                               "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("tessera:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.queue_time = histogram("tessera:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("tessera:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("tessera:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("tessera:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        info = Gauge("tessera:cache_config_info", "Information of the engine's KV cache config.",
                     ["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=registry)
        info.labels(model_name, str(block_size), str(num_blocks), str(enable_prefix_caching).lower()).set(1)
        # the scheduler's cumulative counts as last seen (the counters advance by the difference)
        self._queries = self._hits = self._preemptions = 0

    def record_step(self, stats: EngineStats, iteration: IterationStats | None) -> None:
        """Once per loop iteration that did something: gauges, cumulative counters, step histograms."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.prefix_cache_queries != self._queries:
            self.prefix_queries.inc(stats.prefix_cache_queries - self._queries)
            self._queries = stats.prefix_cache_queries
        if stats.prefix_cache_hits != self._hits:
            self.prefix_hits.inc(stats.prefix_cache_hits - self._hits)
            self._hits = stats.prefix_cache_hits
        if stats.num_preemptions != self._preemptions:
            self.preemptions.inc(stats.num_preemptions - self._preemptions)
            self._preemptions = stats.num_preemptions
        if stats.lora_running is not None:
            labels = (",".join(stats.lora_running), ",".join(stats.lora_waiting), str(self.max_lora))
            if labels != self._lora_labels:  # one series: the last state, as a scrape should see it
                if self._lora_labels is not None:
                    self.lora_info.remove(*self._lora_labels)
                self.lora_info.labels(*labels).set_to_current_time()
                self._lora_labels = labels
        if iteration is not None:
            self.step_time.observe(iteration.duration_s)
            self.iteration_tokens.observe(iteration.num_batched_tokens)
            if iteration.num_prompt_tokens:
                self.prompt_tokens.inc(iteration.num_prompt_tokens)
            if iteration.num_generation_tokens:
                self.generation_tokens.inc(iteration.num_generation_tokens)
            if iteration.num_drafts:
                self.spec_drafts.inc(iteration.num_drafts)
                self.spec_draft_tokens.inc(iteration.num_draft_tokens)
                self.spec_accepted_tokens.inc(iteration.num_accepted_tokens)

    def record_finished(self, out: EngineCoreOutput) -> None:
        """A sample finished (stop, length, abort or error): count it, observe its phases, log one line."""
        reason = out.finish_reason or "error"
        self.success[reason].inc()
        line = {"request_id": client_request_id(out.request_id), "engine_request_id": out.request_id,
                "index": out.index, "finish_reason": reason, "prompt_tokens": out.num_prompt_tokens,
                "cached_tokens": out.num_cached_tokens, "generation_tokens": 0}
        t = out.timing
        if t is not None:
            line["generation_tokens"] = t.num_generation_tokens
            self.request_prompt_tokens.observe(out.num_prompt_tokens)
            self.request_generation_tokens.observe(t.num_generation_tokens)
            if t.scheduled is not None:
                line["queue_s"] = _seconds(t.scheduled - t.queued)
                self.queue_time.observe(max(t.scheduled - t.queued, 0.0))
                if t.first_token is not None:
                    line["prefill_s"] = _seconds(t.first_token - t.scheduled)
                    self.prefill_time.observe(max(t.first_token - t.scheduled, 0.0))
                if t.last_token is not None:
                    line["inference_s"] = _seconds(t.last_token - t.scheduled)
                    self.inference_time.observe(max(t.last_token - t.scheduled, 0.0))
            if t.first_token is not None and t.last_token is not None:
                line["decode_s"] = _seconds(t.last_token - t.first_token)
                self.decode_time.observe(max(t.last_token - t.first_token, 0.0))
            line["engine_s"] = _seconds(t.finished - t.queued)
        if out.error is not None:
            line["error_code"], line["error"] = out.error
        request_log.info("request finished", extra=line)


def _seconds(value: float) -> float:
    return round(max(value, 0.0), 6)
