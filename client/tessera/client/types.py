"""The typed results (frozen dataclasses, not protos) and their making from the wire messages.

`Completion` is Complete's whole answer (`choices`, `usage`); `Delta` is one streamed piece of
one choice (Generate). finish_reason is OpenAI's word: "stop", "length", "abort" or "error"
(None while the choice runs). With tools, a choice's `tool_calls` are the calls parsed from its
text (`tool_calls.AutoParser` and friends) and `content` the text outside them.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from tessera.client.tool_calls import ToolCall
from tessera.v1 import common_pb2, frontend_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int      # 1-based rank among the vocabulary
    token: str     # the token's text


@dataclasses.dataclass(frozen=True)
class PositionLogprobs:
    """The chosen token at one position and the top alternatives."""
    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass(frozen=True)
class Delta:
    """One streamed piece of choice `index`: the new text and token ids since its last piece.
    The choice's last piece has finish_reason (and, with tools, its parsed tool_calls); the
    request's very last piece has usage."""
    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[PositionLogprobs, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | None = None         # the stop string that ended the choice
    stop_token_id: int | None = None       # the stop token (eos or stop_token_ids) that ended it
    usage: Usage | None = None
    prompt_logprobs: tuple[PositionLogprobs | None, ...] = ()  # the request's first piece only (see Completion)
    tool_calls: tuple[ToolCall, ...] = ()  # on a choice's last piece, when tools were given
    content: str | None = None             # the choice's whole text outside its tool calls, idem

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class Choice:
    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[PositionLogprobs, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | None = None
    stop_token_id: int | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # parsed from text when tools were given
    content: str | None = None             # text outside the tool calls (None: only calls); text when no tools


@dataclasses.dataclass(frozen=True)
class Completion:
    """Complete's whole answer: `n` choices ordered by index."""
    request_id: str
    choices: tuple[Choice, ...]
    usage: Usage
    # One per prompt token, when asked: None for the first (nothing predicts it), as vLLM's.
    prompt_logprobs: tuple[PositionLogprobs | None, ...] = ()

    @property
    def text(self) -> str:
        """The first choice's text."""
        return self.choices[0].text if self.choices else ""


def token_logprob(p: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(p.token_id, p.logprob, p.rank, p.token)


def position_logprobs(items: Sequence[common_pb2.PositionLogprobs]) -> tuple[PositionLogprobs, ...]:
    return tuple(PositionLogprobs(token_logprob(p.chosen), tuple(token_logprob(t) for t in p.top)) for p in items)


def prompt_logprobs(items: Sequence[common_pb2.PositionLogprobs]) -> tuple[PositionLogprobs | None, ...]:
    """The first prompt position comes as an empty placeholder (rank 0: real ranks are 1-based)."""
    return tuple(None if p.chosen.rank == 0 and not p.top else one
                 for p, one in zip(items, position_logprobs(items)))


def usage(u: common_pb2.Usage) -> Usage:
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)


def delta(m: frontend_pb2.GenerateResponse) -> Delta:
    return Delta(
        request_id=m.request_id, index=m.index, text=m.text, token_ids=tuple(m.token_ids),
        logprobs=position_logprobs(m.logprobs), finish_reason=FINISH_REASONS.get(m.finish_reason),
        stop_reason=m.stop_reason if m.HasField("stop_reason") else None,
        stop_token_id=m.stop_token_id if m.HasField("stop_token_id") else None,
        usage=usage(m.usage) if m.HasField("usage") else None,
        prompt_logprobs=prompt_logprobs(m.prompt_logprobs))


def completion(r: frontend_pb2.GenerateResult) -> Completion:
    choices = tuple(Choice(
        index=c.index, text=c.text, token_ids=tuple(c.token_ids), logprobs=position_logprobs(c.logprobs),
        finish_reason=FINISH_REASONS.get(c.finish_reason),
        stop_reason=c.stop_reason if c.HasField("stop_reason") else None,
        stop_token_id=c.stop_token_id if c.HasField("stop_token_id") else None,
        content=c.text) for c in r.choices)
    return Completion(r.request_id, choices, usage(r.usage), prompt_logprobs(r.prompt_logprobs))


# -- the calls beside Generate / Complete -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Model:
    """A model requests may name (ListModels): the base model, or a LoRA adapter (`parent` set)."""
    id: str
    root: str = ""
    parent: str = ""
    max_model_len: int = 0


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Tokenize's answer: the ids, the text tokenized (for chat: the rendered prompt)."""
    token_ids: tuple[int, ...]
    text: str
    max_model_len: int = 0
    token_strs: tuple[str, ...] = ()                # when return_token_strs
    offsets: tuple[tuple[int, int], ...] = ()       # (start, end) per token, when return_offsets


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """GetServerInfo: what the server is and the limits a request must keep to (frontend.proto)."""
    version: str = ""
    model: str = ""
    max_model_len: int = 0
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    has_chat_template: bool = False
    max_inflight_requests: int = 0
    max_n: int = 0
    max_logprobs: int = 0
    max_stop: int = 0
    max_stop_chars: int = 0
    max_stop_token_ids: int = 0
    max_logit_bias: int = 0
    max_request_id_chars: int = 0
    kv_cache_tokens: int = 0
    allow_runtime_lora_updating: bool = False


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str = ""
    rank: int = 0
    target_modules: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LoRAAdapters:
    adapters: tuple[LoRAAdapter, ...] = ()
    enabled: bool = False       # the engine runs with --enable-lora
    max_loras: int = 0
    max_lora_rank: int = 0


def same_fields(cls, message):
    """A dataclass of `cls` from the proto fields of the same names (repeated ones as tuples)."""
    values = {}
    for field in dataclasses.fields(cls):
        value = getattr(message, field.name)
        values[field.name] = value if isinstance(value, (str, int, float, bool)) else tuple(value)
    return cls(**values)


def tokens(r) -> Tokens:
    offsets = list(r.offsets)
    return Tokens(tuple(r.token_ids), r.text, r.max_model_len, tuple(r.token_strs),
                  tuple(zip(offsets[0::2], offsets[1::2])))


def lora_adapters(r: common_pb2.LoRAAdapters) -> LoRAAdapters:
    return LoRAAdapters(tuple(same_fields(LoRAAdapter, a) for a in r.adapters), r.enabled, r.max_loras, r.max_lora_rank)
