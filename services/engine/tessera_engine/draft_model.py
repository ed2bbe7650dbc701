"""Speculative decoding's draft_model method: a smaller model with the target's vocabulary
guesses each sample's next k tokens, greedily, batched over the step's samples.

The draft has its own paged KV cache beside the target's (its own pool of blocks, its own
block table per sample), so the target's allocator, prefix cache and preemption never see it.
Per sample the drafter remembers which tokens its cache holds. Each proposal first catches the
draft up on the tokens it has not seen (the prompt the first time, then the tokens the target
accepted since), as one chunk per sample in one forward pass, then decodes k - 1 more steps,
all samples in each. The guesses' own K/V stay where they were written: when the target
accepts them they are already right, and a rejected guess's slot is written again by the
catch-up of the token that replaced it (the longest common prefix decides what is kept).

Guesses are greedy whatever the request's sampling: the target's exact-match verification
(speculative.py) keeps outputs identical to plain decoding for any guesses, and greedy ones are
the likeliest to match. A sample whose draft state does not fit in the pool evicts the least
recently used other samples' states, or gets no guesses this step.
"""
from __future__ import annotations

import collections
import dataclasses
import logging

import torch

from tessera_engine.backend_plan import ALL_ROWS, BackendPlan, prepare_weights
from tessera_engine.kv_layout import plan_kv_layout
from tessera_engine.model_runner import ModelRunner, kv_cache_bytes_per_block
from tessera_engine.models.loader import load_model
from tessera_engine.outputs import ScheduledSample
from tessera_engine.request import SampleKey
from tessera_engine.speculative import SpeculativeConfig, StepCost

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _DraftState:
    blocks: list[int]   # the sample's blocks in the draft's pool
    tokens: list[int]   # the tokens whose K/V the draft's cache holds, from position 0


