"""Small engine requests and a scheduler on a KV pool, for the engine's bookkeeping unit tests
(tests/engine/test_scheduler.py, test_kv_cache.py, test_sampler.py, test_sliding_window.py,
test_hybrid_kv_cache.py)."""
from __future__ import annotations

from tessera_engine.config import EngineConfig
from tessera_engine.kv_cache import KVCacheManager
from tessera_engine.outputs import ModelRunnerOutput
from tessera_engine.request import EngineCoreRequest, Sample
from tessera_engine.sampling_params import SamplingParams
from tessera_engine.scheduler import Scheduler


def make_req(rid: str, n_tokens: int, start: int = 0, arrival: float = 0.0, priority: int = 0,
             **params) -> Sample:
    core = EngineCoreRequest(rid, list(range(start, start + n_tokens)), SamplingParams(**params),
                             priority=priority, arrival_time=arrival)
    return Sample(core, 0, [2])


def sample_of(rid: str, tokens: list[int]) -> Sample:
    """A sample of these prompt tokens (8 tokens to generate)."""
    return Sample(EngineCoreRequest(rid, tokens, SamplingParams(max_tokens=8)), 0, [2])


def run_chunks(kv: KVCacheManager, req: Sample, chunk: int) -> None:
    """Allocate and 'compute' the request's known tokens chunk by chunk, as steps would."""
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate(req, n)
        req.num_computed_tokens += n


def make_scheduler(num_blocks=100, block_size=4, token_budget=512, **cfg) -> Scheduler:
    config = EngineConfig(block_size=block_size, **cfg)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, config.enable_prefix_caching), 1000,
                     cfg.get("max_num_batched_tokens") or token_budget)


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {x.sample.key: token for x in out.scheduled if x.samples}
    s.update_from_output(out, ModelRunnerOutput(sampled, {}, {}))
    return out
