"""BackendPlan: where and how the engine computes, decided once at engine start.

plan_backends makes every device, dtype and kernel decision, each with its reason, logs the
plan once, and the executor hands it down: to the loader (dtype, device, whether a GGUF
file's quantized blocks are kept), the model runner (attention and op backends), the model's
layers (how dense weights are packed, the quantized matmul and the batch size up to which
it runs), the sampler (the ops) and the scheduler (the token budget). None of them decides again.

The quantized matmul reads fewer bytes a weight, the dense one computes more efficiently
per row, so which is faster up to how many rows depends on the CPU, the thread count and
the weights: it is timed at start on the loaded model (quantized_crossover.py), not assumed.
"""
from __future__ import annotations

import dataclasses
import logging
import types

import torch

from tessera_engine import cpu_kernels, cpu_threads
from tessera_engine.attention import CpuKernelAttention, TorchAttention
from tessera_engine.config import DTYPES, EngineConfig
from tessera_engine.models.loader import LoadedModel, load_model
from tessera_engine.ops import CpuKernelOps, TorchOps
from tessera_engine.quantized_crossover import crossover_rows, known_prompt_rows_dense, prompt_rows_dense

log = logging.getLogger(__name__)

_CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# quantized_max_rows meaning every batch size (batch invariance: one matmul path for any rows)
ALL_ROWS = 2**31 - 1


def choose_device(setting: str) -> tuple[torch.device, str]:
    if setting != "auto":
        return torch.device(setting), "set by --device"
    if torch.cuda.is_available():
        return torch.device("cuda"), "auto: CUDA is available"
    return torch.device("cpu"), "auto: no CUDA device"


def choose_dtype(setting: str, device: torch.device) -> tuple[torch.dtype, str]:
    """auto, as vLLM chooses: bf16 on CUDA and on a CPU that computes bf16 natively
    (avx512_bf16 or amx_bf16), float32 on other CPUs."""
    if setting != "auto":
        try:
            return DTYPES[setting], "set by --dtype"
        except KeyError:
            raise ValueError(f"unknown dtype {setting!r}") from None
    if device.type == "cuda":
        return torch.bfloat16, "auto: bfloat16 on CUDA"
    native = sorted(_CPU_BF16_FLAGS & cpu_kernels.cpu_flags())
    if native:
        return torch.bfloat16, f"auto: this CPU computes bfloat16 natively ({', '.join(native)})"
    return torch.float32, "auto: float32, this CPU has no native bfloat16 (avx512_bf16 / amx_bf16)"


def choose_token_budget(setting: int | None, device: torch.device) -> tuple[int, str]:
    """Unset: 2048 on CUDA; 512 on CPU, where prefill is compute-bound: a burst's prompts then
    finish over several steps, so the first ones start streaming sooner at the same
    throughput, and a long prompt never holds running requests' next tokens for a whole
    2048-token step."""
    if setting is not None:
        return setting, "set by --max-num-batched-tokens"
    if device.type == "cuda":
        return 2048, "CUDA default"
    return 512, "CPU default: prefill is compute-bound, smaller steps start streams sooner"


def choose_quantized_matmul(setting: str, dtype: torch.dtype, kernels) -> tuple[bool, str]:
    """Whether the quantized matmul runs on int8 dot products (activations quantized per 16
    values, as llama.cpp does per 32; Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K weights) rather than exactly (each block
    dequantized to the activations' dtype). auto: int8 for bfloat16 activations, whose own
    rounding is of the same order, where this build has AVX512-VNNI; exact for float32, the
    dtype outputs are checked against HF transformers in."""
    available = kernels is not None and getattr(kernels, "int8_matmul_available", lambda: False)()
    if setting == "exact":
        return False, "set by --quantized-matmul"
    if setting == "int8":
        if available:
            return True, "set by --quantized-matmul"
        return False, "exact: --quantized-matmul int8 asks for AVX512-VNNI kernels, which this build lacks"
    if dtype != torch.bfloat16:
        return False, f"auto: exact in {str(dtype).removeprefix('torch.')}, the reference dtype"
    if not available:
        return False, "auto: exact, this build of the kernels has no AVX512-VNNI"
    return True, "auto: bfloat16 activations; int8 dot products on AVX512-VNNI"