class _Tokens:
    """What ModelRunner._prepare reads of a sample: its token ids."""

    def __init__(self, tokens: list[int]) -> None:
        self.all_token_ids = tokens


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, plan: BackendPlan, target_hf_config, num_blocks: int,
                 block_size: int, max_model_len: int) -> None:
        loaded = load_model(config.model, max_model_len, plan.dtype, plan.device, keep_quantized=plan.keep_quantized)
        if loaded.hf_config.vocab_size != target_hf_config.vocab_size:
            raise ValueError(f"--speculative-config: the draft model {config.model!r} has a vocabulary of "
                             f"{loaded.hf_config.vocab_size} tokens, the target's has {target_hf_config.vocab_size}: "
                             f"a draft model must share the target's tokenizer")
        model = loaded.model
        if plan_kv_layout(model.attention_windows).hybrid:
            raise ValueError(f"--speculative-config: the draft model {config.model!r} mixes sliding-window and "
                             "full-attention layers; a draft model's layers must all attend alike (its one "
                             "block table per sample serves a single KV cache group)")
        # the draft's guesses never reach the output, only how many are accepted: its quantized
        # layers (if any) take their quantized matmul at every batch size, and need no dense copy
        rows = ALL_ROWS if plan.keep_quantized and model.has_quantized() else 0
        prepare_weights(model, plan.ops, plan.keep_quantized, drop_dense=rows > 0)
        self.config = config
        self.runner = ModelRunner(model, loaded.hf_config, num_blocks, block_size,
                                  dataclasses.replace(plan, quantized_max_rows=rows, prompt_dense=False))
        self.block_size = block_size
        self.max_model_len = min(max_model_len, loaded.max_model_len)
        self.free = list(range(num_blocks))
        self.states: collections.OrderedDict[SampleKey, _DraftState] = collections.OrderedDict()
        self.step_cost: StepCost | None = None  # the draft's forward time by rows (measure_cost)
        log.info("speculative decoding: draft model loaded", extra={
            "draft_model": loaded.name, "num_blocks": num_blocks,
            "kv_cache_mib": round(num_blocks * kv_cache_bytes_per_block(loaded.hf_config, block_size, plan.dtype)
                                  / (1 << 20), 1)})

    def measure_cost(self) -> StepCost:
        """Time the draft's forward pass by rows (only while no sample holds a draft block)."""
        self.step_cost = StepCost(self.runner.time_rows(StepCost.ROWS))
        return self.step_cost

    def cost(self, samples: int, k: int) -> float:
        """Seconds the guesses of `samples` samples, k each, are expected to take: a catch-up of
        about two tokens a sample, then k - 1 one-row steps."""
        if self.step_cost is None:
            return 0.0
        return self.step_cost(2 * samples) + (k - 1) * self.step_cost(samples)

    def release(self, key: SampleKey) -> None:
        """Forget a sample (finished or aborted): its draft blocks go back to the pool."""
        state = self.states.pop(key, None)
        if state is not None:
            self.free.extend(state.blocks)

    def _reserve(self, key: SampleKey, positions: int, keep: set[SampleKey]) -> _DraftState | None:
        """The sample's state with blocks for `positions` positions, evicting the least recently
        used states outside `keep` when the pool runs short; None when it cannot fit."""
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = _DraftState([], [])
        self.states.move_to_end(key)
        need = -(-positions // self.block_size) - len(state.blocks)
        while need > len(self.free):
            victim = next((k for k in self.states if k not in keep and k != key), None)
            if victim is None:
                return None
            self.release(victim)
        if need > 0:
            state.blocks.extend(self.free[-need:])
            del self.free[-need:]
        return state

    @torch.inference_mode()
    def propose_many(self, items: list[tuple[SampleKey, list[int], int]]) -> dict[SampleKey, list[int]]:
        """Up to k greedy guesses after each sample's tokens, for (key, tokens, k) items."""
        keep = {key for key, _, _ in items}
        work = []  # (key, state, tokens, k, catch-up start)
        for key, tokens, k in items:
            k = min(k, self.max_model_len - len(tokens))
            if k <= 0 or not tokens:
                continue
            state = self._reserve(key, len(tokens) + k - 1, keep)
            if state is None:
                continue
            common = 0
            for a, b in zip(state.tokens, tokens):
                if a != b:
                    break
                common += 1
            # the last token is always run again: its logits give the first guess
            work.append((key, state, tokens, k, min(common, len(tokens) - 1)))
        if not work:
            return {}
        guesses: dict[SampleKey, list[int]] = {key: [] for key, *_ in work}
        # 1. catch up: each sample's unseen tokens as one chunk; the first guess from its last row
        scheduled = [ScheduledSample(_Tokens(tokens), len(tokens) - start, start, (state.blocks,))
                     for _, state, tokens, _, start in work]
        firsts = self._greedy_last_rows(scheduled)
        for (key, state, tokens, k, _), tok in zip(work, firsts):
            guesses[key].append(tok)
            state.tokens = list(tokens)
        # 2. k - 1 decode steps over the samples that want more guesses
        live = [w for w in work if w[3] > 1]
        while live:
            scheduled = []
            for key, state, tokens, _, _ in live:
                seq = state.tokens + [guesses[key][-1]]
                scheduled.append(ScheduledSample(_Tokens(seq), 1, len(seq) - 1, (state.blocks,)))
            for (key, state, _, _, _), s, tok in zip(live, scheduled, self._greedy_last_rows(scheduled)):
                state.tokens = s.sample.all_token_ids  # the guess's K/V is now in the cache too
                guesses[key].append(tok)
            live = [w for w in live if len(guesses[w[0]]) < w[3]]
        return guesses

    def _greedy_last_rows(self, scheduled: list[ScheduledSample]) -> list[int]:
        """One forward pass over these chunks; the argmax of each chunk's last row, in order."""
        ordered, input_ids, positions, metas, _ = self.runner._prepare(scheduled)  # the draft: no prompt rows apart
        hidden = self.runner.model(input_ids, positions, self.runner.kv_caches, metas)
        ends, offset = {}, 0
        for s in ordered:
            offset += s.num_new_tokens
            ends[id(s)] = offset - 1
        rows = torch.tensor([ends[id(s)] for s in scheduled], device=hidden.device)
        return self.runner.model.compute_logits(hidden[rows]).argmax(dim=-1).tolist()
