"""LoRA adapters: PEFT adapters read and checked, kept resident in a few slots, and run
batched beside the base model, each row with its own adapter (or none).

- `read_adapter`: a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors)
  checked against the model: targets among q/k/v/o/gate/up/down, each module's rank up to
  --max-lora-rank, shapes that fit, alpha scaling (alpha / r, or alpha / sqrt(r) with rsLoRA,
  per module where rank_pattern / alpha_pattern say so). Anything else is refused, naming it.
- `LoRAManager`: the adapters served, by name; `max_loras` slots of stacked weights (the
  least recently used slot is reloaded when a step needs an adapter that is not resident);
  per step, each row's slot (`prepare`), which every layer's `LoRALayer` reads.
- `LoRALayer`: one fused linear layer's slots (QKV has three sub-modules, gate/up two): the
  base output plus, per row, scale * B (A x), never merged into the base weight. The ops
  backend computes it (`lora_add`: shrink then expand per adapter, as punica's SGMV does).

The scheduler keeps at most max_loras adapters among the running requests; a request's
prefix-cache chain starts from its adapter's `salt` (kv_cache.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import pathlib
import re
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

# PEFT's module names -> (our fused layer, its sub-module index)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "down_proj": ("down_proj", 0)}
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
RANK_STEP = 16  # slots hold ranks padded to a multiple of this (the kernel's vector width)


class LoRAError(ValueError):
    """An adapter refused; `code` is the grpc.StatusCode name it maps to."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


class ModuleWeights(NamedTuple):
    a: torch.Tensor  # [r, in] float32
    b: torch.Tensor  # [out of the sub-module, r] float32
    scale: float


