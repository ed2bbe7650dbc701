"""The rules a generation request obeys, written once for every service that checks them.

The frontend checks a request before it admits it (`tessera_frontend.validation` for both
of its APIs, `AsyncLLM` for what needs the model once the prompt is tokenized); the engine
checks it again when it arrives (`EngineCore.check_request`; in-process callers may also
use `SamplingParams.validate`), since a client may call the engine directly. Both sides
call into this module, so a rule, its bounds and its message are the same wherever a
request is refused.

- `SAMPLING_RANGES`: one row per numeric SamplingParams field, its range (a bound may be
  a server cap of `SamplingCaps`, or another field), read by `sampling_problem`;
- `sampling_problem(params, caps)`: the first field out of range, caps included. It takes
  the wire message (tessera.v1.SamplingParams: absent fields are not checked), the
  engine's SamplingParams dataclass (None fields are absent) or a mapping of the present
  values;
- `request_problem(params, prompt_token_ids, ...)`: everything above plus what needs the
  model and the engine: token ids inside the vocabulary, top_k, n against the engine's
  sequence slots, prompt + max_tokens within max_model_len and the KV cache;
- `CHAT_ROLES`: the roles a chat message may have (the tokenizer's chat template takes them).

A problem is a `Problem(field, detail, code)`: `code` is a grpc.StatusCode name and str()
of it is "<field>: <detail>", the field first, as both services send it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

# The roles the tokenizer's chat template accepts.
CHAT_ROLES = ("system", "user", "assistant", "tool")

LOGIT_BIAS_RANGE = (-100, 100)  # OpenAI's


class Problem(NamedTuple):
    """Why a request is refused: the field, what is wrong with it, the grpc.StatusCode name."""
    field: str
    detail: str
    code: str = "INVALID_ARGUMENT"

    def __str__(self) -> str:
        return f"{self.field}: {self.detail}"


@dataclasses.dataclass(frozen=True)
class SamplingCaps:
    """Server-side caps on what a request may ask for; None: no cap (the engine's own caps that
    need its configuration, e.g. max_num_seqs, are `request_problem` arguments)."""
    max_n: int | None = None
    max_logprobs: int | None = None
    max_stop: int | None = None
    max_stop_chars: int | None = None   # length of one stop string
    max_stop_token_ids: int | None = None
    max_logit_bias: int | None = None   # tokens in one logit_bias map


NO_CAPS = SamplingCaps()


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric field's range. `low` / `high` None: unbounded on that side; `high` a str: the
    SamplingCaps cap of that name (None there: unbounded) or, failing that, the field of that
    name in the same request (absent: unbounded). A value that is not finite is out of range."""
    field: str
    low: float | None
    high: float | str | None = None
    low_open: bool = False  # `low` itself is out of range
    note: str = ""          # said after the range

    def bound(self, values: Mapping[str, Any], caps: SamplingCaps) -> tuple[Any, str] | None:
        """The upper bound's value and how the rule names it (None: unbounded)."""
        if self.high is None or not isinstance(self.high, str):
            return None if self.high is None else (self.high, f"{self.high}")
        if hasattr(caps, self.high):
            cap = getattr(caps, self.high)
            return None if cap is None else (cap, f"{cap}")
        value = values.get(self.high)
        return None if value is None else (value, f"{self.high} ({value})")

    def problem(self, value: Any, values: Mapping[str, Any], caps: SamplingCaps) -> Problem | None:
        high = self.bound(values, caps)
        ok = not (isinstance(value, float) and not math.isfinite(value))
        if ok and self.low is not None:
            ok = value > self.low if self.low_open else value >= self.low
        if ok and high is not None:
            ok = value <= high[0]
        if ok:
            return None
        if high is None:
            rule = f"{'>' if self.low_open else '>='} {self.low}"
        else:
            rule = f"in {'(' if self.low_open else '['}{self.low}, {high[1]}]"
        return Problem(self.field, f"must be {rule}{' ' + self.note if self.note else ''} (got {value})")


