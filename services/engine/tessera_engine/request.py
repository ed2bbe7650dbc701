"""EngineCoreRequest (what a client submits, tokenized) and Sample (one sample being generated, with its state)."""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import NamedTuple

from tessera_engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"


class SampleKey(NamedTuple):
    """Names one sample: a request id and which of its n samples (0 when n == 1)."""
    request_id: str
    index: int


@dataclasses.dataclass
class EngineCoreRequest:
    """What a client submits: already tokenized."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.time)
    eos_token_ids: list[int] | None = None
    client_id: str = ""  # which session (frontend stream) gets the outputs
    # When this engine received it (unix seconds): the start of its queue time.
    received_time: float = dataclasses.field(default_factory=time.time)
    # A request migrated from another replica: sample index -> the output tokens it already
    # produced; only these samples run, each continuing after its tokens. None: a new request.
    resumed: dict[int, list[int]] | None = None
    # the LoRA adapter it runs with (lora.LoRAManager's name); "" = the base model
    lora_name: str = ""

    def sample_indices(self) -> list[int]:
        return sorted(self.resumed) if self.resumed else list(range(self.sampling_params.n))


class Sample:
    """One sample of an EngineCoreRequest; n > 1 makes n of these (index 0..n-1)."""

    def __init__(self, core_req: EngineCoreRequest, index: int, eos_token_ids: list[int]) -> None:
        resumed = list((core_req.resumed or {}).get(index, ()))
        self.request_id = core_req.request_id
        self.index = index
        self.key = SampleKey(core_req.request_id, index)
        self.client_id = core_req.client_id
        self.prompt_token_ids = list(core_req.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.params = core_req.sampling_params
        self.priority = core_req.priority
        self.arrival_time = core_req.arrival_time
        self.eos_token_ids = set(eos_token_ids)
        self.stop_token_ids = set(self.params.stop_token_ids)
        # a resumed sample's earlier outputs are computed with the prompt, as after a preemption
        self.all_token_ids: list[int] = self.prompt_token_ids + resumed
        self.output_token_ids: list[int] = resumed
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from prefix cache, set on first schedule
        self.status = RequestStatus.WAITING
        self.stop_token_id: int | None = None
        # the seed its draws are keyed on (sampler.counter_uniform); an unseeded sample gets one
        # from the sampler at its first draw (the frontend seeds every request at admission)
        self.seed: int | None = self.params.seed
        self.constraint = None  # structured_output.Constraint, set by EngineCore.add_request
        # LoRA (set by EngineCore.add_request): the adapter it runs with (None: the base model),
        # and the root of its prefix-cache hash chain (kv_cache: KV is shared only within one adapter)
        self.lora: object | None = None
        self.cache_salt: bytes | None = None
        self.prompt_logprobs_done = self.params.prompt_logprobs is None or bool(resumed)
        self.prompt_logprobs: list = []  # gathered over prefill chunks, sent with the first token
        # Timestamps (unix seconds) for the request metrics: queue = first scheduled - queued,
        # prefill = first token - first scheduled, decode = last token - first token.
        self.queued_time = core_req.received_time
        self.first_scheduled_time: float | None = None  # set by the scheduler
        self.first_token_time: float | None = None      # set by Scheduler.update_from_output
        self.last_token_time: float | None = None
        # the engine steps it took part in (prefill chunks and decodes; a trace's summary) and
        # how often it was preempted
        self.num_steps = 0
        self.num_prefill_steps = 0  # the steps up to and including its first token's
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Update status after a token was appended; True when the request is finished."""
        last = self.output_token_ids[-1]
        n_out = len(self.output_token_ids)
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in self.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_token_id = last
                return True
        if n_out >= self.params.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def __repr__(self) -> str:
        return (f"Sample({self.request_id!r}#{self.index}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