def batch_invariance(config: EngineConfig, kernels, dense: str, rows: int) -> tuple[bool, str]:
    """Whether a row's results are the same whatever else runs in its step: its matmuls take one
    path at every batch size (the kernels' quantized and packed bf16 matmuls compute each row
    alike however many rows there are; F.linear in float32 does not, one row taking a
    matrix-vector path), and attention computes every row, prefill or decode, as a decode of its
    own position (the CPU kernels' attention; torch attention uses SDPA for prefill)."""
    if not config.batch_invariant:
        return False, "off (--no-batch-invariant): quantized layers switch to the dense weights past a crossover"
    if kernels is None:
        return False, "not possible with torch attention: prefill and decode rows take different kernels"
    if config.quantized_max_rows is not None and 0 < rows < ALL_ROWS:
        return False, "--quantized-max-rows splits batch sizes between two matmul paths"
    if dense == "torch":
        if rows != ALL_ROWS:
            return False, "dense matmuls in torch (F.linear) compute one row differently from several"
        return True, ("quantized layers on one path for every batch size (a layer without quantized blocks, "
                      "on F.linear, is not batch-invariant)")
    return True, "one matmul path per layer for every batch size, attention computed per row"


def choose_prompt_matmul(setting: str, model, ops, dtype: torch.dtype, dense: str, rows: int,
                         invariant: bool, known: tuple[bool, str] | None = None) -> tuple[bool, str]:
    """Whether a prompt's rows take the decoder layers' dense weights while output rows keep the
    quantized matmul (batch-invariant plans). Which path a row takes then depends on its request
    alone (prompt or output), never on its batch, so the same request still gives the same text
    however it runs (the scheduler keeps prompt and output tokens in separate chunks, the prefix
    cache keeps blocks of output tokens apart). A prompt chunk is many rows, where the dense bf16
    matmul computes faster on AMX; output rows are few per request, where reading fewer bytes a
    weight wins. auto: timed on the loaded model (quantized_crossover.prompt_rows_dense), or known:
    the answer the plan already read before packing (known_prompt_rows_dense)."""
    if setting == "quantized":
        return False, "set by --prompt-matmul"
    if rows != ALL_ROWS or not invariant:
        return False, "only where every batch size takes the quantized matmul (batch-invariant)"
    if dense == "torch":
        return False, "dense matmuls in torch (F.linear) compute one row differently from several"
    if setting == "auto" and known is not None and not known[0]:
        return False, f"auto: {known[1]} (read before packing: the layers' dense copies were never packed)"
    if not model.has_dense_layers():
        return False, "the decoder layers' dense weights were dropped"
    if setting == "dense":
        return True, "set by --prompt-matmul"
    dense_wins, why = known if known is not None else prompt_rows_dense(model, ops, dtype)
    return dense_wins, "auto: " + why


def choose_decoder_stack(config: EngineConfig, kernels, rows: int) -> tuple[bool, str]:
    """Whether a step of up to `rows` rows may run the decoder layers in one C++ call (the
    kernels' DecoderStack: the Python loop's kernel calls, made without the interpreter between
    them, ~1.5 ms of a one-request step on 2 cores). The model says at use_backend whether the
    stack covers it (models/llama.py: every matmul quantized, no LoRA layers attached)."""
    if config.enforce_eager:
        return False, "--enforce-eager: the Python loop"
    if kernels is None or not hasattr(kernels, "DecoderStack"):
        return False, "no fused CPU kernels: the Python loop"
    if rows <= 0:
        return False, "no quantized matmul: the Python loop"
    return True, "the layers' kernel calls in one C++ call a step, where the model's layers allow it"


