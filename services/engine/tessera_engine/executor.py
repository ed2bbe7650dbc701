"""Executor: runs the model runner. One process today (vLLM's UniProcExecutor);
a multi-process or tensor-parallel executor would keep this interface."""
from __future__ import annotations

import logging

import torch

from tessera_engine import allocator
from tessera_engine.backend_plan import plan_backends
from tessera_engine.config import EngineConfig
from tessera_engine.kv_layout import plan_kv_layout
from tessera_engine.model_runner import ModelRunner, kv_cache_bytes_per_block
from tessera_engine.models.loader import LoadedModel
from tessera_engine.outputs import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)


def rss_mib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))
    except (OSError, StopIteration):
        return None


class UniProcExecutor:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """loaded: an already loaded model to reuse (tests and benchmarks build several
        engines over one set of weights); it must be in the device and dtype config resolves to."""
        torch.manual_seed(config.seed)
        self.plan, loaded = plan_backends(config, loaded)
        self.device, self.dtype = self.plan.device, self.plan.dtype
        self.model, self.hf_config, self.model_name, self.max_model_len = loaded
        if config.max_model_len:  # a shared model may allow more than this engine is configured for
            self.max_model_len = min(config.max_model_len, self.max_model_len)
        self.kv_layout = plan_kv_layout(self.model.attention_windows)  # the KV cache groups
        self.num_blocks = self._num_blocks(config)
        self.lora = None
        if config.lora_enabled:
            from tessera_engine.lora import LoRAManager

            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank, self.plan.ops, self.device,
                                    self.dtype)
        self.runner = ModelRunner(self.model, self.hf_config, self.num_blocks, config.block_size, self.plan,
                                  self.lora, self.kv_layout)
        self.runner.sampler.seed(config.seed)
        allocator.release_free_memory()  # what the load freed
        log.info("kv cache allocated", extra={"num_blocks": self.num_blocks, "block_size": config.block_size,
                                              "kv_groups": len(self.kv_layout.groups), "rss_mib": rss_mib()})

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks:
            return config.num_kv_blocks
        per_block = kv_cache_bytes_per_block(self.hf_config, config.block_size, self.dtype, self.kv_layout.tensors)
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = free * config.gpu_memory_utilization
        else:
            budget = config.kv_cache_gib * (1 << 30)
        return max(1, int(budget // per_block))

    def draft_proposer(self, speculative):
        """Speculative decoding's draft model, loaded in this plan, its KV pool as many blocks
        (tokens) as the target's."""
        from tessera_engine.draft_model import DraftModelProposer

        return DraftModelProposer(speculative, self.plan, self.hf_config, self.num_blocks,
                                  self.runner.block_size, self.max_model_len)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)


Executor = UniProcExecutor
