#!/usr/bin/env python
"""What structured output costs: the 64 x 128 chat workload free, against the same
workload with half its requests constrained to a JSON schema, in one run.

A benchmark, not a test. The in-process engine core at its defaults (bf16 on a CPU with
native bf16), the default model, greedy. Runs alternate (free, mixed, free, mixed, ...)
over --rounds; medians are quoted. Every request makes 128 tokens in both runs: the free
ones with ignore_eos, the constrained ones because the schema's `biography` needs more
than 128 tokens to finish, so both runs produce the same number of tokens and the cost
is the mask (built per constrained row each step, applied in the sampler) and the grammar
advancing. Each constrained output is checked to be a valid prefix of the schema's JSON.

The last line printed is `structured_cost=<fraction>`: 1 - mixed tok/s / free tok/s.

  python benchmarks/structured_output.py              # 3 rounds
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings

os.environ.setdefault("TQDM_DISABLE", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import chat_prompts, log, wait_for_quiet  # noqa: E402

from tessera.bench.metrics import median  # noqa: E402
from tessera.common.constraints import StructuredOutputSpec  # noqa: E402
from tessera.common.model_source import resolve_model  # noqa: E402
from tessera_engine.config import EngineConfig  # noqa: E402
from tessera_engine.core import EngineCore  # noqa: E402
from tessera_engine.request import EngineCoreRequest  # noqa: E402
from tessera_engine.sampling_params import SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"type": "string", "enum": ["student", "teacher", "engineer", "artist"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 4},
        "biography": {"type": "string", "minLength": 2000},
    },
    "required": ["name", "age", "role", "skills", "biography"],
    "additionalProperties": False,
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="free/mixed pairs, alternating")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--wait-quiet", type=float, default=20.0, help="wait up to this long for an idle machine")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("tessera_engine").setLevel(logging.WARNING)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    prompts = chat_prompts(tok, args.num_prompts)
    core = EngineCore(EngineConfig())
    core.warm_up()
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))

    def workload(tag: str, constrained: bool) -> list[EngineCoreRequest]:
        reqs = []
        for i, p in enumerate(prompts):
            if constrained and i % 2:
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured=spec)
            else:
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            reqs.append(EngineCoreRequest(f"{tag}{i}", p, params))
        return reqs

    def run(tag: str, constrained: bool) -> float:
        reqs = workload(tag, constrained)
        t = time.perf_counter()
        out = core.generate(reqs)
        dt = time.perf_counter() - t
        n = sum(len(v) for v in out.values())
        if n != args.num_prompts * args.max_tokens:
            raise SystemExit(f"{tag}: {n} tokens, expected {args.num_prompts * args.max_tokens}")
        if constrained:
            for key, toks in out.items():
                if int(key.request_id[len(tag):]) % 2:
                    text = tok.decode(toks, skip_special_tokens=True)
                    if not text.startswith('{"name":') and not text.lstrip().startswith("{"):
                        raise SystemExit(f"{key.request_id}: not the schema's JSON: {text[:80]!r}")
        return n / dt

    run("warm", True)  # compiles the schema (cached by constraint) and the tokenizer wrapper
    free, mixed = [], []
    for r in range(args.rounds):
        wait_for_quiet(args.wait_quiet, 0.3, log)
        free.append(run(f"f{r}-", False))
        wait_for_quiet(args.wait_quiet, 0.3, log)
        mixed.append(run(f"m{r}-", True))
        log(f"round {r}: free {free[-1]:.1f} tok/s, half constrained {mixed[-1]:.1f} tok/s")
    f, m = median(free), median(mixed)
    print(f"free      {', '.join(f'{x:.1f}' for x in free)} tok/s (median {f:.1f})")
    print(f"mixed     {', '.join(f'{x:.1f}' for x in mixed)} tok/s (median {m:.1f}); "
          f"{args.num_prompts // 2} of {args.num_prompts} requests JSON-schema constrained")
    print(f"structured_cost={1 - m / f:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
