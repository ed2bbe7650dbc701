"""GGUF block-quantized weights kept as the file has them, for the CPU kernels' qlinear.

A GGUF file's Q4_0, Q4_1, Q5_0, Q8_0 and K-quant Q4_K, Q5_K, Q6_K tensors (the types of the
common Q4_K_M / Q5_K_M / Q6_K files; Q5_0 is where llama.cpp falls back from a K-quant for rows
that are no whole super-blocks, as Gemma 3 270M's 640) are read as llama.cpp's own bytes (uint8
[rows, row bytes]: blocks of 32 weights with their float16 scales; for the K-quants, super-blocks of
256 weights with float16 super-scales and 6-bit / int8 sub-block scales, 144 / 176 / 210
bytes each), put through the same row permutation transformers' reader applies to
dequantized Llama q/k weights, and named as the HF checkpoint names them. The model keeps
them beside its dense weights and the CPU kernels dequantize them block by block inside the
matmul (csrc/quantized_matmul.cpp), so a decode step reads ~0.6-0.8 bytes a weight instead of 2
(bf16) or 4 (fp32).
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import numpy as np
import torch

# ggml type number -> name, for the types the kernels take
QTYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# ggml type number -> (weights, bytes) of one block
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
Q5_0, Q8_0 = 6, 8
GGUF, INT8_X16 = "gguf", "int8x16"  # layouts: the file's; repacked for the int8 matmul (csrc/int8_matmul.cpp)


class QuantizedWeight(NamedTuple):
    data: torch.Tensor  # GGUF: uint8 [rows, K / block weights (32, K-quants 256) * block bytes], llama.cpp's layout
    qtype: int           # ggml type number (QTYPES)
    layout: str = GGUF   # INT8_X16: rows interleaved 16 at a time, as the int8 matmul reads them

    @property
    def type_name(self) -> str:
        return QTYPES[self.qtype]

    @property
    def in_features(self) -> int:
        """K, the weights a row (the file's layout)."""
        weights, nbytes = BLOCKS[self.qtype]
        return self.data.shape[1] // nbytes * weights

    @staticmethod
    def concat(parts: list["QuantizedWeight | None"]) -> "QuantizedWeight | None":
        """Row-wise concatenation (fused QKV, gate/up); None unless every part is there in one type.
        Q5_0 parts beside Q8_0 ones (the file's layout) are first widened to Q8_0, the same weights
        exactly: Gemma 3's Q4_K_M file has Q5_0 q / k and a Q8_0 v in half its layers."""
        if not parts or any(p is None for p in parts):
            return None
        if {(p.qtype, p.layout) for p in parts} == {(Q5_0, GGUF), (Q8_0, GGUF)}:
            parts = [QuantizedWeight(q5_0_as_q8_0(p.data), Q8_0) if p.qtype == Q5_0 else p for p in parts]
        if len({(p.qtype, p.layout) for p in parts}) != 1:
            return None
        return QuantizedWeight(torch.cat([p.data for p in parts]).contiguous(), parts[0].qtype, parts[0].layout)


def q5_0_as_q8_0(data: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks (uint8 [rows, blocks * 22]) as Q8_0 blocks of the same weights: the same float16
    d, and the quant q - 16 (-16..15) as a signed byte; both dequantize to d * (q - 16)."""
    raw = data.numpy().reshape(data.shape[0], -1, 22)
    qh = np.ascontiguousarray(raw[..., 2:6]).view("<u4")                       # [rows, blocks, 1]: bit j, weight j
    qs = raw[..., 6:]
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)                         # weights 0..15, 16..31
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    quants = ((low | high).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return torch.from_numpy(np.concatenate([raw[..., :2], quants], axis=-1).reshape(data.shape[0], -1))


def gguf_name_map(reader, hf_config):
    """transformers' tensor processor for the file's architecture (it undoes llama.cpp's q/k row
    order), with the config keys it reads, and its map of GGUF tensor names to HF names."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    arch_field = reader.fields["general.architecture"]
    architecture = bytes(arch_field.parts[arch_field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config={
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads)})
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    return processor, get_gguf_hf_weights_map(skeleton, processor)


def read_gguf_dequantized(reader, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors one at a time, dequantized to float32 and named as in HF, exactly as
    transformers' GGUF reader makes them (gguf-py's dequantize, then its processor), without
    ever holding the whole model in float32 (its reader returns every tensor at once: 540 MiB
    for the default model, ~28 GB for a 7B). reader: the file's gguf.GGUFReader."""
    processor, names = gguf_name_map(reader, hf_config)
    for tensor in reader.tensors:
        result = processor.process(weights=_dequantize(tensor), name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters={})
        if result.name in names:
            w = result.weights
            if not (w.flags.owndata and w.flags.writeable and w.flags.c_contiguous):
                w = np.copy(w)  # a view of the file's mapping, or of a bigger array
            yield names[result.name], torch.from_numpy(w)


def _dequantize(tensor, chunk_bytes: int = 1 << 23) -> np.ndarray:
    """gguf-py's dequantize, a few rows at a time for a big tensor: its float32 temporaries
    are several times the output (~0.3 GiB for the default model's embedding at once). Blocks
    never span rows, so every value is the one a single call computes."""
    from gguf import dequantize

    data = tensor.data
    rows = data.shape[0] if data.ndim == 2 else 0
    if rows < 2 or data.nbytes <= chunk_bytes:
        return dequantize(data, tensor.tensor_type)
    step = max(1, rows * chunk_bytes // data.nbytes)
    first = dequantize(data[:step], tensor.tensor_type)
    out = np.empty((rows,) + first.shape[1:], dtype=first.dtype)
    out[:step] = first
    for r in range(step, rows, step):
        out[r:r + step] = dequantize(data[r:r + step], tensor.tensor_type)
    return out


def read_gguf_quantized(reader, hf_config) -> dict[str, QuantizedWeight]:
    """The file's tensors of a type in QTYPES, by HF parameter name (e.g.
    "model.layers.0.self_attn.q_proj.weight"); other tensors are left to the dense loader.
    reader: the file's gguf.GGUFReader."""
    processor, names = gguf_name_map(reader, hf_config)
    out: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        qtype = int(tensor.tensor_type)
        if qtype not in QTYPES or tensor.name not in names:
            continue
        raw = np.asarray(tensor.data)
        # a row permutation on the dequantized weights is the same permutation on the rows' blocks
        raw = processor.process(weights=raw, name=tensor.name, tensor_key_mapping=names,
                                parsed_parameters={}).weights
        out[names[tensor.name]] = QuantizedWeight(torch.from_numpy(np.array(raw, order="C")), qtype)
    return out
