"""ModelRunner: turns a SchedulerOutput into one forward pass over a flat batch and samples.

It owns the KV cache tensors: the pool's pages as kv_layout.KVLayout lays them out (layer j
of each KV cache group in pool tensor j). Per step it builds the flat token batch
(single-token decodes first, then prefill chunks), their positions, and each group's cache
slots and attention metadata from that group's block tables, runs the model once, computes logits only where
they are needed (the last token of each request that samples, plus prompt
positions when prompt logprobs were asked for) and samples.
"""
from __future__ import annotations

import logging
import math
import mmap
import time

import torch

from tessera_engine.attention import DecodeEntry, PrefillChunk
from tessera_engine.backend_plan import BackendPlan
from tessera_engine.kv_cache import KVCopy
from tessera_engine.kv_layout import KVLayout, plan_kv_layout
from tessera_engine.outputs import ModelRunnerOutput, ScheduledSample, SchedulerOutput, TokenLogprobs
from tessera_engine.request import SampleKey
from tessera_engine.sampler import Sampler, compute_logprobs

log = logging.getLogger(__name__)


def kv_cache_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype, layers: int | None = None) -> int:
    """Bytes of one block of the pool: `layers` layers' K and V of block_size tokens (default:
    every layer, a model of one KV cache group; KVLayout.tensors otherwise)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_token = 2 * (layers or hf_config.num_hidden_layers) * hf_config.num_key_value_heads * head_dim
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor. On CPU a private anonymous mapping: the kernel maps fresh
    zero pages as blocks are first written, so the pool adds to RSS as it is used, not at start
    (torch.zeros writes every byte: 1 GiB resident before the first request). Not numpy's
    zeros: numpy asks for transparent huge pages on large arrays, and their first touch
    (the kernel compacting memory for them) cost an order of magnitude more than plain
    pages, a noticeable share of a burst's prefill."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    raw = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(raw, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model, hf_config, num_blocks: int, block_size: int, plan: BackendPlan, lora=None,
                 layout: KVLayout | None = None) -> None:
        """lora: the engine's LoRAManager (lora.py), whose layers the model already holds; None: no
        adapters. layout: the model's KV cache groups (default: plan_kv_layout of its layers' windows)."""
        self.model = model
        self.lora = lora
        self.device = device = plan.device
        self.block_size = block_size
        self.dtype = plan.dtype
        self.vocab_size = hf_config.vocab_size
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.layout = layout = layout or plan_kv_layout(model.attention_windows)
        shape = (num_blocks * block_size, hf_config.num_key_value_heads, head_dim)
        pool = [(zeroed_pool(shape, plan.dtype, device), zeroed_pool(shape, plan.dtype, device))
                for _ in range(layout.tensors)]
        self.kv_caches = [pool[t] for t in layout.layer_tensor]  # each layer's (k, v)
        self.attention = plan.attention(block_size, hf_config.num_key_value_heads)
        self.ops = plan.ops
        paths = model.use_backend(self.attention, self.ops, plan.quantized_max_rows, plan.decoder_stack)
        self.prompt_dense = plan.prompt_dense  # prompt rows last in the flat batch, on the dense weights
        log.info("linear layers", extra={"paths": paths, "dense_matmul": plan.dense_matmul,
                                         "quantized_max_rows": plan.quantized_max_rows if set(paths) - {"dense"} else 0,
                                         "decoder_layers": model.decoder_layers,
                                         "kv_groups": [(g.window, len(g.layers)) for g in layout.groups]})
        self.sampler = Sampler(self.vocab_size, device, self.ops)
        self._arange_bs = torch.arange(block_size, device=device)

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end) of a request with this block table."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs + 1
        blocks = torch.tensor(table[first:last], device=self.device)
        slots = (blocks.unsqueeze(1) * bs + self._arange_bs).flatten()
        return slots[start - first * bs:end - first * bs]

    def _prepare(self, scheduled: list[ScheduledSample], kv_copies: list[KVCopy] = ()):
        """The step's flat batch (decodes first, then prefill chunks) and each layer's attention
        metadata (one object per KV cache group); with prompt_dense, chunks of prompt tokens (a
        one-token one too) after every output token, and the first prompt row (None: none)."""
        bs = self.block_size
        dev = self.device
        prompt = []
        if self.prompt_dense:  # the scheduler's chunks are all prompt or all output (prompt_apart)
            prompt = [s for s in scheduled if s.start < s.sample.num_prompt_tokens]
            scheduled = [s for s in scheduled if s.start >= s.sample.num_prompt_tokens]
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        dense_from = len(decodes) + sum(s.num_new_tokens for s in prefills) if prompt else None
        prefills += prompt
        ids: list[int] = []
        pos: list[int] = []
        for s in decodes:
            ids.append(s.sample.all_token_ids[s.start])
            pos.append(s.start)
        for s in prefills:
            start, end = s.start, s.start + s.num_new_tokens
            ids.extend(s.sample.all_token_ids[start:end])
            ids.extend(s.draft_token_ids)  # speculating: the guesses after the last known token
            pos.extend(range(start, end))
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        group_metas = [self._group_metadata(g, group.window, decodes, prefills, positions)
                       for g, group in enumerate(self.layout.groups)]
        if kv_copies:  # partial prefix hits: one full-attention group only (KVCacheManager)
            src = [c.src * bs + i for c in kv_copies for i in range(c.num_tokens)]
            dst = [c.dst * bs + i for c in kv_copies for i in range(c.num_tokens)]
            group_metas[0].copy_slots = (torch.tensor(src, dtype=torch.long, device=dev),
                                         torch.tensor(dst, dtype=torch.long, device=dev))
        return decodes + prefills, input_ids, positions, [group_metas[g] for g in self.layout.layer_group], dense_from

    def _group_metadata(self, g: int, window: int | None, decodes: list[ScheduledSample],
                        prefills: list[ScheduledSample], positions: torch.Tensor):
        """KV cache group g's cache slots for the step's tokens and its attention metadata."""
        bs = self.block_size
        decode_slots = []
        for s in decodes:
            p = s.start
            decode_slots.append(s.block_tables[g][p // bs] * bs + p % bs)
        slot_parts = [torch.tensor(decode_slots, dtype=torch.long, device=self.device)]
        chunks: list[PrefillChunk] = []
        q_start = len(decodes)
        for s in prefills:
            start, end = s.start, s.start + s.num_new_tokens
            table = s.block_tables[g]
            slot_parts.append(self._slots(table, start, end))
            chunks.append(PrefillChunk(q_start, start, end, table))
            q_start += s.num_new_tokens
        slot_mapping = torch.cat(slot_parts) if len(slot_parts) > 1 else slot_parts[0]
        return self.attention.build_metadata(
            slot_mapping, positions, [DecodeEntry(s.block_tables[g], s.start + 1) for s in decodes], chunks, window)

    def _same_for_every_group(self, build) -> list:
        """Each layer's metadata for a pass outside any step, where every group reads the same
        block table: build(window) for each group. Several groups then write the same pages
        (layer j of each group in pool tensor j), which is safe in a single pass from position 0:
        each layer writes every position it attends before it attends."""
        metas = [build(group.window) for group in self.layout.groups]
        return [metas[g] for g in self.layout.layer_group]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        ordered, input_ids, positions, metas, dense_from = self._prepare(sched.scheduled, sched.kv_copies)
        if self.lora is not None:  # each row's adapter slot, in the flat batch's order
            self.lora.prepare([(s.sample.lora, s.num_new_tokens) for s in ordered])
        try:
            hidden = self.model(input_ids, positions, self.kv_caches, metas, dense_from)
        finally:
            if self.lora is not None:
                self.lora.clear()  # warm-up, timing and accuracy passes run the base model

        # rows whose last token samples (every row of a sample with guesses, each at its own
        # output position), and prompt-logprob positions
        sample_rows: list[int] = []
        sample_reqs = []
        positions: list[int] = []
        speculated = []
        prompt_lp: dict[SampleKey, list[TokenLogprobs | None]] = {}
        offset = 0
        for s in ordered:
            req = s.sample
            if s.draft_token_ids:
                speculated.append((s, len(sample_rows)))
                sample_rows.extend(range(offset, offset + s.num_new_tokens))
                sample_reqs.extend([req] * s.num_new_tokens)
                positions.extend(range(req.num_output_tokens, req.num_output_tokens + s.num_new_tokens))
            elif s.samples:
                sample_rows.append(offset + s.num_new_tokens - 1)
                sample_reqs.append(req)
                positions.append(req.num_output_tokens)
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
            result = self.sampler(logits, sample_reqs, positions if speculated else None)
            for req, tok, lp in zip(sample_reqs, result.token_ids, result.logprobs):
                out.sampled[req.key] = tok
                if lp is not None:
                    out.logprobs[req.key] = lp
            for s, first in speculated:  # keep the guesses the sampler agrees with, then its own token
                drawn = result.token_ids[first:first + s.num_new_tokens]
                a = 0
                while a < len(s.draft_token_ids) and drawn[a] == s.draft_token_ids[a]:
                    a += 1
                out.accepted[s.sample.key] = s.draft_token_ids[:a]
                out.sampled[s.sample.key] = drawn[a]
                if s.sample.params.logprobs is not None:  # each row's, for the token it drew
                    rows_lp = result.logprobs[first:first + a + 1]
                    out.accepted_logprobs[s.sample.key] = rows_lp[:a]
                    out.logprobs[s.sample.key] = rows_lp[a]
        return out

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, num_decodes: int) -> dict[str, float]:
        """Run the shapes of a full step once before any request: one prefill chunk of
        `num_tokens` tokens, then `num_decodes` single-token decodes, with their logits.

        A step's first use of a batch shape pays for creating its matmul kernels (oneDNN) and
        for growing the allocator's arenas; the first full step took over twice as long as
        later ones, which fell on the first burst's time to first token. Only called while no
        request holds a block: the K/V written here land in blocks that a request writes
        before it reads them.
        """
        bs = self.block_size
        num_blocks = self.kv_caches[0][0].shape[0] // bs
        num_tokens = max(1, min(num_tokens, num_blocks * bs))
        num_decodes = max(1, min(num_decodes, num_blocks))
        times = {}
        t0 = time.perf_counter()
        self.last_logits([0] * num_tokens)
        times["prefill_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        t0 = time.perf_counter()
        # every decode in block 0: the shapes are what matters, and the pool's other pages stay
        # untouched (see zeroed_pool)
        blocks = torch.zeros(num_decodes, dtype=torch.long, device=self.device)
        metas = self._same_for_every_group(lambda window: self.attention.build_metadata(
            blocks * bs, torch.zeros_like(blocks), [DecodeEntry([0], 1)] * num_decodes, [], window))
        hidden = self.model(torch.zeros(num_decodes, dtype=torch.long, device=self.device),
                            torch.zeros_like(blocks), self.kv_caches, metas)
        self.model.compute_logits(hidden)
        times["decode_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        return times

    @torch.inference_mode()
    def time_rows(self, rows: tuple[int, ...], repeats: int = 2) -> dict[int, float]:
        """Seconds of a forward pass (and its logits) over n rows as one chunk, for each n (the
        fastest of `repeats`; speculative decoding's StepCost). Only while no request holds a block."""
        limit = self.kv_caches[0][0].shape[0]
        out = {}
        for n in rows:
            if n > limit:
                break
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                self.model.compute_logits(self._one_chunk([0] * n))
                best = min(best, time.perf_counter() - t0)
            out[n] = best
        return out

    @torch.inference_mode()
    def last_logits(self, token_ids: list[int]) -> torch.Tensor:
        """One prompt's next-token logits [vocab], computed alone in one chunk outside any step
        (warm_up's prefill; accuracy checks: tests and benchmarks compare backends on it). Only
        while no request holds a block: it writes K/V from block 0 on."""
        return self.model.compute_logits(self._one_chunk(token_ids, prompt=True)[-1:])[0]

    def _one_chunk(self, token_ids: list[int], prompt: bool = False) -> torch.Tensor:
        """The hidden states of these tokens run alone as one chunk from position 0, K/V written
        from block 0 on (callers run it only while no request holds a block); prompt: computed
        as a prompt is (prompt_dense), else as output tokens are."""
        n = len(token_ids)
        positions = torch.arange(n, dtype=torch.long, device=self.device)
        table = list(range(-(-n // self.block_size)))
        metas = self._same_for_every_group(lambda window: self.attention.build_metadata(
            positions.clone(), positions, [], [PrefillChunk(0, 0, n, table)], window))
        return self.model(torch.tensor(token_ids, dtype=torch.long, device=self.device), positions,
                          self.kv_caches, metas, 0 if prompt and self.prompt_dense else None)

    def _prompt_logprobs(self, hidden: torch.Tensor, offset: int, s: ScheduledSample
                         ) -> list[TokenLogprobs | None]:
        """Logprobs of prompt tokens start+1 .. (predicted by this chunk's positions)."""
        req = s.sample
        n_prompt = req.num_prompt_tokens
        first, last = s.start, min(s.start + s.num_new_tokens, n_prompt - 1)
        entries: list[TokenLogprobs | None] = [None] if s.start == 0 else []  # the first prompt token has none
        if last > first:
            rows = hidden[offset:offset + (last - first)]
            targets = torch.tensor(req.all_token_ids[first + 1:last + 1], device=self.device)
            logits = self.model.compute_logits(rows)
            k = req.params.prompt_logprobs
            chosen, rank, top_ids, top_lp = compute_logprobs(logits, targets, k)
            chosen, rank, tgt = chosen.tolist(), rank.tolist(), targets.tolist()
            top_ids = top_ids.tolist() if k else [[]] * len(tgt)
            top_lp = top_lp.tolist() if k else [[]] * len(tgt)
            entries += [TokenLogprobs(tgt[i], chosen[i], rank[i], top_ids[i], top_lp[i]) for i in range(len(tgt))]
        return entries
