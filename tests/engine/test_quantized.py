"""GGUF block-quantized weights used as they are: the CPU kernels' qlinear / qembedding /
qdequantize against gguf-py's reference dequantization (in the build for this CPU and in
the baseline variant), the loader's quantized tensors against transformers' dequantized
state dict, and the engine's greedy output on the quantized path against the dequantized
one and HF's."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tessera_engine import cpu_kernels
from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.models.quantized import QTYPES, QuantizedWeight

from helpers.engine_fixtures import (QUESTIONS, chat_prompts, greedy, hf_greedy, hf_tokenizer, loaded_fp32,  # noqa: F401
                             model_source, requests)

K = cpu_kernels.load()
pytestmark = [pytest.mark.unit, pytest.mark.skipif(K is None, reason="fused CPU kernels could not be built here")]


# the K-quants: ggml type -> bytes of a 256-weight super-block (gguf-py has no quantizer for them)
KQUANTS = {12: 144, 13: 176, 14: 210}


def random_kquant_blocks(n: int, k: int, qtype: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, k / 256 * block bytes]: valid K-quant super-blocks of random bytes (quants,
    packed 6-bit scales and mins, Q6_K's int8 scales), the float16 scale fields set to finite
    values of a weight-like magnitude (d * scale * q up to ~0.1 - 0.5)."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    raw = rng.integers(0, 256, (n, nb, KQUANTS[qtype]), dtype=np.uint8)

    def halves(scale: float, signed: bool = False) -> np.ndarray:
        v = rng.uniform(0.5, 1.5, (n, nb, 1)) * scale
        if signed:
            v *= rng.choice([-1.0, 1.0], (n, nb, 1))
        return v.astype(np.float16).view(np.uint8)

    if qtype == 14:  # Q6_K: ql, qh, 16 int8 scales, then d
        raw[..., 208:210] = halves(1.5e-4, signed=True)
    else:            # Q4_K / Q5_K: d, dmin first
        raw[..., 0:2] = halves(1e-4)
        raw[..., 2:4] = halves(1e-3)
    return raw.reshape(n, -1)


def quantized(n: int, k: int, qtype: int, seed: int = 0):
    """A random [n, k] weight in ggml type `qtype` (quantized by gguf-py; K-quants: random valid
    blocks): (raw bytes as torch uint8, gguf-py's dequantization)."""
    import gguf

    rng = np.random.default_rng(seed)
    if qtype in KQUANTS:
        raw = random_kquant_blocks(n, k, qtype, seed)
    else:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = gguf.quantize(w, gguf.GGMLQuantizationType(qtype))
    ref = gguf.dequantize(raw, gguf.GGMLQuantizationType(qtype)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(ref.reshape(n, k))


def test_qtypes_are_the_kernels_types():
    assert QTYPES == {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


@pytest.mark.parametrize("variant", ["native", "generic"])
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_dequantize_and_embedding_are_bit_exact_with_gguf_py(qtype, variant, generic_kernels):
    kern = K if variant == "native" else generic_kernels
    k = 768 if qtype in KQUANTS else 96  # 3 blocks
    raw, ref = quantized(37, k, qtype)
    assert torch.equal(kern.qdequantize(raw, qtype, k), ref)
    ids = torch.tensor([0, 36, 5, 5])
    for dtype in (torch.float32, torch.bfloat16):
        rows = kern.qembedding(ids, raw, qtype, k, dtype)
        assert rows.dtype == dtype and torch.equal(rows, ref[ids].to(dtype))


@pytest.mark.parametrize("variant", ["native", "generic"])
@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 9])
def test_qlinear_matches_the_dense_matmul_on_the_dequantized_weight(qtype, dtype, m, variant, generic_kernels):
    kern = K if variant == "native" else generic_kernels
    n, k = 70, (512 if qtype in KQUANTS else 160)  # n not a multiple of the kernel's 4 rows, k of 2 / 5 blocks
    raw, ref = quantized(n, k, qtype, seed=qtype + m)
    torch.manual_seed(m)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    # the dense path's weights: the dequantized float32 rounded to the model's dtype
    want = F.linear(x.float(), ref.to(dtype).float(), bias.float())
    got = kern.qlinear(x, raw, qtype, bias)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(kern.qlinear(x, raw, qtype, None).float(), want - bias.float(), **tol)


def test_bad_quantized_inputs_are_clear_errors():
    raw, _ = quantized(8, 64, 3)
    with pytest.raises(RuntimeError, match="bytes a row"):
        K.qlinear(torch.randn(1, 96), raw, 3, None)  # K = 96 does not fit 40-byte rows
    with pytest.raises(RuntimeError, match="unsupported ggml type 10 .*Q4_K=12, Q5_K=13, Q6_K=14"):
        K.qlinear(torch.randn(1, 64), raw, 10, None)  # Q2_K
    with pytest.raises(RuntimeError, match="multiple of 32"):
        K.qdequantize(raw, 3, 48)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        K.qlinear(torch.randn(1, 64).half(), raw, 3, None)
    with pytest.raises(RuntimeError, match="outside"):
        K.qembedding(torch.tensor([8]), raw, 3, 64, torch.float32)


@pytest.mark.parametrize("qtype", sorted(KQUANTS))
def test_bad_kquant_shapes_are_clear_errors(qtype):
    name = QTYPES[qtype]
    raw, _ = quantized(4, 512, qtype)
    for bad_k in (96, 384):  # a multiple of 32, not of 256; a multiple of 32 and 128 only
        with pytest.raises(RuntimeError, match=rf"K must be a multiple of 256 \(the block size of {name}\), got {bad_k}"):
            K.qlinear(torch.randn(1, bad_k), raw, qtype, None)
        with pytest.raises(RuntimeError, match="multiple of 256"):
            K.qdequantize(raw, qtype, bad_k)
        with pytest.raises(RuntimeError, match="multiple of 256"):
            K.qembedding(torch.tensor([0]), raw, qtype, bad_k, torch.float32)
    with pytest.raises(RuntimeError, match=rf"bytes a row do not hold K = 768 weights of ggml type {name}"):
        K.qlinear(torch.randn(1, 768), raw, qtype, None)  # rows of 2 super-blocks, not 3
    with pytest.raises(RuntimeError, match="bytes a row"):
        K.qdequantize(raw[:, :-1].contiguous(), qtype, 512)


def test_concat_keeps_one_type_only():
    a, b = QuantizedWeight(torch.zeros(2, 20, dtype=torch.uint8), 3), QuantizedWeight(torch.ones(3, 20, dtype=torch.uint8), 3)
    fused = QuantizedWeight.concat([a, b])
    assert fused.data.shape == (5, 20) and fused.qtype == 3 and fused.type_name == "Q4_1"
    assert QuantizedWeight.concat([a, None]) is None
    assert QuantizedWeight.concat([a, QuantizedWeight(torch.zeros(2, 18, dtype=torch.uint8), 2)]) is None


def test_concat_widens_q5_0_beside_q8_0_to_the_same_weights():
    """Gemma 3's Q4_K_M file: Q5_0 q / k and a Q8_0 v in one fused QKV. The Q5_0 rows become Q8_0
    blocks that gguf-py dequantizes to the Q5_0 rows' weights bit for bit."""
    q, q_ref = quantized(32, 96, 6, seed=1)
    v, v_ref = quantized(16, 96, 8, seed=2)
    fused = QuantizedWeight.concat([QuantizedWeight(q, 6), QuantizedWeight(v, 8)])
    assert fused.type_name == "Q8_0" and fused.data.shape == (48, 3 * 34)
    assert torch.equal(K.qdequantize(fused.data, 8, 96), torch.cat([q_ref, v_ref]))
    # Q5_0 beside another type stays unfused
    assert QuantizedWeight.concat([QuantizedWeight(q, 6), QuantizedWeight(torch.zeros(2, 60, dtype=torch.uint8), 3)]) is None


@pytest.mark.slow
def test_the_default_models_quantized_tensors_are_its_dense_weights(model_source):
    """Every Q4_1 / Q8_0 tensor of the default GGUF, read as bytes (q/k rows permuted as
    transformers does), dequantizes bit for bit to transformers' dequantized state dict."""
    from tessera_engine.models.loader import load_hf_config, open_gguf
    from tessera_engine.models.quantized import read_gguf_dequantized, read_gguf_quantized

    reader = open_gguf(model_source)
    cfg = load_hf_config(model_source, reader)
    q = read_gguf_quantized(reader, cfg)
    dense = dict(read_gguf_dequantized(reader, cfg))
    assert len(q) == 7 * cfg.num_hidden_layers + 1  # every linear layer and the tied embedding
    assert {w.type_name for w in q.values()} == {"Q4_1", "Q8_0"}
    for name, w in q.items():
        assert torch.equal(K.qdequantize(w.data, w.qtype, dense[name].shape[1]), dense[name]), name


@pytest.mark.slow
def test_the_loader_reads_one_tensor_at_a_time_what_transformers_reads_at_once(model_source):
    """The engine's GGUF reader streams the tensors transformers' own reader returns in one
    dict (load_gguf_checkpoint): the same names, bit for bit."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tessera_engine.models.loader import load_hf_config, open_gguf
    from tessera_engine.models.quantized import read_gguf_dequantized

    cfg = load_hf_config(model_source)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    ref = load_gguf_checkpoint(str(model_source.path), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = dict(read_gguf_dequantized(open_gguf(model_source), cfg))
    assert ours.keys() == ref.keys() and len(ours) > 200
    for name, w in ref.items():
        assert ours[name].dtype == w.dtype and torch.equal(ours[name], w), name


def test_engine_uses_the_quantized_weights_by_default_and_logs_it(loaded_fp32, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="tessera_engine.model_runner"):
        core = EngineCore(EngineConfig(dtype="float32", device="cpu", kv_cache_gib=0.1), loaded=loaded_fp32)
    record = next(r for r in caplog.records if r.getMessage() == "linear layers")
    # fp32: the quantized matmul reads a fraction of the dense bytes, ahead at one row at least
    assert record.paths == {"Q4_1": 4 * 30, "Q8_0": 1} and record.quantized_max_rows >= 1
    layer = loaded_fp32.model.layers[0].mlp.down_proj
    assert layer.qlinear is not None and layer.qweight.type_name == "Q4_1"
    del core
    with caplog.at_level(logging.INFO, logger="tessera_engine.model_runner"):
        EngineCore(EngineConfig(dtype="float32", device="cpu", kv_cache_gib=0.1, gguf_dequantize=True),
                   loaded=loaded_fp32)
    record = [r for r in caplog.records if r.getMessage() == "linear layers"][-1]
    assert record.paths == {"dense": 4 * 30 + 1} and layer.qlinear is None


def test_quantized_and_dequantized_paths_agree_token_for_token(loaded_fp32, chat_prompts, hf_greedy):
    """fp32, greedy: the quantized matmul (same weights, another summation order) gives the
    dequantized path's tokens, and HF's, on the HF-equality prompts, one at a time and batched."""
    def run(dequantize: bool, prompts):
        core = EngineCore(EngineConfig(dtype="float32", device="cpu", kv_cache_gib=0.25,
                                       gguf_dequantize=dequantize), loaded=loaded_fp32)
        return core.generate(requests(prompts, greedy(24)))

    prompts = chat_prompts[:8]
    quant, dense = run(False, prompts), run(True, prompts)
    for i, p in enumerate(prompts):
        assert quant[(f"r{i}", 0)] == dense[(f"r{i}", 0)] == hf_greedy(p, 24), f"prompt {i}"
    single = run(False, prompts[:1])
    assert single[("r0", 0)] == dense[("r0", 0)]


def test_gguf_dequantize_and_quantized_max_rows_flags_and_env(monkeypatch):
    from tessera_engine.server import config_from_args, parse_args

    monkeypatch.delenv("TESSERA_GGUF_DEQUANTIZE", raising=False)
    assert config_from_args(parse_args([])).gguf_dequantize is False
    assert config_from_args(parse_args(["--gguf-dequantize", "true"])).gguf_dequantize is True
    monkeypatch.setenv("TESSERA_GGUF_DEQUANTIZE", "1")
    assert config_from_args(parse_args([])).gguf_dequantize is True
    monkeypatch.delenv("TESSERA_QUANTIZED_MAX_ROWS", raising=False)
    assert config_from_args(parse_args([])).quantized_max_rows is None  # timed at start
    assert config_from_args(parse_args(["--quantized-max-rows", "0"])).quantized_max_rows == 0
    monkeypatch.setenv("TESSERA_QUANTIZED_MAX_ROWS", "7")
    assert config_from_args(parse_args([])).quantized_max_rows == 7


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN's packed bf16 matmul")
def test_bf16_layers_keep_one_dense_copy_and_generate_the_same():
    """Once an engine is built, each bf16 linear layer holds its oneDNN-packed weight only
    (the plain copy is freed); a second engine on the same model still runs and agrees."""
    from helpers.engine_fixtures import tiny_hf_llama, tiny_loaded
    from tessera_engine.request import EngineCoreRequest
    from tessera_engine.sampling_params import SamplingParams

    cfg, hf = tiny_hf_llama(num_layers=2)
    loaded = tiny_loaded(cfg, hf, torch.bfloat16)
    before = loaded.model.layers[0].mlp.down_proj.weight.numel()

    def run():
        core = EngineCore(EngineConfig(dtype="bfloat16", device="cpu", num_kv_blocks=64), loaded=loaded)
        reqs = [EngineCoreRequest(f"r{i}", [1 + i, 7, 9, 3], SamplingParams(temperature=0.0, max_tokens=8,
                                                                           ignore_eos=True)) for i in range(3)]
        return core.generate(reqs)

    first = run()
    down = loaded.model.layers[0].mlp.down_proj
    assert before > 0 and down.weight.numel() == 0 and down._pw.frozen
    assert run() == first and all(len(t) == 8 for t in first.values())
