"""Dense bf16 CPU matmuls on weights packed once, in one of two layouts chosen per engine.

F.linear on CPU bf16 goes through oneDNN but reorders the weight on every call; a weight
packed ahead of time skips that (inductor's weight prepacking does the same). Two packings:

- OneDnnPacking: oneDNN's own blocked layout and its matmul (torch.ops.mkldnn). Its work is
  split evenly over the OpenMP team up front.
- BrgemmPacking: tessera's CPU kernels (pack_bf16_weight / linear_bf16): the same oneDNN
  micro-kernel called per tile, tiles taken by whichever thread is free. On cores shared
  with the rest of the stack one preempted thread no longer holds up a whole layer. It
  measured ahead of oneDNN's at decode batch sizes, alone and beside a busy process, and
  level with it on large batches (benchmarks/kernel_steps.py times the matmuls).

The ops backend offers its packing (TorchOps: oneDNN's; CpuKernelOps: the brgemm one where
the kernels pass a known-answer check); the model hands it to every layer once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_LINEAR = torch.ops.mkldnn._linear_pointwise.default if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None


class OneDnnPacking:
    name = "onednn"

    @staticmethod
    def accepts(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                and torch.backends.mkldnn.is_available() and _LINEAR is not None
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))

    @staticmethod
    def pack(weight: torch.Tensor):
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)

    @staticmethod
    def run(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
        return _LINEAR(x if x.is_contiguous() else x.contiguous(), packed, bias, "none", [], "")


ONEDNN = OneDnnPacking()


class BrgemmPacking:
    name = "brgemm"

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    @staticmethod
    def accepts(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0

    def pack(self, weight: torch.Tensor):
        return self.kernels.pack_bf16_weight(weight.detach()), weight.shape[0]

    def run(self, x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.linear_bf16(x if x.stride(-1) == 1 else x.contiguous(), packed[0], packed[1], bias)

    @classmethod
    def checked(cls, kernels) -> "BrgemmPacking | None":
        """The packing, where the kernels have it and compute right on this CPU: without
        oneDNN's bf16 micro-kernel torch's brgemm falls back to a plain GEMM that reads the
        packed layout wrongly, so a small known product is checked once."""
        if not hasattr(kernels, "linear_bf16"):
            return None
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(70, 96, generator=gen).bfloat16()
        w = torch.randn(100, 96, generator=gen).bfloat16()
        b = torch.randn(100, generator=gen).bfloat16()
        packing = cls(kernels)
        try:
            got = packing.run(x, packing.pack(w), b).float()
        except RuntimeError:
            return None
        want = F.linear(x.float(), w.float(), b.float())
        return packing if torch.allclose(got, want, rtol=2e-2, atol=5e-2) else None


class PackedWeight:
    """A bf16 CPU weight packed once (see the module doc) and the matmul that reads it.

    Repacked when the weight changes (its storage or version counter), until `freeze`
    packs it for good so that its owner can free the plain copy. The per-call path is
    kept to a few attribute checks: at batch 1 a step makes ~120 of these calls.
    """

    def __init__(self, packing=ONEDNN) -> None:
        self.packing = packing
        self.packed = None
        self.ptr = 0
        self.version = -1
        self.frozen = False

    def use(self, packing) -> None:
        """Pack with `packing` from now on (before freeze; a packed weight is repacked on next use)."""
        if not self.frozen and packing is not self.packing:
            self.packing, self.packed, self.version = packing, None, -1

    def _pack(self, weight: torch.Tensor) -> None:
        self.packed = self.packing.pack(weight)
        self.ptr, self.version = weight.data_ptr(), weight._version

    def freeze(self, weight: torch.Tensor) -> bool:
        """Pack `weight` now and never again; False (nothing done) where it cannot be packed."""
        if not self.packing.accepts(weight):
            return False
        self._pack(weight)
        self.frozen = True
        return True

    def _run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:
            return self.packing.run(x, self.packed, bias)
        shape = x.shape
        out = self.packing.run(x.reshape(-1, shape[-1]).contiguous(), self.packed, bias)
        return out.view(*shape[:-1], out.shape[-1])

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.frozen:
            return self._run(x, bias)
        if (self.packed is not None and weight._version == self.version and x.dtype == weight.dtype
                and weight.data_ptr() == self.ptr):
            return self._run(x, bias)
        if x.dtype != weight.dtype or not self.packing.accepts(weight):
            return F.linear(x, weight, bias)
        self._pack(weight)
        return self._run(x, bias)
