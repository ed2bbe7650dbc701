"""Speculative decoding: the configuration (vLLM's --speculative-config) and the n-gram proposer.

A proposer guesses the next k tokens of a running sample; the scheduler schedules them after
the sample's last token as one chunk of 1 + k rows, the model scores every row in the same
batched forward pass (each row attends as a decode of its own position, so a row's result is
the one plain decoding would give: batch invariance), and the model runner keeps the longest
run of guesses the sampler agrees with, plus the sampler's own token after it. The sampler
draws each row at its own output position from (seed, sample, position) (sampler.py), so the
verified tokens are exactly those decoding without speculation would have produced, greedy or
sampled: for a proposer whose guesses are certain (n-gram) this exact-match rule accepts a
guess d with probability p(d), as rejection sampling does, and a rejected row's token is a
draw from p restricted to the other tokens, the residual distribution. The KV slots of
rejected guesses are simply written again later (the sample's computed count only advances
over accepted ones; prefix-cache blocks are published from known tokens only).

Methods:
- ngram (prompt lookup decoding, vLLM's `ngram`): the longest suffix of the sample's tokens
  (prompt_lookup_max down to prompt_lookup_min tokens) that occurred before, latest
  occurrence first; the tokens that followed it are the guesses.
- draft_model (vLLM's `draft_model`, `model` naming it): a smaller model with the target's
  vocabulary decodes the guesses greedily, with its own paged KV cache (draft_model.py).

A proposer has one interface, whichever the method: its `config`, propose_many((key, tokens,
k), ...) for the step's samples at once, cost(samples, k) for the seconds that takes (after
measure_cost at start), release(key) when a sample ends. The engine core builds it and hands it
to the scheduler.

Per request, speculation is off where the sampler's result at a row would depend on the
guesses before it in ways the verification does not replay: penalties (counted over the output
so far), an output constraint (its mask advances token by token), min_tokens not reached yet
(EOS masked by count), or prompt logprobs still to compute. Logprobs are served: each row's are
those of the token it drew, which for an accepted guess is the guess.

Per step, speculation runs only where it pays, by measurement (StepCost): the engine times
its forward pass at a range of row counts at start; a step's guesses go in when the tokens
they are expected to add (each sample's acceptance rate so far, an EMA) per second of the
longer step beat the plain step's tokens per second. A large batch is compute-bound (k more
rows a sample cost about k times the time), so speculation turns itself off there, as vLLM's
disable_by_batch_size does by a set number. A disable_by_batch_size given in the configuration
decides instead: speculation in every step with at most that many running samples.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # no speculation in a step with more running samples than this (vLLM's name); None: the
    # limit measured on this machine (backend_plan), 0: never off
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft's path (a GGUF file or an HF directory)

    @classmethod
    def parse(cls, text: str | dict | None) -> "SpeculativeConfig | None":
        """From --speculative-config's JSON (or its dict); None or empty: no speculation. Raises
        ValueError naming the key that is wrong."""
        if text is None or text == "" or text == {}:
            return None
        if isinstance(text, str):
            try:
                raw = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        else:
            raw = dict(text)
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if "method" not in raw:
            raise ValueError(f"--speculative-config needs a method ({', '.join(METHODS)})")
        config = cls(**raw)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(METHODS)}, not {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config: {name} must be an integer >= 1, not {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("--speculative-config: prompt_lookup_min must be <= prompt_lookup_max")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("--speculative-config: method draft_model needs a model (the draft's path)")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"--speculative-config: model is the draft_model method's, not {self.method}'s")
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 0):
            raise ValueError(f"--speculative-config: disable_by_batch_size must be an integer >= 0, not {d!r}")


INITIAL_ACCEPTANCE = 0.5  # a sample's acceptance rate before any of its guesses were verified
ACCEPTANCE_EMA = 0.3      # weight of a step's verified guesses in a sample's rate
# a sample that did not speculate in a step drifts this much back towards INITIAL_ACCEPTANCE, so
# that one whose guesses failed a while ago (the answer moved on to new text) tries again
ACCEPTANCE_RECOVERY = 0.1


def expected_accepted(alpha: float, k: int) -> float:
    """Guesses expected to be accepted of k, each accepted with probability alpha after the last."""
    if alpha >= 1.0:
        return float(k)
    return alpha * (1 - alpha ** k) / (1 - alpha)


class StepCost:
    """A step's forward time by its number of rows, measured on the loaded model at start and
    interpolated linearly between the measured row counts (beyond the last: proportionally)."""

    ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    def __init__(self, table: dict[int, float]) -> None:
        self.rows = sorted(table)
        self.seconds = [table[r] for r in self.rows]

    def __call__(self, rows: int) -> float:
        if rows <= self.rows[0]:
            return self.seconds[0]
        for (r0, t0), (r1, t1) in zip(zip(self.rows, self.seconds), zip(self.rows[1:], self.seconds[1:])):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        return self.seconds[-1] * rows / self.rows[-1]

    def pays(self, rows: int, extra_rows: int, expected_extra_tokens: float, tokens: int,
             overhead: float = 0.0) -> bool:
        """Whether adding extra_rows (guesses) that are expected to yield expected_extra_tokens
        raises the step's tokens per second (tokens: what the plain step yields; overhead: the
        seconds the guesses take to make)."""
        return (tokens + expected_extra_tokens) * self(rows) > tokens * (self(rows + extra_rows) + overhead)


class NgramProposer:
    """Prompt lookup: guesses from the sample's own prompt and output."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (max_n down to min_n long); [] when none occurred."""
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        arr = np.asarray(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = arr[length - n:]
            # starts of earlier occurrences with at least one token after them
            starts = np.flatnonzero(arr[:length - n] == suffix[0])
            for j in range(1, n):
                if not starts.size:
                    break
                starts = starts[arr[starts + j] == suffix[j]]
            if starts.size:
                i = int(starts[-1]) + n
                return tokens[i:i + k]
        return []

    def propose_many(self, items: list[tuple]) -> dict:
        """propose for each (key, tokens, k); only the samples with guesses."""
        out = {}
        for key, tokens, k in items:
            guess = self.propose(tokens, k)
            if guess:
                out[key] = guess
        return out

    def measure_cost(self) -> None:
        pass  # nothing to time: see cost

    def cost(self, samples: int, k: int) -> float:
        return 0.0  # lookups: microseconds, against milliseconds of a step

    def release(self, key) -> None:
        pass


def speculation_allowed(sample) -> bool:
    """Whether a sample's rows can be verified by the sampler alone (see the module doc)."""
    p = sample.params
    return (not p.has_penalties and sample.constraint is None
            and sample.prompt_logprobs_done and sample.num_output_tokens >= p.min_tokens)
