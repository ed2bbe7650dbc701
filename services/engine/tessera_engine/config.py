"""EngineConfig: everything the engine core is built from (model, cache, scheduler, device)."""
from __future__ import annotations

import dataclasses

import torch


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
_CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@dataclasses.dataclass
class EngineConfig:
    # model
    model: str | None = None          # HF directory or GGUF file; None = the embedded default
    dtype: str = "auto"                # auto (see dtype_choice), float32, bfloat16, float16
    device: str = "auto"               # auto (cuda when present), cpu, cuda
    max_model_len: int | None = None   # default: the model's max_position_embeddings
    # cache
    block_size: int = 16
    kv_cache_gib: float = 1.0          # CPU: KV cache memory budget
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of free memory for the KV cache
    num_kv_blocks: int | None = None   # explicit pool size (overrides the budgets; tests)
    enable_prefix_caching: bool = True
    # scheduler
    max_num_seqs: int = 256
    max_logprobs: int = 20             # cap on logprobs / prompt_logprobs per position (vLLM's default)
    max_waiting_requests: int = 1024   # samples waiting to start past which new requests are refused (0: no cap)
    step_timeout_s: float = 60.0       # the engine service's watchdog on one step (0: off)
    max_num_batched_tokens: int | None = None  # token budget per step; None: see token_budget()
    scheduling_policy: str = "fcfs"    # fcfs or priority
    # the core loop: how long an idle engine waits for a burst the frontend says is coming
    # (SessionInput.more_coming) before its first step; 0 = never wait
    idle_batch_wait_ms: float = 50.0
    # misc
    seed: int = 0
    num_threads: int | None = None     # torch CPU threads; None = torch's default
    # CPU: which CPU each compute thread runs on (cpu_threads.py): auto, off or a CPU list.
    # The service's flag defaults to auto; in-process the team's first thread is the caller's.
    cpu_threads_bind: str = "off"
    # CPU: tessera's fused C++ kernels (attention, norms, rotary, quantized matmul), else plain torch ops
    cpu_kernels: bool = True
    cpu_kernels_prebuilt: str | None = None  # load them from this module file / variants directory
    # GGUF: dequantize every weight at load instead of keeping Q4_0 / Q4_1 / Q8_0 weights as the
    # file has them for the CPU kernels' quantized matmul (see quantized_max_rows)
    gguf_dequantize: bool = False

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        return self.dtype_choice()[0]

    def dtype_choice(self) -> tuple[torch.dtype, str]:
        """The dtype the model runs in, and why. auto, as vLLM chooses: bf16 on CUDA and on a
        CPU that computes bf16 natively (avx512_bf16 or amx_bf16), float32 on other CPUs."""
        if self.dtype != "auto":
            try:
                return _DTYPES[self.dtype], "set by --dtype"
            except KeyError:
                raise ValueError(f"unknown dtype {self.dtype!r}") from None
        if self.resolved_device().type == "cuda":
            return torch.bfloat16, "auto: bfloat16 on CUDA"
        from tessera_engine.cpu_kernels import cpu_flags

        native = sorted(_CPU_BF16_FLAGS & cpu_flags())
        if native:
            return torch.bfloat16, f"auto: this CPU computes bfloat16 natively ({', '.join(native)})"
        return torch.float32, "auto: float32, this CPU has no native bfloat16 (avx512_bf16 / amx_bf16)"

    def token_budget(self) -> int:
        """Tokens one step may compute. Unset: 2048 on CUDA; 512 on CPU, where prefill is
        compute-bound: a burst's prompts then finish over several steps, so the first ones
        start streaming sooner (median TTFT of 64 chat prompts at once: 0.54 s against 0.72-0.90
        s at 2048, same throughput, measured here), and a long prompt never holds running
        requests' next tokens for a whole 2048-token step."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.resolved_device().type == "cuda" else 512

    def quantized_max_rows(self, dtype: torch.dtype) -> int:
        """Batches up to this many rows run a layer with a quantized weight on the quantized
        matmul, larger ones on the dense weight (0: never). Crossovers measured here over all
        of the default model's layers and its lm_head (2 cores, AVX512-BF16): bf16 against the
        brgemm matmul, 4.5 against 6.8 ms at 1 row, 5.2 / 6.7 at 2, dense ahead from 4 (6.9 /
        7.7); float32, whose dense matmul is not prepacked, quantized ahead up to 64 rows (99
        against 116 ms)."""
        if self.gguf_dequantize or self.resolved_device().type != "cpu":
            return 0
        return {torch.bfloat16: 3, torch.float32: 64}.get(dtype, 0)

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_logprobs < 0:
            raise ValueError("max_logprobs must be >= 0")
        if not self.step_timeout_s >= 0:
            raise ValueError("step_timeout_s must be >= 0")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.idle_batch_wait_ms < 0:
            raise ValueError("idle_batch_wait_ms must be >= 0")
        from tessera_engine.cpu_threads import check_mode, parse_cpu_list

        check_mode(self.cpu_threads_bind)
        if (self.cpu_threads_bind not in ("auto", "off") and self.num_threads
                and self.num_threads != len(parse_cpu_list(self.cpu_threads_bind))):
            raise ValueError(f"num_threads {self.num_threads} and cpu_threads_bind {self.cpu_threads_bind!r} "
                             "disagree: a CPU list sets the thread count to its length")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, not {self.scheduling_policy!r}")
