"""Unit tests of the backend plan (tessera_engine.backend_plan): each decision made once, with
its reason, and handed to the loader, runner, layers and sampler."""
from __future__ import annotations

import logging

import pytest
import torch

from tessera_engine import cpu_kernels
from tessera_engine.backend_plan import ALL_ROWS, choose_dtype, choose_token_budget, plan_backends
from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.models.llama import Linear
from tessera_engine.models.loader import load_model

from helpers import gguf_tiny
from helpers.engine_fixtures import tiny_hf_llama

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_auto_dtype_is_bf16_where_the_cpu_computes_it_natively(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    dtype, why = choose_dtype("auto", CPU)
    assert dtype == torch.bfloat16 and "avx512_bf16" in why
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    assert choose_dtype("auto", CPU)[0] == torch.bfloat16
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx2"}))
    dtype, why = choose_dtype("auto", CPU)
    assert dtype == torch.float32 and "no native bfloat16" in why
    assert choose_dtype("float32", CPU) == (torch.float32, "set by --dtype")
    assert choose_dtype("auto", torch.device("cuda"))[0] == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        EngineConfig(dtype="int8").validate()


def test_token_budget_defaults_by_device_and_takes_an_explicit_value():
    assert choose_token_budget(None, CPU)[0] == 512
    assert choose_token_budget(None, torch.device("cuda"))[0] == 2048
    assert choose_token_budget(4096, CPU) == (4096, "set by --max-num-batched-tokens")
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        EngineConfig(max_num_batched_tokens=0).validate()
    with pytest.raises(ValueError, match="quantized_max_rows must be >= 0"):
        EngineConfig(quantized_max_rows=-1).validate()


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    """A tiny Llama written as GGUF with Q4_1 layers and a Q8_0 embedding."""
    cfg, hf = tiny_hf_llama(hidden_size=64, intermediate_size=128, num_layers=2)
    return gguf_tiny.write_gguf(hf, tmp_path_factory.mktemp("plan") / "tiny.gguf", gguf_tiny.mixed())


def _layers(model) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the fused CPU kernels do not build here")
def test_the_plan_reaches_the_layers_and_its_row_limit_is_the_flag_when_set(tiny_q4, caplog):
    config = EngineConfig(model=str(tiny_q4), device="cpu", dtype="float32", quantized_max_rows=5, num_kv_blocks=16)
    with caplog.at_level(logging.INFO):
        core = EngineCore(config)
    plan = core.executor.plan
    assert plan.keep_quantized and plan.quantized_max_rows == 5 and plan.why["quantized_max_rows"] == "set by --quantized-max-rows"
    assert plan.ops is core.executor.runner.ops is core.executor.runner.sampler.ops
    quantized = [m for m in _layers(core.executor.model) if m.qweight is not None]
    assert quantized and all(m.q_max_rows == 5 for m in quantized)
    assert sum(r.getMessage() == "backend plan" for r in caplog.records) == 1  # logged once


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the fused CPU kernels do not build here")
def test_a_measured_row_limit_is_one_of_the_candidates(tiny_q4, monkeypatch, tmp_path):
    from tessera_engine import quantized_crossover

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(quantized_crossover, "_measured", {})
    plan, _ = plan_backends(EngineConfig(model=str(tiny_q4), device="cpu", dtype="float32", batch_invariant=False))
    assert plan.quantized_max_rows in (0, *quantized_crossover.CANDIDATE_ROWS)
    assert "timed" in plan.why["quantized_max_rows"]
    assert not plan.batch_invariant and "--no-batch-invariant" in plan.why["batch_invariant"]


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the fused CPU kernels do not build here")
def test_batch_invariant_by_default_every_batch_size_on_the_quantized_matmul(tiny_q4):
    plan, _ = plan_backends(EngineConfig(model=str(tiny_q4), device="cpu", dtype="float32"))
    assert plan.quantized_max_rows == ALL_ROWS and plan.batch_invariant
    assert "batch-invariant" in plan.why["quantized_max_rows"]
    assert plan.describe()["quantized_max_rows"] == "all"
    # a set row limit splits batch sizes between two paths; torch attention cannot be invariant
    plan, _ = plan_backends(EngineConfig(model=str(tiny_q4), device="cpu", dtype="float32", quantized_max_rows=3))
    assert plan.quantized_max_rows == 3 and not plan.batch_invariant
    plan, _ = plan_backends(EngineConfig(model=str(tiny_q4), device="cpu", dtype="float32", cpu_kernels=False))
    assert not plan.batch_invariant and "torch attention" in plan.why["batch_invariant"]


def test_no_quantized_blocks_kept_without_the_kernels_or_with_gguf_dequantize(tiny_q4):
    for config, why in ((EngineConfig(model=str(tiny_q4), device="cpu", dtype="float32", cpu_kernels=False),
                         "--cpu-kernels is off"),
                        (EngineConfig(model=str(tiny_q4), device="cpu", dtype="float32", gguf_dequantize=True),
                         "--gguf-dequantize")):
        plan, loaded = plan_backends(config)
        assert not plan.keep_quantized and plan.quantized_max_rows == 0 and why in plan.why["keep_quantized"]
        assert not loaded.model.has_quantized()
    plan, _ = plan_backends(EngineConfig(model=str(tiny_q4), device="cpu", dtype="float32", cpu_kernels=False))
    assert plan.ops.name == "torch" and plan.attention_name == "torch" and plan.dense_matmul == "torch"


def test_a_shared_model_is_not_loaded_again(tiny_q4):
    loaded = load_model(str(tiny_q4), None, torch.float32, CPU)
    plan, got = plan_backends(EngineConfig(model=str(tiny_q4), device="cpu", dtype="float32", quantized_max_rows=2), loaded)
    assert got is loaded and plan.quantized_max_rows == 2


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the fused CPU kernels do not build here")
def test_the_decoder_layers_run_in_one_cpp_call_unless_enforce_eager(tiny_q4):
    from tessera_engine.request import EngineCoreRequest
    from tessera_engine.sampling_params import SamplingParams

    def greedy(core: EngineCore) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for i in range(3):
            core.add_request(EngineCoreRequest(f"r{i}", [5 + i, 17, 33, 2 * i + 1], params))
        outs: dict[str, list[int]] = {}
        while core.has_unfinished():
            for o in core.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [outs[f"r{i}"] for i in range(3)]

    base = dict(model=str(tiny_q4), device="cpu", dtype="float32", num_kv_blocks=16)
    stacked = EngineCore(EngineConfig(**base))
    assert stacked.executor.plan.decoder_stack and stacked.executor.plan.describe()["decoder_stack"]
    assert stacked.executor.model.decoder_layers.startswith("C++")
    eager = EngineCore(EngineConfig(**base, enforce_eager=True))
    assert not eager.executor.plan.decoder_stack and "--enforce-eager" in eager.executor.plan.why["decoder_stack"]
    assert eager.executor.model.decoder_layers == "Python loop"
    assert greedy(stacked) == greedy(eager)
    plan, _ = plan_backends(EngineConfig(**base, cpu_kernels=False))
    assert not plan.decoder_stack and "no fused CPU kernels" in plan.why["decoder_stack"]


def test_prompt_matmul_flag_its_environment_fallback_and_a_bad_value(monkeypatch, capsys):
    from tessera_engine.server import config_from_args, parse_args

    monkeypatch.delenv("TESSERA_PROMPT_MATMUL", raising=False)
    assert config_from_args(parse_args([])).prompt_matmul == "auto"
    assert config_from_args(parse_args(["--prompt-matmul", "quantized"])).prompt_matmul == "quantized"
    monkeypatch.setenv("TESSERA_PROMPT_MATMUL", "dense")
    assert config_from_args(parse_args([])).prompt_matmul == "dense"
    with pytest.raises(SystemExit):
        parse_args(["--prompt-matmul", "fast"])
    assert "--prompt-matmul" in capsys.readouterr().err
    with pytest.raises(ValueError, match="prompt_matmul must be one of auto, dense, quantized, not 'fast'"):
        EngineConfig(prompt_matmul="fast").validate()
