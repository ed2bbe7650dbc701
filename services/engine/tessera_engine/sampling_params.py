"""SamplingParams inside the engine (mirrors tessera.v1.SamplingParams with defaults applied)."""
from __future__ import annotations

import dataclasses
import math

from tessera.common.constraints import StructuredOutputSpec


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

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (ranges that need the model or the
        engine's caps are EngineCore.check_request's)."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):  # NaN passes every comparison below
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:  # OpenAI's range
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        for token, bias in self.logit_bias.items():
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}")

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