@dataclasses.dataclass(eq=False)
class Adapter:
    """One adapter's weights as read: (layer, PEFT module name) -> ModuleWeights."""
    name: str
    path: str
    modules: dict[tuple[int, str], ModuleWeights]
    uid: int = 0    # which load this is (LoRAManager.register): a name reloaded is another adapter
    salt: bytes = b""  # the root of its requests' prefix-cache chains

    @property
    def rank(self) -> int:
        return max(m.a.shape[0] for m in self.modules.values())

    @property
    def target_modules(self) -> list[str]:
        names = {name for _, name in self.modules}
        return [t for t in TARGETS if t in names]


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the end of the
    module's full name (a bare `q_proj` or `model.layers.3.self_attn.q_proj`)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter(name: str, path: str, layer_shapes: "LayerShapes", max_rank: int) -> Adapter:
    """The adapter in directory `path`, checked against the model (LoRAError naming what is wrong)."""
    from safetensors import safe_open

    root = pathlib.Path(path)
    if not root.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a directory")
    cfg_path, weights_path = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not cfg_path.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {path} has no adapter_config.json")
    if not weights_path.is_file():
        extra = " (adapter_model.bin is not read: save it with safetensors)" if (root / "adapter_model.bin").exists() else ""
        raise LoRAError(f"LoRA adapter {name!r}: {path} has no adapter_model.safetensors{extra}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not a JSON object")
    refuse = [
        (cfg.get("peft_type", "LORA") != "LORA", f"peft_type {cfg.get('peft_type')!r} (LORA only)"),
        (bool(cfg.get("use_dora")), "use_dora (DoRA is not supported)"),
        (cfg.get("bias", "none") != "none", f"bias {cfg.get('bias')!r} (trained biases are not supported)"),
        (bool(cfg.get("modules_to_save")), f"modules_to_save {cfg.get('modules_to_save')} (only LoRA weights are served)"),
        (bool(cfg.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D layouts are not supported)"),
        (bool(cfg.get("lora_bias")), "lora_bias is not supported"),
    ]
    for bad, what in refuse:
        if bad:
            raise LoRAError(f"LoRA adapter {name!r}: {what}")
    alpha = cfg.get("lora_alpha", cfg.get("r", 8))
    rslora = bool(cfg.get("use_rslora", False))
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():
                m = _TENSOR.search(key)
                if m is None:
                    raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a "
                                    f"decoder layer's {'/'.join(TARGETS)} (embedding, lm_head and bias "
                                    f"adapters are not supported)")
                layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
                if module not in TARGETS:
                    raise LoRAError(f"LoRA adapter {name!r}: module {module!r} ({key}) is not one of "
                                    f"{', '.join(TARGETS)}")
                if layer >= layer_shapes.num_layers:
                    raise LoRAError(f"LoRA adapter {name!r}: {key} is for layer {layer}; the model has "
                                    f"{layer_shapes.num_layers}")
                parts.setdefault((layer, module), {})[ab] = f.get_tensor(key).float()
    except LoRAError:
        raise
    except Exception as exc:  # a truncated or foreign file
        raise LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors cannot be read: {exc}") from None
    if not parts:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    modules = {}
    for (layer, module), ab in sorted(parts.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: {where} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        in_f, out_f = layer_shapes.module_shape(module)
        r = a.shape[0]
        if a.dim() != 2 or a.shape[1] != in_f or b.dim() != 2 or b.shape != (out_f, r):
            raise LoRAError(f"LoRA adapter {name!r}: {where} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                            f"this model needs A [r, {in_f}] and B [{out_f}, r]")
        if r > max_rank:
            raise LoRAError(f"LoRA adapter {name!r}: {where} has rank {r}, over --max-lora-rank {max_rank}")
        full = f"base_model.model.model.layers.{layer}.{'self_attn' if module in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{module}"
        r_cfg = _pattern_value(cfg.get("rank_pattern"), full, cfg.get("r", r))
        a_mod = _pattern_value(cfg.get("alpha_pattern"), full, alpha)
        if r_cfg != r:
            raise LoRAError(f"LoRA adapter {name!r}: {where} has rank {r}, its config says {r_cfg}")
        scale = a_mod / math.sqrt(r) if rslora else a_mod / r
        modules[(layer, module)] = ModuleWeights(a.contiguous(), b.contiguous(), float(scale))
    return Adapter(name, str(root), modules)


class LayerShapes(NamedTuple):
    """The model's shapes a LoRA adapter must fit."""
    num_layers: int
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in, out) features of a PEFT module name."""
        return {"q_proj": (self.hidden, self.q_size), "k_proj": (self.hidden, self.kv_size),
                "v_proj": (self.hidden, self.kv_size), "o_proj": (self.q_size, self.hidden),
                "gate_proj": (self.hidden, self.intermediate), "up_proj": (self.hidden, self.intermediate),
                "down_proj": (self.intermediate, self.hidden)}[module]


class LoRABatch:
    """This step's rows' adapter slots ([T] int32, -1 for none), or None when no row has one,
    and the slots used: what every LoRALayer of the model reads (set by LoRAManager.prepare)."""
    slots: torch.Tensor | None = None
    used: tuple[int, ...] = ()


class LoRALayer:
    """One fused linear layer's adapter slots (float32, or bfloat16 in a bfloat16 engine): a [S, in, subs * rank] (A transposed, each
    sub-module's rank columns side by side) and b [S, rank, out] (B transposed, each output
    column reading its own sub-module's rank), zero where a slot's adapter has no weight."""

    def __init__(self, layer: int, subs: list[str], bounds: list[int], in_features: int,
                 num_slots: int, rank: int, batch: LoRABatch, ops, device, dtype: torch.dtype) -> None:
        self.layer, self.subs = layer, subs
        self.rank = rank
        self.a = torch.zeros(num_slots, in_features, len(subs) * rank, device=device, dtype=dtype)
        self.b = torch.zeros(num_slots, rank, bounds[-1], device=device, dtype=dtype)
        self.scales = torch.zeros(num_slots, len(subs), device=device)
        self.bounds = torch.tensor(bounds, dtype=torch.long)
        self.has = [False] * num_slots  # the slot's adapter has weights in this layer
        self.batch = batch
        self.lora_add = ops.lora_add

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (the base layer's output for x) += each row's adapter delta, in place. Skipped where
        no adapter of the step targets this layer (PEFT's default for Llama is q and v only): a
        decode reads the weights it uses, not a slot's zeros."""
        slots = self.batch.slots
        if slots is not None and any(self.has[s] for s in self.batch.used):
            self.lora_add(y, x if x.is_contiguous() else x.contiguous(), self.a, self.b, slots, self.scales,
                          self.bounds)

    def load(self, slot: int, adapter: Adapter) -> None:
        """The slot's weights: the adapter's for this layer's sub-modules, zeros elsewhere."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scales[slot].zero_()
        self.has[slot] = any((self.layer, sub) in adapter.modules for sub in self.subs)
        cuts = self.bounds.tolist()
        for i, sub in enumerate(self.subs):
            w = adapter.modules.get((self.layer, sub))
            if w is not None:
                r = w.a.shape[0]
                self.a[slot, :, i * self.rank:i * self.rank + r] = w.a.t()
                self.b[slot, :r, cuts[i]:cuts[i + 1]] = w.b.t()
                self.scales[slot, i] = w.scale


class LoRAManager:
    """The adapters this engine serves (by name) and the slots their weights run from."""

    def __init__(self, model, max_loras: int, max_lora_rank: int, ops, device, dtype: torch.dtype) -> None:
        """dtype: the engine's. The adapters' weights are kept in bfloat16 when it computes in
        bfloat16 (as the base weights are; half the bytes a step reads), else in float32; the
        delta is computed in float32 either way."""
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        rank = -(-max_lora_rank // RANK_STEP) * RANK_STEP
        self.batch = LoRABatch()
        self.shapes: LayerShapes = model.lora_shapes()
        wdtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.layers = [LoRALayer(i, subs, bounds, linear.in_features, max_loras, rank, self.batch, ops, device, wdtype)
                       for i, _, subs, bounds, linear in model.lora_targets()]
        model.attach_lora(self.layers)
        self.device = device
        self.adapters: dict[str, Adapter] = {}  # served, by name, in load order
        self.resident: list[Adapter | None] = [None] * max_loras  # each slot's adapter
        self._last_used = [0] * max_loras
        self._uses = itertools.count(1)
        self._uids = itertools.count(1)
        self.loads = 0  # slot loads so far (the least recently used slot reloaded)

    # -- the served adapters (core thread) ------------------------------------------
    def read(self, name: str, path: str) -> Adapter:
        """Read and check an adapter (any thread: nothing here changes)."""
        if not name or not name.strip():
            raise LoRAError("lora_name is empty")
        return read_adapter(name, path, self.shapes, self.max_lora_rank)

    def register(self, adapter: Adapter) -> Adapter:
        if adapter.name in self.adapters:
            raise LoRAError(f"LoRA adapter {adapter.name!r} is already loaded", "ALREADY_EXISTS")
        adapter.uid = next(self._uids)
        adapter.salt = hashlib.sha256(f"lora\0{adapter.uid}\0{adapter.name}".encode()).digest()
        self.adapters[adapter.name] = adapter
        log.info("lora adapter loaded", extra={"lora_name": adapter.name, "path": adapter.path,
                                               "rank": adapter.rank, "modules": adapter.target_modules})
        return adapter

    def unregister(self, name: str) -> Adapter:
        """Stop serving it; requests already running with it finish with it (they hold it)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded", "NOT_FOUND")
        log.info("lora adapter unloaded", extra={"lora_name": name})
        return adapter

    def get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            served = ", ".join(self.adapters) or "none"
            raise LoRAError(f"the LoRA adapter {name!r} is not served here (served: {served})", "NOT_FOUND")
        return adapter

    # -- per step ------------------------------------------------------------------
    def prepare(self, rows: list[tuple[Adapter | None, int]]) -> None:
        """This step's rows, in flat-batch order as (adapter, number of rows): the adapters
        made resident (the scheduler keeps at most max_loras in a step) and each row's slot."""
        wanted = {a for a, _ in rows if a is not None}
        if not wanted:
            self.batch.slots, self.batch.used = None, ()
            return
        slot_of = {}
        for adapter in wanted:
            slot_of[adapter] = self._slot(adapter, wanted)
        slots = [slot_of[a] if a is not None else -1 for a, n in rows for _ in range(n)]
        self.batch.slots = torch.tensor(slots, dtype=torch.int32, device=self.device)
        self.batch.used = tuple(slot_of.values())

    def clear(self) -> None:
        self.batch.slots, self.batch.used = None, ()

    def _slot(self, adapter: Adapter, wanted: set[Adapter]) -> int:
        use = next(self._uses)
        for i, held in enumerate(self.resident):
            if held is adapter:
                self._last_used[i] = use
                return i
        free = [i for i, held in enumerate(self.resident) if held is None or held not in wanted]
        if not free:
            raise RuntimeError(f"a step needs more than --max-loras {self.max_loras} adapters")
        i = min(free, key=lambda j: (self.resident[j] is not None, self._last_used[j]))
        for layer in self.layers:
            layer.load(i, adapter)
        self.resident[i] = adapter
        self._last_used[i] = use
        self.loads += 1
        return i
