"""EngineConfig: everything the engine core is built from (model, cache, scheduler, device).

The settings as given; what they resolve to on this machine (device, dtype, kernels, token
budget, quantized row limit) is decided once, by backend_plan.plan_backends."""
from __future__ import annotations

import dataclasses

import torch


# the names --dtype takes ("auto" aside): backend_plan.choose_dtype decides
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")
QUANTIZED_MATMULS = ("auto", "int8", "exact")
PROMPT_MATMULS = ("auto", "dense", "quantized")


@dataclasses.dataclass
class EngineConfig:
    # model
    model: str | None = None          # HF directory or GGUF file; None = the embedded default
    dtype: str = "auto"                # auto (backend_plan.choose_dtype), float32, bfloat16, float16
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
    max_num_batched_tokens: int | None = None  # token budget per step; None: by device (backend_plan)
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
    # GGUF: dequantize every weight at load instead of keeping the quantized blocks as the
    # file has them for the CPU kernels' quantized matmul
    gguf_dequantize: bool = False
    # batches up to this many rows run a layer with quantized blocks on the quantized matmul,
    # larger ones on the dense weights (0: never); None: every batch size when batch_invariant,
    # else timed at start (quantized_crossover.py)
    quantized_max_rows: int | None = None
    # a row's results never depend on how many rows run beside it (one matmul path for every
    # batch size): the same greedy request gives the same text alone, batched, cached or chunked
    batch_invariant: bool = True
    # the Python loop over the decoder layers always (vLLM's --enforce-eager); off: the kernels'
    # DecoderStack runs them in one C++ call where it covers the model (bit for bit the same)
    enforce_eager: bool = False
    # speculative decoding (speculative.SpeculativeConfig: --speculative-config's JSON); None: off
    speculative_config: str | dict | None = None
    # how that quantized matmul computes: exact (each block dequantized to the activations'
    # dtype, bit for bit the dequantized weights), int8 (activations quantized to int8 per
    # 16 values, integer dot products: llama.cpp's method) or auto (backend_plan)
    quantized_matmul: str = "auto"
    # batch-invariant with quantized layers: which matmul a prompt's rows take, the decoder
    # layers' dense weights or their quantized ones (output rows always the quantized one):
    # auto (timed at start, backend_plan), dense or quantized
    prompt_matmul: str = "auto"
    # LoRA adapters (lora.py): served at all (--enable-lora; --lora-modules implies it), those
    # loaded at start as (name, path) pairs, how many run in one step, the largest rank taken
    enable_lora: bool = False
    lora_modules: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    max_loras: int = 1
    max_lora_rank: int = 16

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def validate(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (auto, {', '.join(DTYPES)})")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        if self.quantized_max_rows is not None and self.quantized_max_rows < 0:
            raise ValueError("quantized_max_rows must be >= 0")
        if self.quantized_matmul not in QUANTIZED_MATMULS:
            raise ValueError(f"quantized_matmul must be one of {', '.join(QUANTIZED_MATMULS)}, "
                             f"not {self.quantized_matmul!r}")
        if self.prompt_matmul not in PROMPT_MATMULS:
            raise ValueError(f"prompt_matmul must be one of {', '.join(PROMPT_MATMULS)}, not {self.prompt_matmul!r}")
        from tessera_engine.speculative import SpeculativeConfig

        SpeculativeConfig.parse(self.speculative_config)
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
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], not {self.max_lora_rank}")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"lora_modules: names must be unique and not empty, got {names}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, not {self.scheduling_policy!r}")
