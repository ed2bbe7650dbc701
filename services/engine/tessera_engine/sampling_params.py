"""SamplingParams inside the engine (mirrors tessera.v1.SamplingParams with defaults applied)."""
from __future__ import annotations

import dataclasses

from tessera.common.constraints import StructuredOutputSpec
from tessera.common.request_rules import NO_CAPS, SamplingCaps, sampling_problem


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutputSpec | None = None  # structured_output.py
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self, caps: SamplingCaps = NO_CAPS) -> None:
        """Raise ValueError naming the first field out of its range ("top_p: must be in (0, 1]
        (got 1.5)"); the rules are tessera.common.request_rules', shared with the frontend
        (what needs the model or the engine's caps is EngineCore.check_request's)."""
        problem = sampling_problem(self, caps)
        if problem is not None:
            raise ValueError(str(problem))

    @classmethod
    def from_proto(cls, pb) -> "SamplingParams":
        """Build from a tessera.v1.SamplingParams, applying defaults for absent fields."""
        p = cls()
        for name in ("temperature", "top_p", "min_p", "seed", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "max_tokens", "min_tokens", "n",
                     "logprobs", "prompt_logprobs"):
            if pb.HasField(name):
                setattr(p, name, getattr(pb, name))
        if pb.HasField("top_k"):
            p.top_k = pb.top_k if pb.top_k != 0 else -1
        p.stop_token_ids = list(pb.stop_token_ids)
        p.ignore_eos = pb.ignore_eos
        if pb.HasField("structured_output"):
            p.structured = StructuredOutputSpec.from_proto(pb.structured_output)
        p.logit_bias = dict(pb.logit_bias)
        return p
