"""Batched sampling on the model's device, each row with its own parameters.

Order per row: penalties (repetition on prompt + output, presence and
frequency on output), logit_bias, the output constraint's mask (structured
output: tokens it does not allow next are masked), min_tokens (stop tokens
masked), then greedy argmax or
temperature → top-k → top-p → min-p → a draw. A draw inverts the row's cumulative
distribution at one uniform number that is a counter-based hash of (seed, sample index,
output position): a sample's tokens depend on its own probabilities only, never on what
else is in the batch, how often it was preempted, or which engine replica draws them (a
request that migrates continues exactly as it would have).
Logprobs are the model's raw log-softmax (as vLLM v1 returns by default).
"""
from __future__ import annotations

import dataclasses
import random

import torch

from tessera_engine.ops import TorchOps
from tessera_engine.outputs import TokenLogprobs
from tessera_engine.request import Sample
from tessera_engine.structured_output import unpack_bitmask


@dataclasses.dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row, when asked


def compute_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: int):
    """Log-softmax rows; returns chosen logprob and rank, plus top-N ids and logprobs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = lp.gather(1, chosen.view(-1, 1)).squeeze(1)
    rank = (lp > chosen_lp.unsqueeze(1)).sum(dim=1) + 1
    top_lp, top_ids = lp.topk(num_top, dim=-1) if num_top > 0 else (None, None)
    return chosen_lp, rank, top_ids, top_lp


_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's step: a bijective hash of 64 bits."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def counter_uniform(seed: int, sample: int, position: int) -> float:
    """A uniform number in [0, 1) that depends on (seed, sample index, output position) only."""
    h = _mix64(_mix64(_mix64(seed & _M64) ^ (sample & _M64)) ^ (position & _M64))
    return (h >> 11) * (1.0 / (1 << 53))


def draw_rows(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """One token per row of probs [B, V] (each row's own scale), by inverting its cumulative
    sum (float64) at that row's uniform: the first token whose cumulative mass exceeds u * total,
    never a token of probability 0."""
    cdf = probs.double().cumsum(dim=-1)
    target = torch.tensor(uniforms, dtype=torch.float64, device=probs.device) * cdf[:, -1]
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


class _Unconstrained:
    constraint = None


_NO_CONSTRAINT = _Unconstrained()  # stands in for a row _constrain_greedy must leave alone


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, ops: TorchOps | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.ops = ops or TorchOps()  # the model runner's op backend (the greedy fast path's argmax)
        self._seeds = random.Random(0)  # seeds for samples that came without one

    def seed(self, seed: int) -> None:
        """Seed what gives unseeded samples their seeds (the engine's --seed)."""
        self._seeds.seed(seed)

    def _uniform(self, req: Sample, position: int | None) -> float:
        """The uniform number of this sample's draw at an output position (default: its next)."""
        if req.seed is None:
            req.seed = self._seeds.getrandbits(63)
        return counter_uniform(req.seed, req.index, req.num_output_tokens if position is None else position)

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Sample]) -> None:
        rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        if not rows:
            return
        V = logits.shape[1]
        for i in rows:  # few rows use penalties; keep each row's work vectorized
            r, p = reqs[i], reqs[i].params
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(r.all_token_ids, device=logits.device).unique()
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
                counts = torch.zeros(V, device=logits.device, dtype=row.dtype)
                counts.index_add_(0, torch.tensor(r.output_token_ids, device=logits.device),
                                  torch.ones(len(r.output_token_ids), device=logits.device, dtype=row.dtype))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, reqs: list[Sample]) -> None:
        for i, r in enumerate(reqs):
            bias = r.params.logit_bias
            if bias:
                ids = torch.tensor(list(bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)

    @staticmethod
    def _apply_constraints(logits: torch.Tensor, reqs: list[Sample]) -> None:
        rows = [i for i, r in enumerate(reqs) if r.constraint is not None]
        if not rows:
            return
        manager = reqs[rows[0]].constraint.manager
        bitmask = manager.new_bitmask(len(rows))
        for j, i in enumerate(rows):
            reqs[i].constraint.fill_bitmask(bitmask, j, reqs[i].output_token_ids)
        allowed = unpack_bitmask(bitmask, logits.shape[1]).to(logits.device)
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, reqs: list[Sample]) -> None:
        for i, r in enumerate(reqs):
            # a constrained sample ends when its constraint is complete, not before
            if r.num_output_tokens < r.params.min_tokens and r.constraint is None:
                blocked = set(r.stop_token_ids)
                if not r.params.ignore_eos:
                    blocked |= r.eos_token_ids
                if blocked:
                    logits[i, list(blocked)] = float("-inf")

    @staticmethod
    def _plain_greedy(r: Sample) -> bool:
        """Greedy with nothing that changes or reads the logits (penalties, logit_bias, min_tokens,
        logprobs) but, perhaps, an output constraint (see _constrain_greedy)."""
        p = r.params
        return (p.greedy and not p.has_penalties and p.logprobs is None and not p.logit_bias
                and (r.constraint is not None or not r.num_output_tokens < p.min_tokens))

    @staticmethod
    def _constrain_greedy(logits: torch.Tensor, reqs: list[Sample], tokens: list[int]) -> None:
        """Constrained greedy rows: the row's argmax when the constraint allows it (then it is
        also the argmax of the allowed tokens, first maximum included) - one token checked, no
        mask built; else the argmax over the constraint's mask."""
        for i, r in enumerate(reqs):
            if r.constraint is not None and not r.constraint.allows(tokens[i], r.output_token_ids):
                bitmask = r.constraint.manager.new_bitmask(1)
                r.constraint.fill_bitmask(bitmask, 0, r.output_token_ids)
                allowed = unpack_bitmask(bitmask, logits.shape[1])[0].to(logits.device)
                tokens[i] = int(logits[i].float().masked_fill(~allowed, float("-inf")).argmax())

    def __call__(self, logits: torch.Tensor, reqs: list[Sample], positions: list[int] | None = None) -> SamplerOutput:
        """logits [B, V] for the rows that sample this step, reqs in the same order; `positions`:
        each row's output position where it is not the sample's next (speculative decoding
        verifies several positions of one sample in a step)."""
        fast = [self._plain_greedy(r) for r in reqs]
        if all(fast):
            # greedy fast path: argmax of the raw logits (upcasting is exact, argmax keeps the first max)
            tokens = self.ops.argmax_rows(logits).tolist()
            self._constrain_greedy(logits, reqs, tokens)
            return SamplerOutput(tokens, [None] * len(reqs))
        if any(fast):
            # the greedy rows as above, the others through the full path on their rows alone
            slow = [i for i, f in enumerate(fast) if not f]
            tokens = self.ops.argmax_rows(logits).tolist()
            self._constrain_greedy(logits, [r if f else _NO_CONSTRAINT for r, f in zip(reqs, fast)], tokens)
            out = self._sample(logits[torch.tensor(slow, device=logits.device)], [reqs[i] for i in slow],
                               [positions[i] for i in slow] if positions else None)
            logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
            for j, i in enumerate(slow):
                tokens[i], logprobs[i] = out.token_ids[j], out.logprobs[j]
            return SamplerOutput(tokens, logprobs)
        return self._sample(logits, reqs, positions)

    def _sample(self, logits: torch.Tensor, reqs: list[Sample], positions: list[int] | None = None) -> SamplerOutput:
        """Every processor and draw, for rows that need more than an argmax."""
        raw = logits
        logits = logits.float().clone()
        self._apply_penalties(logits, reqs)
        self._apply_logit_bias(logits, reqs)
        self._apply_constraints(logits, reqs)
        self._apply_min_tokens(logits, reqs)

        greedy = [r.params.greedy for r in reqs]
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            sub = logits[idx]
            params = [reqs[i].params for i in random_rows]
            temp = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
            sub = sub / temp
            sub = self._top_k_top_p_min_p(sub, params)
            probs = torch.softmax(sub, dim=-1)
            tokens[idx] = draw_rows(probs, [self._uniform(reqs[i], positions[i] if positions else None)
                                             for i in random_rows])

        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if lp_rows:
            idx = torch.tensor(lp_rows, device=logits.device)
            n_top = max(reqs[i].params.logprobs for i in lp_rows)
            chosen_lp, rank, top_ids, top_lp = compute_logprobs(raw[idx], tokens[idx], n_top)
            chosen_lp, rank = chosen_lp.tolist(), rank.tolist()
            top_ids = top_ids.tolist() if top_ids is not None else None
            top_lp = top_lp.tolist() if top_lp is not None else None
            for j, i in enumerate(lp_rows):
                k = reqs[i].params.logprobs
                logprobs[i] = TokenLogprobs(token_list[i], chosen_lp[j], rank[j],
                                            top_ids[j][:k] if k else [], top_lp[j][:k] if k else [])
        return SamplerOutput(token_list, logprobs)

    @staticmethod
    def _top_k_top_p_min_p(logits: torch.Tensor, params) -> torch.Tensor:
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        V = logits.shape[1]
        neg = float("-inf")
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            if any(k > 0 for k in top_k):
                k = torch.tensor([k if k > 0 else V for k in top_k], device=logits.device)
                keep = torch.arange(V, device=logits.device).unsqueeze(0) < k.unsqueeze(1)
                sorted_logits = sorted_logits.masked_fill(~keep, neg)
            if any(p < 1.0 for p in top_p):
                p = torch.tensor(top_p, device=logits.device).unsqueeze(1)
                probs = torch.softmax(sorted_logits, dim=-1)
                # drop a token when the mass before it already reaches top_p (keep at least one)
                before = probs.cumsum(dim=-1) - probs
                drop = before >= p
                drop[:, 0] = False
                sorted_logits = sorted_logits.masked_fill(drop, neg)
            logits = torch.full_like(logits, neg).scatter(1, order, sorted_logits)
        if any(m > 0 for m in min_p):
            m = torch.tensor(min_p, device=logits.device).unsqueeze(1)
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, neg)
        return logits
