"""The Llama family (Llama, Qwen2, Qwen3, Mistral, SmolLM) in torch, over a paged KV cache.

RMSNorm, rotary embeddings (models/rotary.py), grouped-query attention, SwiGLU MLP,
optional QKV bias (Qwen2), per-head q/k RMSNorm (Qwen3), sliding windows on every layer
(Mistral) or some (layer_types) and tied embeddings. Q, K and V share one matmul, as do
gate and up. The attention and op backends are the model runner's choice, set once
with `use_backend`.
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

import torch
from torch import nn

from tessera_engine import weight_arena
from tessera_engine.attention import AttentionMetadata, PagedAttention, TorchAttention
from tessera_engine.models.packed_linear import ONEDNN, PackedWeight
from tessera_engine.models.quantized import INT8_X16, QuantizedWeight
from tessera_engine.models.rotary import RotaryEmbedding
from tessera_engine.ops import QuantizedPath, TorchOps

_TORCH_OPS = TorchOps()


class MatmulPair(NamedTuple):
    """One matmul with a quantized weight, runnable either way (LlamaForCausalLM.matmul_pairs)."""
    in_features: int
    signature: tuple[int, int, int]  # (out features, in features, ggml type)
    quantized: Callable[[torch.Tensor], torch.Tensor]
    dense: Callable[[torch.Tensor], torch.Tensor]


def attention_windows(config) -> list[int | None]:
    """Each layer's attention window (None: full attention), as HF reads the config: Mistral's
    `sliding_window` on every layer; Qwen2/Qwen3's only with `use_sliding_window`, and Gemma's,
    on the layers `layer_types` names sliding. Layers that differ get KV cache groups of their
    own (kv_layout.py)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * n
    kinds = list(getattr(config, "layer_types", None) or ["sliding_attention"] * n)
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if unknown or len(kinds) != n:
        raise ValueError(f"{config.model_type}: layer_types {sorted(set(kinds))} for {n} layers: only "
                         "sliding_attention and full_attention layers are supported, one per layer")
    return [int(window) if k == "sliding_attention" else None for k in kinds]


class RowSplit:
    """Which of a step's rows take a decoder layer's dense weights: the rows from `dense_from`
    on (prompt rows, where the backend plan puts them on the dense matmul: `prompt_dense`),
    None: none. Set by the model's forward for its step, read by its linear layers."""
    __slots__ = ("dense_from",)

    def __init__(self) -> None:
        self.dense_from: int | None = None


