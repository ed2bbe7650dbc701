"""The model's elementwise and small ops, in two backends chosen once per engine.

TorchOps computes with torch ops, rounding as HF transformers does; CpuKernelOps runs
the same ops in tessera's fused CPU kernels (tessera_engine.cpu_kernels: one pass each,
rounding where the torch ops round), and has the matmul and embedding lookup for GGUF
block-quantized weights. The backend plan (backend_plan.py) picks one, and the model runner
hands it to the model's layers and the sampler.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from tessera_engine.models.packed_linear import ONEDNN, BrgemmPacking
from tessera_engine.models.quantized import GGUF, INT8_X16, QuantizedWeight

# the types the int8 matmul takes: Q4_0, Q4_1, Q8_0 as they are; Q5_0, Q4_K, Q6_K in layouts of
# their own (csrc/int8_matmul.cpp), each weight exactly the file's
INT8_QTYPES = frozenset({2, 3, 6, 8, 12, 14})


class QuantizedPath(NamedTuple):
    """How one quantized weight is used: in the layout its kernels read, and those kernels."""
    weight: QuantizedWeight
    linear: Callable     # (x [M, K], weight.data, qtype, bias) -> [M, N]
    embedding: Callable  # (ids [T], weight.data, qtype, K, dtype) -> [T, K]

    @property
    def name(self) -> str:
        return self.weight.type_name + (" int8" if self.weight.layout == INT8_X16 else "")


class TorchOps:
    name = "torch"
    dense_packing = ONEDNN  # how bf16 CPU linear weights are packed and multiplied (models/packed_linear.py)
    qlinear = None     # (x [M, K], quantized weight bytes, ggml type, bias) -> [M, N]; None: dense only
    qembedding = None  # (ids [T], quantized table bytes, ggml type, K, dtype) -> [T, K]
    quantized_matmul = "none"  # how the quantized matmul computes: exact, int8 (CpuKernelOps)

    def quantized_path(self, weight: QuantizedWeight) -> QuantizedPath | None:
        """The layout and kernels for a checkpoint's quantized weight; None: none here."""
        return None

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
    def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's MLP activation: gelu(gate, tanh approximation) * up, as HF's gelu_pytorch_tanh."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    @staticmethod
    def lora_add(y, x, a, b, slots, scales, bounds) -> None:
        """y += each row's LoRA delta, in place (lora.LoRALayer: a [S, in, subs * rank] and
        b [S, rank, out], slots [T] int32 with -1 for none, scales [S, subs], bounds the
        sub-modules' output columns; a and b may be bfloat16). Per adapter: shrink its rows, then
        expand per sub-module."""
        rank = b.shape[1]
        cuts = bounds.tolist()
        for s in torch.unique(slots).tolist():
            if s < 0:
                continue
            rows = (slots == s).nonzero().flatten()
            h = x.index_select(0, rows).float() @ a[s].float()
            bs = b[s].float()
            delta = torch.cat([(h[:, i * rank:(i + 1) * rank] @ bs[:, cuts[i]:cuts[i + 1]]) * scales[s, i]
                               for i in range(len(cuts) - 1)], dim=1)
            y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))


class CpuKernelOps(TorchOps):
    name = "cpu_kernels"

    def __init__(self, kernels, int8: bool = False) -> None:
        """int8: Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K weights repacked for the int8 matmul (the
        backend plan asks for it only where this build has it, kernels.int8_matmul_available());
        else, and for the other types (Q5_K), the exact one."""
        self.kernels = kernels
        self.qlinear = kernels.qlinear
        self.qembedding = kernels.qembedding
        self.int8 = int8
        self.dense_packing = BrgemmPacking.checked(kernels) or ONEDNN

    @property
    def quantized_matmul(self) -> str:
        return "int8" if self.int8 else "exact"

    def quantized_path(self, weight: QuantizedWeight) -> QuantizedPath:
        k = self.kernels
        if weight.layout == INT8_X16:  # a model already prepared by an earlier engine's plan
            if not self.int8:
                raise ValueError("the model's quantized weights are repacked for the int8 matmul; "
                                 "this engine's plan is the exact one")
            return QuantizedPath(weight, k.qlinear_i8, k.qembedding_i8)
        if self.int8 and weight.qtype in INT8_QTYPES and weight.data.shape[0] % 16 == 0:
            packed = k.qrepack_i8(weight.data, weight.qtype, weight.in_features)
            return QuantizedPath(QuantizedWeight(packed, weight.qtype, INT8_X16), k.qlinear_i8, k.qembedding_i8)
        assert weight.layout == GGUF
        return QuantizedPath(weight, k.qlinear, k.qembedding)

    # activations and weights share the plan's dtype (the model is built in it)
    def rms_norm(self, x, weight, eps):
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.kernels.add_rms_norm_(x, residual, weight, eps), residual  # residual updated in place

    def silu_and_mul(self, gate_up):
        return self.kernels.silu_and_mul(gate_up)

    def argmax_rows(self, logits):
        return self.kernels.argmax_rows(logits) if logits.is_contiguous() else logits.argmax(dim=-1)

    def lora_add(self, y, x, a, b, slots, scales, bounds):
        # one row's delta in a fixed order of operations, whatever the batch (batch invariance)
        self.kernels.lora_add(y, x, a, b, slots, scales, bounds)
