"""The model's elementwise and small ops, in two backends chosen once per engine.

TorchOps computes with torch ops, rounding as HF transformers does; CpuKernelOps runs
the same ops in tessera's fused CPU kernels (tessera_engine.cpu_kernels: one pass each,
rounding where the torch ops round), and has the matmul and embedding lookup for GGUF
block-quantized weights. The backend plan (backend_plan.py) picks one, and the model runner
hands it to the model's layers and the sampler.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera_engine.models.packed_linear import ONEDNN, BrgemmPacking


class TorchOps:
    name = "torch"
    dense_packing = ONEDNN  # how bf16 CPU linear weights are packed and multiplied (models/packed_linear.py)
    qlinear = None     # (x [M, K], quantized weight bytes, ggml type, bias) -> [M, N]; None: dense only
    qembedding = None  # (ids [T], quantized table bytes, ggml type, K, dtype) -> [T, K]

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(rms_norm(residual + x), residual + x): HF's residual add fused into the norm after it."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)


class CpuKernelOps(TorchOps):
    name = "cpu_kernels"

    def __init__(self, kernels) -> None:
        self.kernels = kernels
        self.qlinear = kernels.qlinear
        self.qembedding = kernels.qembedding
        self.dense_packing = BrgemmPacking.checked(kernels) or ONEDNN

    # activations and weights share the plan's dtype (the model is built in it)
    def rms_norm(self, x, weight, eps):
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.kernels.add_rms_norm_(x, residual, weight, eps), residual  # residual updated in place

    def silu_and_mul(self, gate_up):
        return self.kernels.silu_and_mul(gate_up)

    def argmax_rows(self, logits):
        return self.kernels.argmax_rows(logits) if logits.is_contiguous() else logits.argmax(dim=-1)
