"""ModelRunner: turns a SchedulerOutput into one forward pass over a flat batch and samples.

It owns the KV cache tensors. Per step it builds the flat token batch
(single-token decodes first, then prefill chunks), their positions and cache
slots from the block tables, runs the model once, computes logits only where
they are needed (the last token of each request that samples, plus prompt
positions when prompt logprobs were asked for) and samples.
"""
from __future__ import annotations

import dataclasses

import torch

from tessera_engine.attention import AttentionMetadata, PrefillChunk
from tessera_engine.sampler import Sampler, compute_logprobs
from tessera_engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclasses.dataclass
class ModelRunnerOutput:
    sampled: dict[tuple, int]               # request key -> new token id
    logprobs: dict[tuple, tuple]            # request key -> (id, logprob, rank, top ids, top logprobs)
    prompt_logprobs: dict[tuple, list]      # request key -> entries for the prompt positions of this step


def kv_cache_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model, hf_config, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = hf_config.vocab_size
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        shape = (num_blocks * block_size, hf_config.num_key_value_heads, head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(hf_config.num_hidden_layers)]
        self.sampler = Sampler(self.vocab_size, device)
        self._arange_bs = torch.arange(block_size, device=device)

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end) of a request with this block table."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs + 1
        blocks = torch.tensor(table[first:last], device=self.device)
        slots = (blocks.unsqueeze(1) * bs + self._arange_bs).flatten()
        return slots[start - first * bs:end - first * bs]

    def _prepare(self, scheduled: list[ScheduledRequest]):
        bs = self.block_size
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        ids: list[int] = []
        pos: list[int] = []
        decode_slots: list[int] = []
        for s in decodes:
            p = s.start
            ids.append(s.request.all_token_ids[p])
            pos.append(p)
            decode_slots.append(s.block_table[p // bs] * bs + p % bs)
        slot_parts = [torch.tensor(decode_slots, dtype=torch.long, device=self.device)]
        chunks: list[PrefillChunk] = []
        q_start = len(decodes)
        for s in prefills:
            start, end = s.start, s.start + s.num_new_tokens
            ids.extend(s.request.all_token_ids[start:end])
            pos.extend(range(start, end))
            if start == 0:
                slot_parts.append(self._slots(s.block_table, 0, end))
                chunks.append(PrefillChunk(q_start, s.num_new_tokens, 0, None, None))
            else:
                ctx = self._slots(s.block_table, 0, end)
                slot_parts.append(ctx[start:])
                q_pos = torch.arange(start, end, device=self.device).unsqueeze(1)
                mask = torch.arange(end, device=self.device).unsqueeze(0) <= q_pos
                chunks.append(PrefillChunk(q_start, s.num_new_tokens, start, ctx, mask))
            q_start += s.num_new_tokens

        tables = mask = None
        if decodes:
            ctx_lens = [s.start + 1 for s in decodes]
            max_blocks = -(-max(ctx_lens) // bs)
            tables = torch.tensor([s.block_table[:max_blocks] + [0] * (max_blocks - len(s.block_table[:max_blocks]))
                                   for s in decodes], dtype=torch.long, device=self.device)
            lens = torch.tensor(ctx_lens, device=self.device)
            mask = (torch.arange(max_blocks * bs, device=self.device).unsqueeze(0) < lens.unsqueeze(1))
            mask = mask.view(len(decodes), 1, 1, -1)
        meta = AttentionMetadata(torch.cat(slot_parts), len(decodes), tables, mask, chunks)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        return ordered, input_ids, positions, meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        ordered, input_ids, positions, meta = self._prepare(sched.scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        # rows whose last token samples, and prompt-logprob positions
        sample_rows: list[int] = []
        sample_reqs = []
        prompt_lp: dict[tuple, list] = {}
        offset = 0
        for s in ordered:
            req = s.request
            if s.samples:
                sample_rows.append(offset + s.num_new_tokens - 1)
                sample_reqs.append(req)
            if not req.prompt_logprobs_done:
                prompt_lp[req.key] = self._prompt_logprobs(hidden, offset, s)
            offset += s.num_new_tokens

        out = ModelRunnerOutput({}, {}, prompt_lp)
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            result = self.sampler(logits, sample_reqs)
            for req, tok, lp in zip(sample_reqs, result.token_ids, result.logprobs):
                out.sampled[req.key] = tok
                if lp is not None:
                    out.logprobs[req.key] = lp
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, offset: int, s: ScheduledRequest) -> list:
        """Logprobs of prompt tokens start+1 .. (predicted by this chunk's positions)."""
        req = s.request
        n_prompt = req.num_prompt_tokens
        first, last = s.start, min(s.start + s.num_new_tokens, n_prompt - 1)
        entries: list = [None] if s.start == 0 else []  # the first prompt token has no logprob
        if last > first:
            rows = hidden[offset:offset + (last - first)]
            targets = torch.tensor(req.all_token_ids[first + 1:last + 1], device=self.device)
            logits = self.model.compute_logits(rows)
            k = req.params.prompt_logprobs
            chosen, rank, top_ids, top_lp = compute_logprobs(logits, targets, k)
            chosen, rank, tgt = chosen.tolist(), rank.tolist(), targets.tolist()
            top_ids = top_ids.tolist() if k else [[]] * len(tgt)
            top_lp = top_lp.tolist() if k else [[]] * len(tgt)
            entries += [(tgt[i], chosen[i], rank[i], top_ids[i], top_lp[i]) for i in range(len(tgt))]
        return entries