class Linear(nn.Linear):
    """nn.Linear whose bf16 CPU matmul runs on a prepacked weight (see PackedWeight), and,
    where the layer has the checkpoint's block-quantized weight (`qweight`, GGUF) and the
    ops backend a kernel for it (`qlinear`, set by use_backend), on that for batches of up
    to `q_max_rows` rows: a decode of a few sequences is a pass over the weights, and the
    quantized pass reads ~0.6 bytes a weight instead of 2 or 4. A decoder layer's that keeps
    its dense weight has the model's `split` (use_backend): the rows from the step's
    dense_from on (prompt rows, where the plan's prompt_dense has the runner name them) take
    the dense weights instead, a prompt chunk being many rows, where the dense matmul
    computes faster (AMX)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pw = PackedWeight()
        self.qweight: QuantizedWeight | None = None
        self.qpath: QuantizedPath | None = None  # the ops' kernels for qweight (prepare_quantized)
        self.qlinear = None
        self.q_max_rows = 0
        self.dense_dropped = False  # the dense weight was freed: the quantized one serves every batch
        self.lora = None  # lora.LoRALayer: each row's adapter delta added to the output (attach_lora)
        self.split: RowSplit | None = None  # the model's, where prompt rows take the dense weights

    def pack_for_good(self, packing=ONEDNN) -> None:
        """Pack the bf16 CPU weight now (models/packed_linear.py) and free the plain copy, which
        nothing reads after that: the layer then holds one dense copy of its weights (plus the
        file's quantized one, where it has it), not two. Nothing happens where the weight
        cannot be packed."""
        self._pw.use(packing)
        if self.dense_dropped or self._pw.frozen or not self._pw.freeze(self.weight):
            return
        self._free_weight()

    def drop_dense(self) -> None:
        """Free the dense weight for good, packed or not: the quantized one (qpath) serves every batch."""
        self._free_weight()
        self._pw = PackedWeight()
        self.dense_dropped = True

    def _free_weight(self) -> None:
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.qlinear is not None and x.dim() == 2 and n <= self.q_max_rows:
            split = n if self.split is None or self.split.dense_from is None else self.split.dense_from
            if split >= n:
                y = self.qlinear(x if x.is_contiguous() else x.contiguous(), self.qweight.data,
                                 self.qweight.qtype, self.bias)
            elif split <= 0:
                y = self._pw.linear(x, self.weight, self.bias)
            else:  # generated rows first, then prompt rows (the model runner's order)
                y = torch.cat([self.qlinear(x[:split].contiguous(), self.qweight.data, self.qweight.qtype, self.bias),
                               self._pw.linear(x[split:], self.weight, self.bias)])
        elif self.dense_dropped:
            raise RuntimeError("this layer's dense weight was dropped (batch-invariant plan): "
                               f"{tuple(x.shape)} activations cannot take the quantized matmul")
        else:
            y = self._pw.linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.apply(x, y)
        return y


class RMSNorm(nn.Module):
    """RMSNorm as HF computes it; with `residual`, adds x to it first (vLLM's fused form)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops: TorchOps = _TORCH_OPS

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, with residual: (norm(residual + x), residual + x), the sum kept in residual."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size,
                                bias=bool(getattr(config, "attention_bias", False)))
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)
        self.backend: TorchAttention | None = None  # set by use_backend
        # Qwen3: each head's q and k RMS-normalized before the rotary embedding
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self._qkv, self._o = self.qkv_proj.forward, self.o_proj.forward  # see LlamaDecoderLayer

    def _normalize_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        T, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # with one KV head, k's reshape is a strided view of qkv: the norm kernels take contiguous rows
        q = self.q_norm(q.reshape(T * self.num_heads, d).contiguous()).view(T, self.q_size)
        k = self.k_norm(k.reshape(T * self.num_kv_heads, d).contiguous()).view(T, self.kv_size)
        return torch.cat([q, k, v], dim=-1)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        k_cache, v_cache = kv_cache
        qkv = self._qkv(x)
        if self.qk_norm:
            qkv = self._normalize_qk(qkv)
        q = self.backend.rope_and_cache(self.attn, qkv, cos, sin, k_cache, v_cache, meta)
        return self._o(self.backend.forward(self.attn, q, k_cache, v_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, config.hidden_size, bias=False)
        self.ops: TorchOps = _TORCH_OPS
        self._gate_up, self._down = self.gate_up_proj.forward, self.down_proj.forward  # see LlamaDecoderLayer

    def forward(self, x):
        return self._down(self.ops.silu_and_mul(self._gate_up(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        # The children's forward methods, bound once: a decode step makes ~270 module calls,
        # and nn.Module.__call__ plus the submodule lookups were a measurable share of a
        # single-request step (no hooks are used on these modules).
        self._steps = (self.input_layernorm.forward, self.self_attn.forward,
                       self.post_attention_layernorm.forward, self.mlp.forward)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """x: the previous layer's MLP output (or the embeddings, residual None) -> (this
        layer's MLP output, the residual stream before it); HF's two residual adds, fused
        into the norms that follow them."""
        norm1, attn, norm2, mlp = self._steps
        if residual is None:
            residual, h = x, norm1(x)
        else:
            h, residual = norm1(x, residual)
        h = attn(h, cos, sin, kv_cache, meta)
        h, residual = norm2(h, residual)
        return mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self._layer_steps = [layer.forward for layer in self.layers]  # see LlamaDecoderLayer
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.attention_windows = attention_windows(config)
        self._tied_pw = PackedWeight()
        self.embed_q: QuantizedWeight | None = None  # the checkpoint's quantized embedding table
        self.embed_qpath: QuantizedPath | None = None  # the ops' kernels for it (prepare_quantized)
        self.qembedding = None  # the ops backend's lookup in it, when used (use_backend)
        self.tied_qlinear = None  # the ops backend's qlinear for the tied lm_head, when used
        self.tied_q_max_rows = 0
        self.attention: TorchAttention | None = None  # set by use_backend
        self._stack = None  # the kernels' DecoderStack, when use_backend finds it applies (_decoder_stack)
        self._stack_rows = 0
        self._lora_attached = False
        self.split = RowSplit()  # this step's prompt rows (forward's dense_from), for the layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metas: list[AttentionMetadata],
                dense_from: int | None = None) -> torch.Tensor:
        """Flat batch of T tokens → final hidden states [T, hidden]. kv_caches, metas: each
        layer's cache tensors and its KV cache group's step metadata. dense_from: the first
        prompt row, where prompt rows take the decoder layers' dense weights (the plan's
        prompt_dense; the rows before it are output rows), None: every row on one path."""
        self.split.dense_from = dense_from
        x = (self.embed_tokens(input_ids) if self.qembedding is None else
             self.qembedding(input_ids, self.embed_q.data, self.embed_q.qtype, self.config.hidden_size,
                             self.embed_tokens.weight.dtype))
        cos, sin = self.attention.rotary_tables(self.rotary, x.dtype, positions)
        meta = metas[0] if metas else None
        if (self._stack is not None and x.shape[0] <= self._stack_rows and not self._lora_attached
                and (dense_from is None or dense_from >= x.shape[0])
                and meta.copy_slots is None and all(m is meta for m in metas)):
            # the same calls as the loop below, made from C++ (csrc/decoder_stack.cpp); the caches
            # are the caller's (a model may serve several runners), flattened each step (~10 us)
            dm = meta.decode
            return self._stack.forward(x, meta.positions, cos, sin, [t for kv in kv_caches for t in kv],
                                       meta.slot_mapping, dm.block_tables, dm.context_lens,
                                       self.attention.block_size, dm.window)
        residual = None
        for layer, kv, meta in zip(self._layer_steps, kv_caches, metas):
            x, residual = layer(x, residual, cos, sin, kv, meta)
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)

    def pack_dense(self, packing) -> None:
        """Pack every dense CPU bf16 weight once for `packing` (models/packed_linear.py), freeing
        the plain copies; a weight that cannot be packed stays as it is."""
        self._tied_pw.use(packing)
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack_for_good(packing)

    def drop_dense_of_quantized(self, keep_layers: bool = False) -> int:
        """Free the dense weight of every linear layer whose quantized weight the ops run
        (prepare_quantized), for a plan that never multiplies by it; returns how many. A tied
        embedding table the ops run quantized goes too: the lookup and the lm_head both read the
        quantized table then (Gemma 3's is 262144 x 640: 320 MiB in bf16). keep_layers: only
        the lm_head's (tied or not), for a plan whose prompt rows take the decoder layers' dense
        weights (logits always come from the quantized lm_head then)."""
        n = 0
        layers = set(self.layers.modules()) if keep_layers else set()
        for m in self.modules():
            if isinstance(m, Linear) and m.qpath is not None and not m.dense_dropped and m not in layers:
                m.drop_dense()
                n += 1
        w = self.embed_tokens.weight
        if self.lm_head is None and self.embed_qpath is not None and w.numel():
            self.embed_tokens.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device),
                                                    requires_grad=False)
            self._tied_pw = PackedWeight(self._tied_pw.packing)
            n += 1
        return n

    def has_dense_layers(self) -> bool:
        """Whether every decoder layer's quantized linear layer still has its dense weight."""
        return all(not m.dense_dropped for m in self.layers.modules() if isinstance(m, Linear))

    def has_quantized(self) -> bool:
        return self.embed_q is not None or any(isinstance(m, Linear) and m.qweight is not None
                                               for m in self.modules())

    def prepare_quantized(self, ops: TorchOps) -> None:
        """Each quantized weight put in the layout the ops' kernels read (ops.quantized_path:
        repacked for the int8 matmul, or kept as the file has it), once, before timing or use.
        The repacked ones (what a one-row step streams) go into one block of memory in forward
        order, the tied lm_head last (weight_arena.py)."""
        linears = [m for m in self.modules() if isinstance(m, Linear) and m.qweight is not None]
        # a bound on the repacked bytes: a layout holds at most 40 bytes a 32 weights (Q6_K's
        # 26.25 repacked as Q8_0S), so twice the file's; pages never written take no memory
        file_bytes = sum(m.qweight.data.numel() for m in linears) + (
            self.embed_q.data.numel() if self.embed_q is not None else 0)
        arena = weight_arena.WeightArena(2 * file_bytes + 64 * (len(linears) + 1))

        def prepared(weight: QuantizedWeight) -> QuantizedPath | None:
            path = ops.quantized_path(weight)
            if path is not None and weight.layout != INT8_X16 and path.weight.layout == INT8_X16:
                path = path._replace(weight=path.weight._replace(data=arena.put(path.weight.data)))
            return path

        for m in linears:
            m.qpath = prepared(m.qweight)
            if m.qpath is not None:
                m.qweight = m.qpath.weight
        if self.embed_q is not None:
            self.embed_qpath = prepared(self.embed_q)
            if self.embed_qpath is not None:
                self.embed_q = self.embed_qpath.weight

    def matmul_pairs(self, lm_head: bool = True) -> list["MatmulPair"]:
        """Each matmul with a quantized weight prepared for the ops (prepare_quantized), in forward
        order, as its two ways of running: the quantized kernel and the dense (packed) path (see
        quantized_crossover.py, which times them); lm_head False: the decoder layers' only."""
        pairs = []
        for m in (self.modules() if lm_head else self.layers.modules()):
            if isinstance(m, Linear) and m.qpath is not None:
                pairs.append(MatmulPair(
                    m.in_features, (m.out_features, m.in_features, m.qweight.qtype),
                    lambda x, m=m: m.qpath.linear(x, m.qweight.data, m.qweight.qtype, m.bias),
                    lambda x, m=m: m._pw.linear(x, m.weight, m.bias)))
        if lm_head and self.lm_head is None and self.embed_qpath is not None:
            w = self.embed_tokens.weight
            pairs.append(MatmulPair(
                w.shape[1], (w.shape[0], w.shape[1], self.embed_q.qtype),
                lambda x: self.embed_qpath.linear(x, self.embed_q.data, self.embed_q.qtype, None),
                lambda x: self._tied_pw.linear(x, w, None)))
        return pairs

    def use_backend(self, attention: TorchAttention, ops: TorchOps, q_max_rows: int,
                    decoder_stack: bool = False) -> dict:
        """The backend plan's attention and ops, for every layer; layers with a quantized weight
        prepared for the ops (prepare_quantized) run its kernel for up to q_max_rows rows (0:
        never), but for the rows forward's dense_from names (the plan's prompt_dense), which
        the decoder layers' run on their dense weights where kept; decoder_stack: the plan lets
        forward run the layers in one C++ call where that covers them (_decoder_stack). Returns
        how many linear layers took each path ("Q4_1 int8": 210, "dense": 1, ...)."""
        self.attention = attention
        layers = set(self.layers.modules())
        paths: dict[str, int] = {}
        for m in self.modules():
            if isinstance(m, (RMSNorm, LlamaMLP)):
                m.ops = ops
            elif isinstance(m, LlamaAttention):
                m.backend = attention
            elif isinstance(m, Linear):
                usable = q_max_rows > 0 and m.qpath is not None
                m.qlinear, m.q_max_rows = (m.qpath.linear, q_max_rows) if usable else (None, 0)
                m.split = self.split if usable and m in layers and not m.dense_dropped else None
                kind = m.qpath.name if usable else "dense"
                paths[kind] = paths.get(kind, 0) + 1
        use_tied = q_max_rows > 0 and self.embed_qpath is not None and self.lm_head is None
        self.qembedding = self.embed_qpath.embedding if use_tied else None
        self.tied_qlinear, self.tied_q_max_rows = (self.embed_qpath.linear, q_max_rows) if use_tied else (None, 0)
        if self.lm_head is None:
            kind = self.embed_qpath.name if use_tied else "dense"
            paths[kind] = paths.get(kind, 0) + 1
        self._stack = self._decoder_stack(ops.kernels) if decoder_stack else None
        self._stack_rows = q_max_rows
        self._lora_attached = any(isinstance(m, Linear) and m.lora is not None for m in self.modules())
        return paths

    @property
    def decoder_layers(self) -> str:
        """How forward runs the layers (for the model runner's log)."""
        return "C++ DecoderStack, up to the quantized rows" if self._stack is not None else "Python loop"

    # Whether this class's forward is the loop DecoderStack makes (Gemma 3's is not).
    decoder_stack_ok = True

    def _decoder_stack(self, kernels):
        """The kernels' DecoderStack over this model's layers (the plan has the fused kernels, a
        quantized matmul and allows the stack: choose_decoder_stack), where it makes exactly the
        calls forward's loop makes: every matmul on a quantized kernel, one attention window for
        all layers, no per-head q/k norms. None otherwise (forward's loop runs)."""
        if not self.decoder_stack_ok or len(set(self.attention_windows)) != 1:
            return None
        weights, qtypes, int8 = [], [], []
        none = torch.empty(0)
        eps = {layer.input_layernorm.eps for layer in self.layers} | {layer.post_attention_layernorm.eps
                                                                     for layer in self.layers}
        if len(eps) != 1 or self.norm.eps not in eps:
            return None
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if attn.qk_norm or any(m.qlinear not in (kernels.qlinear_i8, kernels.qlinear) for m in linears):
                return None
            for m in linears:
                qtypes.append(m.qweight.qtype)
                int8.append(int(m.qlinear is kernels.qlinear_i8))
            weights += [layer.input_layernorm.weight, attn.qkv_proj.qweight.data,
                        none if attn.qkv_proj.bias is None else attn.qkv_proj.bias,
                        attn.o_proj.qweight.data, none if attn.o_proj.bias is None else attn.o_proj.bias,
                        layer.post_attention_layernorm.weight, mlp.gate_up_proj.qweight.data,
                        mlp.down_proj.qweight.data]
        a = self.layers[0].self_attn
        return kernels.DecoderStack(weights, qtypes, int8, self.norm.weight, a.num_heads, a.num_kv_heads,
                                    a.head_dim, eps.pop(), a.attn.scale)

    # -- LoRA (lora.py) ---------------------------------------------------------------
    def lora_shapes(self):
        from tessera_engine.lora import LayerShapes

        attn = self.layers[0].self_attn
        return LayerShapes(len(self.layers), self.config.hidden_size, attn.q_size, attn.kv_size,
                           self.layers[0].mlp.inter)

    def lora_targets(self) -> list[tuple[int, str, list[str], list[int], "Linear"]]:
        """Each linear layer an adapter may change: (layer index, its name, the PEFT modules fused
        in it, their output column bounds, the layer)."""
        out = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, kv = attn.q_size, attn.kv_size
            out += [(i, "qkv_proj", ["q_proj", "k_proj", "v_proj"], [0, q, q + kv, q + 2 * kv], attn.qkv_proj),
                    (i, "o_proj", ["o_proj"], [0, attn.o_proj.out_features], attn.o_proj),
                    (i, "gate_up_proj", ["gate_proj", "up_proj"], [0, mlp.inter, 2 * mlp.inter], mlp.gate_up_proj),
                    (i, "down_proj", ["down_proj"], [0, mlp.down_proj.out_features], mlp.down_proj)]
        return out

    def attach_lora(self, lora_layers) -> None:
        """Each LoRALayer onto its linear layer (lora_targets' order)."""
        for (_, _, _, _, linear), lora in zip(self.lora_targets(), lora_layers):
            linear.lora = lora
        self._lora_attached = any(lora is not None for lora in lora_layers)  # forward's loop applies them

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self.tied_qlinear is not None and hidden.shape[0] <= self.tied_q_max_rows:
            return self.tied_qlinear(hidden if hidden.is_contiguous() else hidden.contiguous(),
                                     self.embed_q.data, self.embed_q.qtype, None)
        return self._tied_pw.linear(hidden, self.embed_tokens.weight, None)

    def load_quantized(self, weights: dict[str, QuantizedWeight]) -> None:
        """Attach the checkpoint's block-quantized weights (HF names, see models/quantized.py)
        to the layers they belong to, fused as the dense ones are (QKV, gate/up); a layer whose
        parts are not all quantized in one type keeps only its dense weight."""
        get = lambda name: weights.get(name) or weights.get("model." + name)  # noqa: E731
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj.qweight = QuantizedWeight.concat(
                [get(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")])
            attn.o_proj.qweight = get(p + "self_attn.o_proj.weight")
            mlp.gate_up_proj.qweight = QuantizedWeight.concat(
                [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            mlp.down_proj.qweight = get(p + "mlp.down_proj.weight")
        if self.lm_head is not None:
            self.lm_head.qweight = weights.get("lm_head.weight")
        else:
            self.embed_q = get("embed_tokens.weight")

    # -- weights -----------------------------------------------------------------
    def load_hf_state_dict(self, state: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (name, tensor) pairs named as in HF transformers' LlamaForCausalLM (a state dict's
        items, or a reader's stream), fusing QKV and gate/up."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor, rows: slice | None = None) -> None:
            p = params[name]
            with torch.no_grad():
                (p if rows is None else p[rows]).copy_(tensor.to(p.dtype))
            loaded.add(name)

        for hf_name, tensor in state:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight":
                if self.lm_head is not None:
                    put("lm_head.weight", tensor)
                continue
            parts = name.split(".")
            if parts[0] == "layers":
                attn = self.layers[int(parts[1])].self_attn
                q, kv = attn.q_size, attn.kv_size
                which, kind = parts[3], parts[-1]
                prefix = f"layers.{parts[1]}."
                rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
                if which in rows:
                    put(f"{prefix}self_attn.qkv_proj.{kind}", tensor, rows[which])
                    continue
                inter = self.layers[0].mlp.inter
                if which == "gate_proj":
                    put(f"{prefix}mlp.gate_up_proj.weight", tensor, slice(0, inter))
                    continue
                if which == "up_proj":
                    put(f"{prefix}mlp.gate_up_proj.weight", tensor, slice(inter, 2 * inter))
                    continue
            if name not in params:
                raise KeyError(f"unexpected weight {hf_name!r}")
            put(name, tensor)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
