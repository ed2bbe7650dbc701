"""Unit tests of the engine's config: dtype choice and token budget (tessera_engine.config)."""
from __future__ import annotations

import pytest
import torch

from tessera_engine.config import EngineConfig

from helpers.engine_requests import make_scheduler

pytestmark = pytest.mark.unit


# -- dtype -----------------------------------------------------------------------------------
def test_auto_dtype_is_bf16_where_the_cpu_computes_it_natively(monkeypatch):
    from tessera_engine import cpu_kernels

    cfg = EngineConfig(device="cpu")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    dtype, why = cfg.dtype_choice()
    assert dtype == torch.bfloat16 and "avx512_bf16" in why
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    assert cfg.resolved_dtype() == torch.bfloat16
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx2"}))
    dtype, why = cfg.dtype_choice()
    assert dtype == torch.float32 and "no native bfloat16" in why
    assert EngineConfig(device="cpu", dtype="float32").dtype_choice() == (torch.float32, "set by --dtype")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        EngineConfig(dtype="int8").resolved_dtype()


def test_token_budget_defaults_by_device_and_takes_an_explicit_value():
    assert EngineConfig(device="cpu").token_budget() == 512
    assert EngineConfig(device="cpu", max_num_batched_tokens=4096).token_budget() == 4096
    assert make_scheduler().token_budget == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        EngineConfig(max_num_batched_tokens=0).validate()
