"""ModelRunner: turns a SchedulerOutput into one forward pass over a flat batch and samples.

It owns the KV cache tensors. Per step it builds the flat token batch
(single-token decodes first, then prefill chunks), their positions and cache
slots from the block tables, runs the model once, computes logits only where
they are needed (the last token of each request that samples, plus prompt
positions when prompt logprobs were asked for) and samples.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import time

import torch

from tessera_engine import cpu_kernels
from tessera_engine.attention import CpuKernelAttention, DecodeEntry, PrefillChunk, TorchAttention
from tessera_engine.config import EngineConfig
from tessera_engine.kv_cache import KVCopy
from tessera_engine.ops import CpuKernelOps, TorchOps
from tessera_engine.outputs import TokenLogprobs
from tessera_engine.request import SampleKey
from tessera_engine.sampler import Sampler, compute_logprobs
from tessera_engine.scheduler import ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ModelRunnerOutput:
    sampled: dict[SampleKey, int]                   # a new token for each sample that reached its end
    logprobs: dict[SampleKey, TokenLogprobs]        # that token's logprobs, when asked
    # the logprobs of the prompt positions this step computed, when asked (None: the first position)
    prompt_logprobs: dict[SampleKey, list[TokenLogprobs | None]]


def kv_cache_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor. On CPU a private anonymous mapping: the kernel maps fresh
    zero pages as blocks are first written, so the pool adds to RSS as it is used, not at start
    (torch.zeros writes every byte: 1 GiB resident before the first request). Not numpy's
    zeros: numpy asks for transparent huge pages on large arrays, and their first touch
    (the kernel compacting memory for them) cost ~2.5 ms a MiB here against ~0.2 ms with
    plain pages, ~0.5 s of a 64-request burst's prefill."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    raw = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(raw, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def select_backends(config: EngineConfig, num_kv_heads: int, dtype: torch.dtype,
                    device: torch.device, sliding_window: int | None = None) -> tuple[TorchAttention, TorchOps]:
    """The attention and op backends, chosen once per engine: tessera's fused CPU kernels on CPU
    when --cpu-kernels is on and they load, torch ops otherwise."""
    kernels = None
    if device.type != "cpu":
        why = f"torch ops on {device.type}"
    elif not config.cpu_kernels:
        why = "torch ops: --cpu-kernels is off"
    else:
        kernels = cpu_kernels.load(config.cpu_kernels_prebuilt)
        why = "fused CPU kernels" if kernels is not None else "torch ops: the fused CPU kernels did not load"
    if kernels is None:
        attention, ops = TorchAttention(config.block_size, num_kv_heads, dtype, device, sliding_window), TorchOps()
    else:
        attention = CpuKernelAttention(kernels, config.block_size, num_kv_heads, dtype, device, sliding_window)
        ops = CpuKernelOps(kernels)
    log.info("backend chosen", extra={"attention": attention.name, "ops": ops.name, "why": why,
                                      "sliding_window": sliding_window})
    return attention, ops


class ModelRunner:
    def __init__(self, model, hf_config, num_blocks: int, config: EngineConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.block_size = config.block_size
        self.dtype = dtype
        self.vocab_size = hf_config.vocab_size
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        shape = (num_blocks * config.block_size, hf_config.num_key_value_heads, head_dim)
        self.kv_caches = [(zeroed_pool(shape, dtype, device), zeroed_pool(shape, dtype, device))
                          for _ in range(hf_config.num_hidden_layers)]
        self.attention, self.ops = select_backends(config, hf_config.num_key_value_heads, dtype, device,
                                                   model.sliding_window)
        q_max_rows = config.quantized_max_rows(dtype)
        paths = model.use_backend(self.attention, self.ops, q_max_rows)
        dense = self.ops.dense_packing.name if dtype == torch.bfloat16 and device.type == "cpu" else "torch"
        log.info("linear layers", extra={"paths": paths, "dense_matmul": dense, "quantized_max_rows": q_max_rows if
                                         set(paths) - {"dense"} else 0,
                                         "why": "--gguf-dequantize" if config.gguf_dequantize else
                                         "GGUF Q4_0/Q4_1/Q8_0 weights run quantized up to quantized_max_rows rows"})
        self.sampler = Sampler(self.vocab_size, device, self.ops)
        self._arange_bs = torch.arange(config.block_size, device=device)

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end) of a request with this block table."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs + 1
        blocks = torch.tensor(table[first:last], device=self.device)
        slots = (blocks.unsqueeze(1) * bs + self._arange_bs).flatten()
        return slots[start - first * bs:end - first * bs]

    def _prepare(self, scheduled: list[ScheduledRequest], kv_copies: list[KVCopy] = ()):
        """The step's flat batch (decodes first, then prefill chunks) and its attention metadata."""
        bs = self.block_size
        dev = self.device
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ids: list[int] = []
        pos: list[int] = []
        decode_slots: list[int] = []
        for s in decodes:
            p = s.start
            ids.append(s.request.all_token_ids[p])
            pos.append(p)
            decode_slots.append(s.block_table[p // bs] * bs + p % bs)
        slot_parts = [torch.tensor(decode_slots, dtype=torch.long, device=dev)]
        chunks: list[PrefillChunk] = []
        q_start = len(decodes)
        for s in prefills:
            start, end = s.start, s.start + s.num_new_tokens
            ids.extend(s.request.all_token_ids[start:end])
            pos.extend(range(start, end))
            slot_parts.append(self._slots(s.block_table, start, end))
            chunks.append(PrefillChunk(q_start, start, end, s.block_table))
            q_start += s.num_new_tokens
        slot_mapping = torch.cat(slot_parts) if len(slot_parts) > 1 else slot_parts[0]
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        meta = self.attention.build_metadata(
            slot_mapping, positions, [DecodeEntry(s.block_table, s.start + 1) for s in decodes], chunks)
        if kv_copies:
            src = [c.src * bs + i for c in kv_copies for i in range(c.num_tokens)]
            dst = [c.dst * bs + i for c in kv_copies for i in range(c.num_tokens)]
            meta.copy_slots = (torch.tensor(src, dtype=torch.long, device=dev),
                               torch.tensor(dst, dtype=torch.long, device=dev))
        return decodes + prefills, input_ids, positions, meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        ordered, input_ids, positions, meta = self._prepare(sched.scheduled, sched.kv_copies)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        # rows whose last token samples, and prompt-logprob positions
        sample_rows: list[int] = []
        sample_reqs = []
        prompt_lp: dict[SampleKey, list[TokenLogprobs | None]] = {}
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

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, num_decodes: int) -> dict[str, float]:
        """Run the shapes of a full step once before any request: one prefill chunk of
        `num_tokens` tokens, then `num_decodes` single-token decodes, with their logits.

        A step's first use of a batch shape pays for creating its matmul kernels (oneDNN) and
        for growing the allocator's arenas; measured on the default model, the first 512-token
        step took 440 ms against 170 ms after, and that fell on the first burst's time to first
        token. Only called while no request holds a block: the K/V written here land in blocks
        that a request writes before it reads them.
        """
        bs = self.block_size
        num_blocks = self.kv_caches[0][0].shape[0] // bs
        num_tokens = max(1, min(num_tokens, num_blocks * bs))
        num_decodes = max(1, min(num_decodes, num_blocks))
        times = {}
        t0 = time.perf_counter()
        table = list(range(-(-num_tokens // bs)))
        positions = torch.arange(num_tokens, dtype=torch.long, device=self.device)
        meta = self.attention.build_metadata(positions.clone(), positions, [],
                                             [PrefillChunk(0, 0, num_tokens, table)])
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device), positions,
                            self.kv_caches, meta)
        self.model.compute_logits(hidden[-1:])
        times["prefill_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        t0 = time.perf_counter()
        # every decode in block 0: the shapes are what matters, and the pool's other pages stay
        # untouched (see zeroed_pool)
        blocks = torch.zeros(num_decodes, dtype=torch.long, device=self.device)
        meta = self.attention.build_metadata(blocks * bs, torch.zeros_like(blocks),
                                             [DecodeEntry([0], 1)] * num_decodes, [])
        hidden = self.model(torch.zeros(num_decodes, dtype=torch.long, device=self.device),
                            torch.zeros_like(blocks), self.kv_caches, meta)
        self.model.compute_logits(hidden)
        times["decode_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        return times

    def _prompt_logprobs(self, hidden: torch.Tensor, offset: int, s: ScheduledRequest
                         ) -> list[TokenLogprobs | None]:
        """Logprobs of prompt tokens start+1 .. (predicted by this chunk's positions)."""
        req = s.request
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
