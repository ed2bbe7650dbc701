"""A Llama of real 1B shapes with random weights, for measuring at the sizes people run (issue 33,
item 6): Llama-3.2-1B's hidden 2048, 16 layers, 32 query / 8 KV heads of 64, intermediate 8192,
vocab 128256, tied embeddings (plain rotary, theta 500000: the scaling changes no shape).

Written once under the benchmark cache (<TESSERA_BENCH_CACHE>/random-llama-1b/):
  hf/                 config.json, model.safetensors (bfloat16), tokenizer.json + tokenizer_config.json
                      (for vLLM)
  model-<TYPE>.gguf   the same weights as GGUF Q4_0, Q8_0 and BF16, written with gguf-py (for
                      llama.cpp and tessera), llama.cpp's q/k row order
The tokenizer is the default model's (SmolLM2's byte-level BPE, its chat template), padded to
128256 entries with plain tokens "tok<i>" (added tokens in the HF file, normal tokens in the
GGUF), so the three servers share token ids, chat template and vocab size. Random weights make
random text; ignore_eos keeps every answer its full length.

    python benchmarks/peers/random_llama.py [OUT]
"""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import time

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from peers import cache_dir, log  # noqa: E402

NAME = "random-llama-1b"
READY_STAMP = ".tessera-bench-ready"
TYPES = ("Q4_0", "Q8_0", "BF16")
SHAPES = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
              head_dim=64, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
              max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True)


def default_dir() -> pathlib.Path:
    return cache_dir() / NAME


def ensure_random_llama(out: pathlib.Path | None = None) -> dict:
    """{"hf": dir, "Q4_0": gguf, ...}, written first where they are not there yet."""
    out = out or default_dir()
    paths = {"hf": str(out / "hf"), **{t: str(out / f"model-{t}.gguf") for t in TYPES}}
    if not (out / READY_STAMP).exists():
        log(f"writing a random Llama of 1B shapes to {out} (once, a few minutes) ...")
        t = time.perf_counter()
        subprocess.run([sys.executable, __file__, str(out)], check=True)
        log(f"  written in {time.perf_counter() - t:.0f} s")
    return paths


def _padded_tokenizer(out: pathlib.Path):
    """The default model's tokenizer, padded with "tok<i>" tokens to the vocab size, saved in out."""
    from transformers import AutoTokenizer

    from tessera.common.model_source import resolve_model

    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    base = len(tok)
    tok.add_tokens([f"tok{i}" for i in range(SHAPES["vocab_size"] - base)])
    assert len(tok) == SHAPES["vocab_size"], len(tok)
    tok.save_pretrained(out)
    return tok, base


