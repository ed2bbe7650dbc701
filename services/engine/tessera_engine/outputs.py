"""The typed messages of one engine step, in the order they flow:

  Scheduler.schedule ─ SchedulerOutput ─▶ ModelRunner.execute ─ ModelRunnerOutput ─▶
  Scheduler.update_from_output ─ EngineCoreOutputs (an EngineCoreOutput per sample, the
  step's IterationStats) ─▶ the core loop's callback.

EngineCoreOutput and EngineStats map onto tessera.v1's RequestOutput and EngineStats.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from tessera_engine.kv_cache import KVCopy
from tessera_engine.request import Sample, SampleKey


class TokenLogprobs(NamedTuple):
    """One position's logprobs: the chosen token's and the top-N alternatives (N may be 0)."""
    token_id: int
    logprob: float
    rank: int                 # 1 = the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


@dataclasses.dataclass
class ScheduledSample:
    """One sample's share of a step: num_new_tokens of its tokens from position start."""
    sample: Sample
    num_new_tokens: int
    start: int  # position of the first token computed this step (= tokens computed before)
    block_tables: tuple[list[int], ...]  # the sample's blocks, per KV cache group (live views kept by the KV cache manager)
    # speculative decoding: guessed tokens after the sample's last one, computed in this step
    # too (num_new_tokens = 1 + len(draft_token_ids)); every row samples, to verify them
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled."""
        return self.start + self.num_new_tokens == self.sample.num_tokens + len(self.draft_token_ids)


@dataclasses.dataclass
class SchedulerOutput:
    """What one step computes (the scheduler's decision, the model runner's input)."""
    scheduled: list[ScheduledSample]
    preempted: list[Sample]
    num_batched_tokens: int
    # partial prefix-cache hits: slots copied between blocks before the step's attention reads them
    kv_copies: list[KVCopy] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclasses.dataclass
class ModelRunnerOutput:
    """What one forward pass produced (the model runner's output, the scheduler's input)."""
    sampled: dict[SampleKey, int]                   # a new token for each sample that reached its end
    logprobs: dict[SampleKey, TokenLogprobs]        # that token's logprobs, when asked
    # the logprobs of the prompt positions this step computed, when asked (None: the first position)
    prompt_logprobs: dict[SampleKey, list[TokenLogprobs | None]]
    # speculative decoding: the guessed tokens the sampler agreed with, which come before the
    # sampled token (so the sample gains len + 1 tokens)
    accepted: dict[SampleKey, list[int]] = dataclasses.field(default_factory=dict)
    # and, when asked, the logprobs of each accepted guess (the sampled token's are in logprobs)
    accepted_logprobs: dict[SampleKey, list[TokenLogprobs]] = dataclasses.field(default_factory=dict)


class RequestError(NamedTuple):
    code: str     # a grpc.StatusCode name
    message: str


@dataclasses.dataclass
class RequestTiming:
    """A finished sample's timestamps (unix seconds; None when it never got there) and
    token count: the raw material of the request metrics and the 'request finished' log line."""
    queued: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float
    num_generation_tokens: int
    num_steps: int = 0          # engine steps it took part in (prefill chunks, decodes)
    num_prefill_steps: int = 0  # of those, the steps up to its first token
    num_preemptions: int = 0


@dataclasses.dataclass
class EngineCoreOutput:
    """One sample's progress in one step (maps onto tessera.v1.RequestOutput)."""
    request_id: str
    index: int
    client_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    # once, with the first token, when asked: one entry per prompt position (the first is None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # stop, length, abort, error
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: RequestError | None = None
    timing: RequestTiming | None = None  # set on a finished sample's last output


@dataclasses.dataclass
class IterationStats:
    """What one engine step did (one record per step that ran; the metrics' per-step input)."""
    step: int
    duration_s: float           # schedule + execute + outputs, wall clock
    num_batched_tokens: int     # tokens the model computed this step (prefill chunks + decodes)
    num_prompt_tokens: int      # prompt lengths of the samples that got their first token
    num_generation_tokens: int  # tokens sampled (= new_token_ids emitted) this step
    num_preempted: int
    num_drafts: int = 0           # speculative decoding: samples that had guesses verified
    num_draft_tokens: int = 0     # guesses verified
    num_accepted_tokens: int = 0  # of those, accepted


@dataclasses.dataclass
class EngineStats:
    """The scheduler and KV cache's state (maps onto tessera.v1.EngineStats)."""
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    kv_cache_usage: float
    # LoRA: the adapters of the running and of the waiting requests (None: LoRA off)
    lora_running: tuple[str, ...] | None = None
    lora_waiting: tuple[str, ...] | None = None


@dataclasses.dataclass
class EngineCoreOutputs:
    """One step's result: every sample's output, and the step's stats (None when no step ran)."""
    outputs: list[EngineCoreOutput]
    iteration: IterationStats | None = None
