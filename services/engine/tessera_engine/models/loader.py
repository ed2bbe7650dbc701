"""Load a Llama-family checkpoint (HF safetensors directory or GGUF file) into torch.

GGUF tensors are dequantized one at a time as transformers' GGUF reader does it (the
gguf package's dequantize, then transformers' processor, which undoes llama.cpp's Q/K
permutation), so our weights are exactly the ones
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` sees.
"""
from __future__ import annotations

import contextlib
import logging
import pathlib
from typing import Iterator, NamedTuple

import numpy as np
import torch

from tessera.common.model_source import ModelSource, resolve_model
from tessera_engine.models.gemma3 import Gemma3ForCausalLM
from tessera_engine.models.llama import LlamaForCausalLM
from tessera_engine.models.quantized import read_gguf_dequantized, read_gguf_quantized

log = logging.getLogger(__name__)

# model_type -> the class that runs it
MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM,
                 "mistral": LlamaForCausalLM, "gemma3_text": Gemma3ForCausalLM}
SUPPORTED = set(MODEL_CLASSES)
# families that come close, and what they lack
REFUSED = {
    "gemma3": "a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration): its vision tower is not "
              "supported; a text-only one (model_type gemma3_text, e.g. google/gemma-3-270m or -1b) or a "
              "GGUF file of the language model is",
    "gemma2": "Gemma 2 needs attention logit soft-capping (attn_logit_softcapping), which the attention "
              "backends do not apply",
}


def open_gguf(src: ModelSource):
    """The GGUF file's reader, for load_hf_config and the weight readers to share: parsing the
    default model's metadata (its 49k-token vocabulary) takes seconds each time."""
    from gguf import GGUFReader

    return GGUFReader(str(src.path))


def load_hf_config(src: ModelSource, reader=None):
    """The model's transformers config; for a GGUF file, transformers' reading of its metadata
    with what that reading misses for the families we run made good:
      - a "llama" file whose general.name is exactly "mistral" is read by transformers as a
        MistralConfig (with MistralConfig's default sliding window, which the file does not
        state), whose tensors transformers then cannot name (gguf-py has no "mistral"
        architecture); it is read as the llama file it is, as llama.cpp runs it;
      - {arch}.attention.key_length, the head size, is not read for qwen2 / qwen3 (a Qwen3
        config would keep its class default, 128), so it is set from the file;
      - a rope_freqs tensor (how llama.cpp stores Llama 3 rope scaling: one divisor per rotary
        frequency) is not read by transformers; its values go on the config as
        `rope_freq_factors`, which models/rotary.py applies.
    reader: open_gguf(src), when the caller has it already."""
    from transformers import AutoConfig

    if not src.gguf_file:
        return AutoConfig.from_pretrained(src.directory)
    config = AutoConfig.from_pretrained(src.directory, gguf_file=src.gguf_file)
    reader = reader or open_gguf(src)
    field = lambda key: reader.fields[key].contents() if key in reader.fields else None  # noqa: E731
    arch = field("general.architecture")
    if arch == "llama" and config.model_type == "mistral":
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        parsed = load_gguf_checkpoint(str(src.path), return_tensors=False)["config"]
        config = AutoConfig.for_model(**{**parsed, "model_type": "llama"})
    key_length, value_length = field(f"{arch}.attention.key_length"), field(f"{arch}.attention.value_length")
    if key_length and value_length in (None, key_length) and getattr(config, "head_dim", None) != key_length:
        config.head_dim = int(key_length)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        config.rope_freq_factors = [float(x) for x in np.asarray(freqs.data, dtype=np.float32).ravel()]
        log.info("rope frequencies scaled by the file's rope_freqs", extra={"model": src.name})
    if arch == "gemma3":
        _gemma3_as_llama_cpp_reads_it(config, field)
    return config


