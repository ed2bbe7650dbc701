"""LoRA adapters made in the test with peft, in its own format (adapter_config.json +
adapter_model.safetensors), and HF transformers + peft's greedy output with them: the
reference the engine's LoRA output is compared with."""
from __future__ import annotations

import copy
import pathlib

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(base, path: pathlib.Path | str, *, r: int = 8, alpha: int = 16, targets=ALL_TARGETS,
                  seed: int = 0, rslora: bool = False, std: float = 0.05, rank_pattern: dict | None = None,
                  layers: list[int] | None = None) -> pathlib.Path:
    """A random PEFT LoRA adapter for the HF model `base` (left unchanged), saved to `path`.
    peft starts B at zero (an adapter that changes nothing): both A and B are drawn here,
    N(0, std), so the adapter moves the model's output."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                     use_rslora=rslora, init_lora_weights=False, rank_pattern=rank_pattern or {},
                     layers_to_transform=layers, task_type="CAUSAL_LM")
    model = get_peft_model(copy.deepcopy(base), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    path = pathlib.Path(path)
    model.save_pretrained(str(path))
    return path


class PeftGreedy:
    """HF transformers + peft greedy generation on `base` with any of several adapters
    (None: the base model), results cached per (adapter, prompt, max_new_tokens)."""

    def __init__(self, base) -> None:
        self.base = base
        self.models: dict[str, object] = {}
        self.cache: dict[tuple, list[int]] = {}

    def _model(self, adapter: str | None):
        if adapter is None:
            return self.base
        if adapter not in self.models:
            from peft import PeftModel

            self.models[adapter] = PeftModel.from_pretrained(copy.deepcopy(self.base), adapter).eval()
        return self.models[adapter]

    def __call__(self, adapter: pathlib.Path | str | None, prompt, max_new_tokens: int) -> list[int]:
        key = (None if adapter is None else str(adapter), tuple(prompt), max_new_tokens)
        if key not in self.cache:
            model = self._model(key[0])
            with torch.inference_mode():
                out = model.generate(input_ids=torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens,
                                     do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            self.cache[key] = out[0, len(prompt):].tolist()
        return self.cache[key]
