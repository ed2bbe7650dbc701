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

from tessera_engine import cpu_kernels
from tessera_engine.attention import AttentionMetadata, PrefillGroup
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
        self.dtype = dtype
        self.vocab_size = hf_config.vocab_size
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        shape = (num_blocks * block_size, hf_config.num_key_value_heads, head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(hf_config.num_hidden_layers)]
        self.sampler = Sampler(self.vocab_size, device)
        self._arange_bs = torch.arange(block_size, device=device)
        self.num_kv_heads = hf_config.num_key_value_heads
        self._arange_kvh = torch.arange(self.num_kv_heads, device=device).view(1, -1, 1)
        # fused CPU kernels (paged decode attention, norms), or None: torch ops
        self.kernels = cpu_kernels.get() if device.type == "cpu" else None
        model.use_kernels(self.kernels)
        self.sampler.kernels = self.kernels

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end) of a request with this block table."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs + 1
        blocks = torch.tensor(table[first:last], device=self.device)
        slots = (blocks.unsqueeze(1) * bs + self._arange_bs).flatten()
        return slots[start - first * bs:end - first * bs]

    def _prepare(self, scheduled: list[ScheduledRequest]):
        """The step's flat batch and the attention metadata shared by every layer."""
        bs = self.block_size
        dev = self.device
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
        slot_parts = [torch.tensor(decode_slots, dtype=torch.long, device=dev)]
        chunks: list[tuple] = []  # (q_start, start, end, block table) of each prefill chunk
        q_start = len(decodes)
        for s in prefills:
            start, end = s.start, s.start + s.num_new_tokens
            ids.extend(s.request.all_token_ids[start:end])
            pos.extend(range(start, end))
            slot_parts.append(self._slots(s.block_table, start, end))
            chunks.append((q_start, start, end, s.block_table))
            q_start += s.num_new_tokens

        meta = AttentionMetadata(torch.cat(slot_parts) if len(slot_parts) > 1 else slot_parts[0], len(decodes))
        if decodes and self.kernels is not None:
            max_blocks = max(len(s.block_table) for s in decodes)
            meta.decode_block_tables = torch.tensor(
                [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in decodes], dtype=torch.long)
            meta.decode_context_lens = torch.tensor([s.start + 1 for s in decodes], dtype=torch.long)
        elif decodes:
            max_ctx = max(s.start for s in decodes) + 1
            max_blocks = -(-max_ctx // bs)
            L = max_blocks * bs
            meta.decode_rows = self._table_rows([s.block_table for s in decodes], max_blocks)
            lens = torch.tensor([s.start + 1 for s in decodes], device=dev)
            valid = torch.arange(L, device=dev).unsqueeze(0) < lens.unsqueeze(1)
            meta.decode_bias = self._bias(valid, torch.float32).view(len(decodes), 1, 1, L)
            meta.decode_len = L
        self._group_prefills(chunks, meta)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        if self.kernels is not None:
            meta.kernels, meta.positions = self.kernels, positions
        return ordered, input_ids, positions, meta

    def _bias(self, valid: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """bool mask (True = attend) -> additive mask (default: the model's dtype)."""
        dtype = dtype or self.dtype
        zero = torch.zeros((), dtype=dtype, device=self.device)
        return torch.where(valid, zero, torch.full((), float("-inf"), dtype=dtype, device=self.device))

    def _table_rows(self, tables: list[list[int]], num_blocks: int) -> torch.Tensor:
        """Cache rows ([slots * KVH, d] view), head-major, of the first num_blocks blocks of each
        table (short tables padded with block 0, masked by the caller) -> [N * KVH * L]."""
        bs = self.block_size
        rows = [t[:num_blocks] + [0] * (num_blocks - len(t)) if len(t) < num_blocks else t[:num_blocks]
                for t in tables]
        tab = torch.tensor(rows, dtype=torch.long, device=self.device)
        slots = (tab.unsqueeze(2) * bs + self._arange_bs).view(len(tables), 1, num_blocks * bs)
        return (slots * self.num_kv_heads + self._arange_kvh).view(-1)

    def _group_prefills(self, chunks: list[tuple], meta: AttentionMetadata) -> None:
        """Pad prefill chunks of similar context length into groups attended by one SDPA call.

        Chunks are sorted by context length and a group grows while padding stays
        under about a quarter of its keys.
        """
        if not chunks:
            return
        dev, bs = self.device, self.block_size
        groups: list[list[tuple]] = []
        cur: list[tuple] = []
        total = 0
        for c in sorted(chunks, key=lambda c: c[2]):
            n = c[2]
            if cur and (len(cur) + 1) * n > 1.25 * (total + n) + 2 * bs:
                groups.append(cur)
                cur, total = [], 0
            cur.append(c)
            total += n
        groups.append(cur)
        for grp in groups:
            N = len(grp)
            q_lens = [end - start for _, start, end, _ in grp]
            Lq = max(q_lens)
            num_blocks = -(-max(end for _, _, end, _ in grp) // bs)
            Lk = num_blocks * bs
            kv_rows = self._table_rows([c[3] for c in grp], num_blocks)
            if N == 1 and grp[0][1] == 0:  # one chunk, nothing cached before it: plain causal
                q0, _, end, _ = grp[0]
                rows = torch.arange(q0, q0 + end, device=dev)
                kv_rows = kv_rows.view(self.num_kv_heads, Lk)[:, :end].reshape(-1)
                meta.prefill_groups.append(PrefillGroup(rows, kv_rows, None, rows, None, 1, end, end))
                continue
            q_starts = torch.tensor([c[0] for c in grp], device=dev).unsqueeze(1)
            starts = torch.tensor([c[1] for c in grp], device=dev).view(N, 1, 1)
            ends = torch.tensor([c[2] for c in grp], device=dev).view(N, 1, 1)
            lens = torch.tensor(q_lens, device=dev).unsqueeze(1)
            ar = torch.arange(Lq, device=dev).unsqueeze(0)
            q_gather = (q_starts + torch.minimum(ar, lens - 1)).view(-1)
            in_chunk = ar < lens                                                  # [N, Lq]
            valid = torch.arange(N * Lq, device=dev).view(N, Lq)[in_chunk]
            out_rows = (q_starts + ar)[in_chunk]
            kpos = torch.arange(Lk, device=dev).view(1, 1, Lk)
            qpos = starts + torch.arange(Lq, device=dev).view(1, Lq, 1)         # [N, Lq, 1]
            allowed = (kpos <= qpos) & (kpos < ends)                             # [N, Lq, Lk]
            meta.prefill_groups.append(PrefillGroup(q_gather, kv_rows, valid, out_rows,
                                                    self._bias(allowed).unsqueeze(1), N, Lq, Lk))

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
            if len(sample_rows) == hidden.shape[0]:  # every row samples (decode-only steps)
                rows = hidden
            else:
                rows = hidden[torch.tensor(sample_rows, device=self.device)]
            logits = self.model.compute_logits(rows)
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