def _weights(seed: int = 0):
    """HF name -> float32 numpy array, one at a time (std 0.02 as HF initializes Llama; norms 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    h, inter, kv = SHAPES["hidden_size"], SHAPES["intermediate_size"], SHAPES["num_key_value_heads"] * SHAPES["head_dim"]
    q = SHAPES["num_attention_heads"] * SHAPES["head_dim"]

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    yield "model.embed_tokens.weight", rand(SHAPES["vocab_size"], h)
    for i in range(SHAPES["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", np.ones(h, np.float32)
        yield p + "self_attn.q_proj.weight", rand(q, h)
        yield p + "self_attn.k_proj.weight", rand(kv, h)
        yield p + "self_attn.v_proj.weight", rand(kv, h)
        yield p + "self_attn.o_proj.weight", rand(h, q)
        yield p + "post_attention_layernorm.weight", np.ones(h, np.float32)
        yield p + "mlp.gate_proj.weight", rand(inter, h)
        yield p + "mlp.up_proj.weight", rand(inter, h)
        yield p + "mlp.down_proj.weight", rand(h, inter)
    yield "model.norm.weight", np.ones(h, np.float32)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    parts = hf.split(".")  # model.layers.<i>.<module>[.<proj>].weight
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{GGUF_NAMES[module]}.weight"


def _permute(w, heads: int):
    """llama.cpp's q/k row order (convert_hf_to_gguf's permute): each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(out: pathlib.Path) -> None:
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "hf").mkdir(parents=True)
    _, base_vocab = _padded_tokenizer(tmp / "hf")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
              "dtype": "bfloat16", "initializer_range": 0.02, **SHAPES}
    (tmp / "hf" / "config.json").write_text(json.dumps(config, indent=1))

    from tessera.common.model_source import resolve_model

    src_reader = gguf.GGUFReader(str(resolve_model(None).path))
    writers = {}
    for t in TYPES:
        w = gguf.GGUFWriter(str(tmp / f"model-{t}.gguf"), "llama")
        w.add_name(f"random-llama-1b-{t}")
        w.add_context_length(SHAPES["max_position_embeddings"])
        w.add_embedding_length(SHAPES["hidden_size"])
        w.add_block_count(SHAPES["num_hidden_layers"])
        w.add_feed_forward_length(SHAPES["intermediate_size"])
        w.add_head_count(SHAPES["num_attention_heads"])
        w.add_head_count_kv(SHAPES["num_key_value_heads"])
        w.add_rope_dimension_count(SHAPES["head_dim"])
        w.add_rope_freq_base(SHAPES["rope_theta"])
        w.add_layer_norm_rms_eps(SHAPES["rms_norm_eps"])
        w.add_vocab_size(SHAPES["vocab_size"])
        w.add_file_type(int({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                             "BF16": gguf.LlamaFileType.MOSTLY_BF16}[t]))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _copy_tokenizer(src_reader, w, base_vocab)
        writers[t] = w

    state = {}
    heads = {"attn_q": SHAPES["num_attention_heads"], "attn_k": SHAPES["num_key_value_heads"]}
    for name, arr in _weights():
        state[name] = torch.from_numpy(arr).to(torch.bfloat16)
        gname = _gguf_name(name)
        kind = gname.split(".")[-2]
        garr = _permute(arr, heads[kind]) if kind in heads else arr
        for t, w in writers.items():
            if arr.ndim == 1:  # norms stay float32, as llama.cpp writes them
                w.add_tensor(gname, garr)
                continue
            qtype = getattr(gguf.GGMLQuantizationType, t)
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(garr), qtype), raw_dtype=qtype)
        log(f"  {name}")
    save_file(state, str(tmp / "hf" / "model.safetensors"), metadata={"format": "pt"})
    del state
    for w in writers.values():
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    (tmp / READY_STAMP).write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _copy_tokenizer(reader, w, base_vocab: int) -> None:
    """The default GGUF's tokenizer fields, its token list padded with "tok<i>" to the vocab size."""
    import gguf

    fields = reader.fields

    def strings(key):
        f = fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def ints(key):
        f = fields[key]
        return [int(f.parts[i][0]) for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    assert len(tokens) == base_vocab, (len(tokens), base_vocab)
    pad = SHAPES["vocab_size"] - len(tokens)
    w.add_tokenizer_model(bytes(fields["tokenizer.ggml.model"].parts[-1]).decode())
    if "tokenizer.ggml.pre" in fields:
        w.add_tokenizer_pre(bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode())
    w.add_token_list(tokens + [f"tok{i}" for i in range(pad)])
    w.add_token_types(ints("tokenizer.ggml.token_type") + [int(gguf.TokenType.NORMAL)] * pad)
    w.add_token_merges(strings("tokenizer.ggml.merges"))
    for key, add in (("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
                     ("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
                     ("tokenizer.ggml.padding_token_id", w.add_pad_token_id),
                     ("tokenizer.ggml.unknown_token_id", w.add_unk_token_id)):
        if key in fields:
            add(int(fields[key].parts[-1][0]))
    if "tokenizer.chat_template" in fields:
        w.add_chat_template(bytes(fields["tokenizer.chat_template"].parts[-1]).decode())


if __name__ == "__main__":
    write(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else default_dir())