@dataclasses.dataclass(frozen=True)
class BackendPlan:
    device: torch.device
    dtype: torch.dtype
    kernels: object | None      # tessera's compiled CPU kernels; None: torch ops everywhere
    ops: TorchOps               # norms, activations, argmax; the quantized matmul and embedding
    dense_matmul: str           # bf16 on CPU: the ops' prepacked matmul (brgemm, onednn); else torch
    keep_quantized: bool        # a GGUF file's quantized blocks are kept beside the dense weights
    quantized_matmul: str       # how they are multiplied: int8, exact (ops.quantized_path), none
    quantized_max_rows: int     # layers with quantized blocks run them up to this many rows (0: never)
    batch_invariant: bool       # a row's results do not depend on the rows beside it (as far as the plan can)
    prompt_dense: bool          # prompt rows take the decoder layers' dense weights, output rows the quantized
    token_budget: int           # tokens one step may compute
    decoder_stack: bool         # the model may run its decoder layers in one C++ call (kernels' DecoderStack)
    why: types.MappingProxyType  # each decision's reason, by name

    @property
    def attention_name(self) -> str:
        return CpuKernelAttention.name if self.kernels is not None else TorchAttention.name

    def attention(self, block_size: int, num_kv_heads: int) -> TorchAttention:
        """The attention backend (each KV cache group's window goes in its step metadata)."""
        if self.kernels is None:
            return TorchAttention(block_size, num_kv_heads, self.dtype, self.device)
        return CpuKernelAttention(self.kernels, block_size, num_kv_heads, self.dtype, self.device)

    def describe(self) -> dict:
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "attention": self.attention_name, "ops": self.ops.name, "dense_matmul": self.dense_matmul,
                "keep_quantized": self.keep_quantized, "quantized_matmul": self.quantized_matmul,
                "quantized_max_rows": "all" if self.quantized_max_rows == ALL_ROWS else self.quantized_max_rows,
                "decoder_stack": self.decoder_stack,
                "batch_invariant": self.batch_invariant, "prompt_dense": self.prompt_dense,
                "token_budget": self.token_budget,
                "why": dict(self.why)}


def prepare_weights(model, ops: TorchOps, keep_quantized: bool, drop_dense: bool) -> int:
    """A loaded model's weights put once in the layouts the plan's kernels read: the quantized
    ones prepared for the ops (keep_quantized), the dense copies of those layers freed where the
    plan never reads them (drop_dense), the rest packed for the dense matmul. Returns how many
    dense copies were dropped. For the engine's model and speculative decoding's draft."""
    if keep_quantized:
        model.prepare_quantized(ops)
    return pack_weights(model, ops, drop_dense)


def pack_weights(model, ops: TorchOps, drop_dense: bool) -> int:
    """prepare_weights after the quantized weights: the dense copies of the quantized layers freed
    (drop_dense), the rest packed for the dense matmul; how many were dropped."""
    dropped = model.drop_dense_of_quantized() if drop_dense else 0
    model.pack_dense(ops.dense_packing)
    return dropped