# One row per numeric field of SamplingParams, checked in this order.
SAMPLING_RANGES: tuple[Range, ...] = (
    Range("temperature", 0),
    Range("top_p", 0, 1, low_open=True),
    Range("top_k", -1, note="(-1 or 0 disables)"),
    Range("min_p", 0, 1),
    Range("repetition_penalty", 0, low_open=True),
    Range("presence_penalty", -2, 2),       # OpenAI's range
    Range("frequency_penalty", -2, 2),
    Range("max_tokens", 1),
    Range("min_tokens", 0, "max_tokens"),
    Range("n", 1, "max_n"),
    Range("logprobs", 0, "max_logprobs"),
    Range("prompt_logprobs", 0, "max_logprobs"),
)
RANGED_FIELDS = tuple(r.field for r in SAMPLING_RANGES)


def present_values(params: Any) -> dict[str, Any]:
    """The fields a request set, by name: from a tessera.v1.SamplingParams (HasField: absent
    fields are left out; `stop`, `stop_token_ids` and `logit_bias` always in), from the
    engine's SamplingParams (its None fields are left out), or a mapping as it is."""
    if isinstance(params, Mapping):
        return {"stop": (), "stop_token_ids": (), "logit_bias": {}, **params}
    if hasattr(params, "HasField"):  # the wire message
        values = {name: getattr(params, name) for name in RANGED_FIELDS if params.HasField(name)}
    else:
        values = {name: value for name in RANGED_FIELDS if (value := getattr(params, name, None)) is not None}
    values["stop"] = getattr(params, "stop", ())
    values["stop_token_ids"] = params.stop_token_ids
    values["logit_bias"] = params.logit_bias
    return values


def sampling_problem(params: Any, caps: SamplingCaps = NO_CAPS) -> Problem | None:
    """The first field of `params` out of its range or over a cap of `caps` (see
    `present_values` for what `params` may be); None when all is well."""
    return _sampling_problem(present_values(params), caps)


def _sampling_problem(values: Mapping[str, Any], caps: SamplingCaps) -> Problem | None:
    for rule in SAMPLING_RANGES:
        value = values.get(rule.field)
        if value is not None:
            problem = rule.problem(value, values, caps)
            if problem is not None:
                return problem
    stop: Sequence[str] = values.get("stop") or ()
    if caps.max_stop is not None and len(stop) > caps.max_stop:
        return Problem("stop", f"at most {caps.max_stop} stop strings (got {len(stop)})")
    if any(not s for s in stop):
        return Problem("stop", "stop strings must not be empty")
    if caps.max_stop_chars is not None and any(len(s) > caps.max_stop_chars for s in stop):
        return Problem("stop", f"a stop string has at most {caps.max_stop_chars} characters")
    stop_ids: Sequence[int] = values.get("stop_token_ids") or ()
    if caps.max_stop_token_ids is not None and len(stop_ids) > caps.max_stop_token_ids:
        return Problem("stop_token_ids", f"at most {caps.max_stop_token_ids} ids (got {len(stop_ids)})")
    if any(t < 0 for t in stop_ids):
        return Problem("stop_token_ids", "token ids must be >= 0")
    bias: Mapping[int, float] = values.get("logit_bias") or {}
    if caps.max_logit_bias is not None and len(bias) > caps.max_logit_bias:
        return Problem("logit_bias", f"at most {caps.max_logit_bias} tokens (got {len(bias)})")
    low, high = LOGIT_BIAS_RANGE
    for token, value in bias.items():
        if token < 0:
            return Problem("logit_bias", f"token ids must be >= 0 (got {token})")
        if not (math.isfinite(value) and low <= value <= high):
            return Problem("logit_bias", f"the bias of token {token} must be in [{low}, {high}] (got {value})")
    return None


def token_ids_problem(field: str, ids: Iterable[int], vocab_size: int) -> Problem | None:
    """The first id of `ids` outside the vocabulary [0, vocab_size) (vocab_size <= 0: not known,
    only negative ids are out)."""
    for t in ids:
        if t < 0 or (vocab_size > 0 and t >= vocab_size):
            return Problem(field, f"{t} is outside the vocabulary [0, {vocab_size})")
    return None