def _gemma3_as_llama_cpp_reads_it(config, field) -> None:
    """A gemma3 GGUF file's config as llama.cpp (the reference for what the file means) reads
    it, where transformers' reading keeps its class defaults instead:
      - no gemma3.attention.sliding_window: every layer global (transformers: a 4096 window);
        with one: llama.cpp's fixed pattern, every sixth layer global (transformers' default
        too), unless the file lists the layers (attention.sliding_window_pattern);
      - the local rotary base is 10000 (llama.cpp's constant; rope.freq_base_swa where a file
        states it), the file's rope.freq_base the global one, and a linear rope scaling
        (rope.scaling.type / factor) applies to the global layers only;
      - the attention scale is 1 / sqrt(head size) (query_pre_attn_scalar = key_length), except
        for the 62-layer 27B model, whose scalar is hidden / heads (transformers: 256 always);
      - final_logit_softcapping where the file has it."""
    n = config.num_hidden_layers
    window = field("gemma3.attention.sliding_window")
    pattern = field("gemma3.attention.sliding_window_pattern")
    if not window:
        config.sliding_window = None
        config.layer_types = ["full_attention"] * n
    else:
        config.sliding_window = int(window)
        if isinstance(pattern, list) and len(pattern) == n:
            config.layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            config.layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    full = {"rope_type": "default", "rope_theta": float(field("gemma3.rope.freq_base") or 1_000_000.0)}
    if field("gemma3.rope.scaling.type") == "linear" and field("gemma3.rope.scaling.factor"):
        full.update(rope_type="linear", factor=float(field("gemma3.rope.scaling.factor")))
    local = {"rope_type": "default", "rope_theta": float(field("gemma3.rope.freq_base_swa") or 10_000.0)}
    config.rope_parameters = {"full_attention": full, "sliding_attention": local}
    head = field("gemma3.attention.key_length") or config.hidden_size // config.num_attention_heads
    config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads if n == 62 else int(head))
    cap = field("gemma3.final_logit_softcapping")
    if cap:
        config.final_logit_softcapping = float(cap)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _safetensors_tensors(directory: pathlib.Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The directory's tensors one at a time (each file memory-mapped, not read whole)."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


class LoadedModel(NamedTuple):
    model: LlamaForCausalLM  # eval mode, on its device (a subclass for some families: MODEL_CLASSES)
    hf_config: object
    name: str
    max_model_len: int


def load_model(model: str | None, max_model_len: int | None, dtype: torch.dtype,
               device: torch.device, keep_quantized: bool = True) -> LoadedModel:
    """dtype, device, keep_quantized: the backend plan's (backend_plan.py). keep_quantized:
    also keep the GGUF tensors whose types the CPU kernels take (models/quantized.QTYPES) as
    the file has them, for their quantized matmul (a CPU plan's choice)."""
    src = resolve_model(model)
    reader = open_gguf(src) if src.gguf_file else None
    hf_config = load_hf_config(src, reader)
    if hf_config.model_type in REFUSED:
        raise ValueError(f"model type {hf_config.model_type!r} not supported: {REFUSED[hf_config.model_type]}")
    if hf_config.model_type not in SUPPORTED:
        raise ValueError(f"model type {hf_config.model_type!r} not supported (supported: {sorted(SUPPORTED)})")
    max_len = max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
    # built in its dtype and filled a tensor at a time: never a float32 copy of the whole model
    with _default_dtype(dtype):
        net = MODEL_CLASSES[hf_config.model_type](hf_config, max_len)
    if src.gguf_file:
        net.load_hf_state_dict(read_gguf_dequantized(reader, hf_config))
    else:
        net.load_hf_state_dict(_safetensors_tensors(src.directory))
    quantized = {}
    if src.gguf_file and keep_quantized:
        quantized = read_gguf_quantized(reader, hf_config)
        net.load_quantized(quantized)
    net = net.to(device=device, dtype=dtype).eval()
    net.requires_grad_(False)
    log.info("model loaded", extra={"model": src.name, "dtype": str(dtype), "device": str(device),
                                    "max_model_len": max_len, "quantized_tensors": len(quantized)})
    return LoadedModel(net, hf_config, src.name, max_len)