def plan_backends(config: EngineConfig, loaded: LoadedModel | None = None) -> tuple[BackendPlan, LoadedModel]:
    """Decide, bind the compute threads, load the weights as decided (unless `loaded`, a model
    already loaded in this plan's device and dtype, is given), pack them, time the quantized
    crossover on them; returns the plan, logged, and the model."""
    why: dict[str, str] = {}
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device, why["device"] = choose_device(config.device)
    dtype, why["dtype"] = choose_dtype(config.dtype, device)

    kernels = None
    if device.type != "cpu":
        why["kernels"] = f"torch ops on {device.type}"
    elif not config.cpu_kernels:
        why["kernels"] = "torch ops: --cpu-kernels is off"
    else:
        kernels = cpu_kernels.load(config.cpu_kernels_prebuilt)
        why["kernels"] = "fused CPU kernels" if kernels is not None else "torch ops: the fused CPU kernels did not load"
    int8, why["quantized_matmul"] = choose_quantized_matmul(config.quantized_matmul, dtype, kernels)
    ops = CpuKernelOps(kernels, int8) if kernels is not None else TorchOps()
    if device.type == "cpu" and config.cpu_threads_bind != "off":
        cpu_threads.bind(config.cpu_threads_bind, kernels)

    if device.type == "cpu" and dtype == torch.bfloat16:
        dense, why["dense_matmul"] = ops.dense_packing.name, "bf16 on CPU: weights packed once for the ops' matmul"
    else:
        dense, why["dense_matmul"] = "torch", "F.linear"

    if config.gguf_dequantize:
        keep, why["keep_quantized"] = False, "--gguf-dequantize"
    elif ops.qlinear is None:
        keep, why["keep_quantized"] = False, "no quantized matmul in the ops backend (" + why["kernels"] + ")"
    elif dtype not in (torch.float32, torch.bfloat16):
        keep, why["keep_quantized"] = False, f"the quantized matmul computes in float32 or bfloat16, not {dtype}"
    else:
        keep, why["keep_quantized"] = True, "GGUF quantized blocks kept for the CPU kernels' quantized matmul"

    own_model = loaded is None
    if own_model:
        loaded = load_model(config.model, config.max_model_len, dtype, device, keep_quantized=keep)
    else:
        weight = loaded.model.embed_tokens.weight
        if weight.dtype != dtype or weight.device.type != device.type:
            raise ValueError(f"the model given is {weight.dtype} on {weight.device.type}; this engine's plan "
                             f"is {dtype} on {device.type}")
    # batch-invariant, every batch size takes the quantized matmul (below): the dense copies of
    # those layers are never read, but for the decoder layers' where prompt rows take them (timed
    # on the packed weights, so dropped after, unless the answer is known before packing). A model
    # given by the caller may serve other plans: kept.
    drop = (keep and own_model and config.batch_invariant and config.quantized_max_rows is None
            and loaded.model.has_quantized())
    if keep:
        loaded.model.prepare_quantized(ops)
    # auto's prompt answer where it is known without timing (cached), read before packing: a start
    # whose answer is quantized then packs no dense copies only to free them
    known = (known_prompt_rows_dense(loaded.model, ops, dtype)
             if drop and config.prompt_matmul == "auto" and dense != "torch" else None)
    drop_now = drop and (config.prompt_matmul == "quantized" or dense == "torch"
                         or (known is not None and not known[0]))
    dropped = pack_weights(loaded.model, ops, drop_now)
    if not keep:
        why["quantized_matmul"] = "no quantized blocks kept"

    if not keep:
        rows, why["quantized_max_rows"] = 0, "no quantized blocks kept"
    elif config.quantized_max_rows is not None:
        rows, why["quantized_max_rows"] = config.quantized_max_rows, "set by --quantized-max-rows"
    elif not loaded.model.has_quantized():
        rows, why["quantized_max_rows"] = 0, "the checkpoint has no quantized weights the kernels take"
    elif config.batch_invariant:
        rows, why["quantized_max_rows"] = ALL_ROWS, ("batch-invariant: every batch size on the quantized matmul, "
                                                     "whose rows are computed alike however many run")
    else:
        rows, why["quantized_max_rows"] = crossover_rows(loaded.model, ops, dtype)
    invariant, why["batch_invariant"] = batch_invariance(config, kernels, dense, rows)
    prompt_dense, why["prompt_matmul"] = choose_prompt_matmul(config.prompt_matmul, loaded.model, ops, dtype,
                                                              dense, rows, invariant, known)
    if drop and not drop_now:
        dropped = loaded.model.drop_dense_of_quantized(keep_layers=prompt_dense)
    if drop:
        why["dense_copies"] = (f"dropped for {dropped} quantized layers: batch-invariant, never read"
                               + (" (the decoder layers' kept for prompt rows)" if prompt_dense else ""))

    budget, why["token_budget"] = choose_token_budget(config.max_num_batched_tokens, device)
    stack, why["decoder_stack"] = choose_decoder_stack(config, kernels, rows)
    plan = BackendPlan(device, dtype, kernels, ops, dense, keep, ops.quantized_matmul if keep else "none", rows,
                       invariant, prompt_dense, budget, stack, types.MappingProxyType(why))
    log.info("backend plan", extra=plan.describe())
    return plan, loaded