def request_problem(params: Any, prompt_token_ids: Sequence[int], *, vocab_size: int,
                    caps: SamplingCaps = NO_CAPS, max_model_len: int | None = None,
                    eos_token_ids: Iterable[int] = (), max_num_seqs: int | None = None,
                    kv_cache_tokens: int | None = None, kv_tokens_needed: int | None = None,
                    kv_full_code: str = "RESOURCE_EXHAUSTED", prompt_field: str = "prompt_token_ids",
                    check_prompt_ids: bool = True) -> Problem | None:
    """The first reason this request cannot run, or None: the engine's whole intake check, and
    the frontend's once the prompt is tokenized and its defaults applied.

    In order: `sampling_problem(params, caps)`; top_k at most the vocabulary; n at most
    `max_num_seqs` (the engine's sequence slots; None: not checked); stop_token_ids,
    `eos_token_ids` and logit_bias's tokens inside the vocabulary; the prompt not empty and
    (`check_prompt_ids`) its ids inside the vocabulary, named `prompt_field`; prompt +
    max_tokens within `max_model_len`; then the KV cache: `kv_tokens_needed` (default prompt
    + max_tokens; an engine with a sliding window needs less, rounded up to its blocks)
    at most `kv_cache_tokens` (None: not checked), else `kv_full_code`. Every other problem
    is INVALID_ARGUMENT. `params` is what `sampling_problem` takes; max_tokens and n absent
    (a wire message without defaults) skip the checks that need them. The callers:
    EngineCore.check_request (with its caps, KV pool and sliding window) and AsyncLLM's
    prompt check (a KV cache too small is INVALID_ARGUMENT there).
    """
    values = present_values(params)
    problem = _sampling_problem(values, caps)
    if problem is not None:
        return problem
    top_k = values.get("top_k")
    if vocab_size > 0 and top_k is not None and top_k > vocab_size:
        return Problem("top_k", f"must be at most the vocabulary size ({vocab_size}) (got {top_k})")
    n = values.get("n")
    if max_num_seqs is not None and n is not None and n > max_num_seqs:
        return Problem("n", f"must be at most max_num_seqs ({max_num_seqs}) (got {n})")
    for field, ids in (("stop_token_ids", values["stop_token_ids"]), ("eos_token_ids", eos_token_ids),
                       ("logit_bias", values["logit_bias"])):
        problem = token_ids_problem(field, ids, vocab_size)
        if problem is not None:
            return problem
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        return Problem(prompt_field, "must not be empty (the prompt has no tokens)")
    if check_prompt_ids:
        problem = token_ids_problem(prompt_field, prompt_token_ids, vocab_size)
        if problem is not None:
            return problem
    max_tokens = values.get("max_tokens")
    if max_tokens is None:
        return None
    total = num_prompt + max_tokens
    if max_model_len and total > max_model_len:
        return Problem("max_tokens", f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the "
                                     f"model's max length (max_model_len {max_model_len})")
    needed = total if kv_tokens_needed is None else kv_tokens_needed
    if kv_cache_tokens and needed > kv_cache_tokens:
        return Problem("max_tokens", f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs {needed} "
                                     f"tokens of KV cache, more than the engine's KV cache holds "
                                     f"({kv_cache_tokens} tokens)", kv_full_code)
    return None


def resumed_problem(resumed: Mapping[int, Sequence[int]], params: Any, vocab_size: int) -> Problem | None:
    """A migrated request's resumed samples (EngineRequest.resumed): each index one of its n
    samples, its tokens inside the vocabulary and fewer than max_tokens (a sample that reached
    max_tokens has finished: there is nothing to resume)."""
    n = getattr(params, "n", 1) or 1
    for index, ids in resumed.items():
        if not 0 <= index < n:
            return Problem("resumed", f"sample index {index} is not one of the request's n = {n} samples")
        if len(ids) >= params.max_tokens:
            return Problem("resumed", f"sample {index} already has {len(ids)} output tokens, max_tokens "
                                      f"{params.max_tokens}: it has finished")
        problem = token_ids_problem("resumed", ids, vocab_size)
        if problem is not None:
            return problem
    return None
