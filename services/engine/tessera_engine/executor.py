"""Executor: runs the model runner. One process today (vLLM's UniProcExecutor);
a multi-process or tensor-parallel executor would keep this interface."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

from tessera_engine import cpu_kernels, cpu_threads
from tessera_engine.config import EngineConfig
from tessera_engine.model_runner import ModelRunner, ModelRunnerOutput, kv_cache_bytes_per_block
from tessera_engine.models.loader import LoadedModel, load_model
from tessera_engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


def return_freed_memory() -> None:
    """Hand the heap that loading freed (dequantized tensors, packing's plain copies) back to the
    OS: glibc keeps freed small and medium chunks for reuse, ~100-300 MiB here after a load."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def rss_mib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))
    except (OSError, StopIteration):
        return None


class UniProcExecutor:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """loaded: an already loaded model to reuse (tests and benchmarks build several
        engines over one set of weights); it must match config's device and dtype."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.resolved_device()
        if self.device.type == "cpu" and config.cpu_threads_bind != "off":
            cpu_threads.bind(config.cpu_threads_bind,
                             cpu_kernels.load(config.cpu_kernels_prebuilt) if config.cpu_kernels else None)
        self.dtype, why = config.dtype_choice()
        log.info("dtype chosen", extra={"dtype": str(self.dtype).removeprefix("torch."), "why": why})
        torch.manual_seed(config.seed)
        if loaded is None:
            loaded = load_model(config.model, config.max_model_len, self.dtype, self.device,
                                keep_quantized=config.quantized_max_rows(self.dtype) > 0)
        self.model, self.hf_config, self.model_name, self.max_model_len = loaded
        if config.max_model_len:  # a shared model may allow more than this engine is configured for
            self.max_model_len = min(config.max_model_len, self.max_model_len)
        self.num_blocks = self._num_blocks(config)
        self.runner = ModelRunner(self.model, self.hf_config, self.num_blocks, config, self.dtype, self.device)
        self.runner.sampler.seed(config.seed)
        return_freed_memory()
        log.info("kv cache allocated", extra={"num_blocks": self.num_blocks, "block_size": config.block_size,
                                              "rss_mib": rss_mib()})

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks:
            return config.num_kv_blocks
        per_block = kv_cache_bytes_per_block(self.hf_config, config.block_size, self.dtype)
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = free * config.gpu_memory_utilization
        else:
            budget = config.kv_cache_gib * (1 << 30)
        return max(1, int(budget // per_block))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)


Executor = UniProcExecutor
