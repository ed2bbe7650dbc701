"""Shared helpers for tessera's benchmarks (not tests): prompts, engine flags, memory and CPU
accounting, quiet-machine waits, the environment record, report formatting, and a per-phase
step-time breakdown of the engine core. Statistics (median, percentile, summarize) are
`tessera bench`'s: tessera.bench.metrics.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import platform
import random
import resource
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from tessera.common.cpu_load import system_busy_s

# 64 distinct, realistic chat questions of varied length (a few words to a
# paragraph), so prompts span roughly 35 to 150 tokens after the chat template.
QUESTIONS: list[str] = [
    "What is photosynthesis?",
    "How do vaccines train the immune system?",
    "Why is the sky blue during the day but red at sunset?",
    "Explain the difference between a list and a tuple in Python.",
    "What are the main causes of inflation?",
    "Give me three tips for improving my sleep.",
    "How does a refrigerator keep food cold?",
    "What is the Pythagorean theorem and where is it used in everyday life?",
    "Write a short poem about the ocean.",
    "Can you summarize the plot of Romeo and Juliet?",
    "What is the difference between weather and climate?",
    "How do I make a simple tomato sauce from scratch?",
    "What does a CPU cache do, and why does it make programs faster?",
    "Why do cats purr?",
    "Explain recursion to a ten-year-old.",
    "What were the main consequences of the printing press in Europe?",
    "How does compound interest work? Please include a small numeric example.",
    "What is the capital of Australia, and why isn't it Sydney?",
    "List some good habits for learning a new language.",
    "How do airplanes stay in the air?",
    "What is machine learning?",
    "I have a job interview tomorrow for a junior data analyst role at a retail company. "
    "What kinds of questions should I expect, and how should I prepare tonight?",
    "Explain how HTTPS keeps my connection to a website private.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a weekend itinerary for a first visit to Rome.",
    "How does a bill become a law in the United States?",
    "What is the greenhouse effect?",
    "Why do we have leap years?",
    "Describe the water cycle in a few sentences.",
    "My tomato plants have yellow leaves at the bottom and some brown spots. "
    "I water them every evening and they get about six hours of sun. What could be wrong?",
    "What is a black hole?",
    "How can I be more productive when working from home?",
    "Explain the rules of chess briefly.",
    "What is the difference between RAM and storage?",
    "Translate 'Where is the train station?' into French and Spanish.",
    "Why is exercise good for mental health?",
    "What is the theory of evolution by natural selection?",
    "Write a polite email asking my manager for a day off next Friday.",
    "How do noise-cancelling headphones work?",
    "What causes earthquakes?",
    "Give me a recipe for pancakes.",
    "What is the role of mitochondria in a cell?",
    "How should I start investing if I only have a small amount of money each month?",
    "Explain what an API is with an analogy.",
    "What are the benefits and drawbacks of electric cars compared with petrol cars?",
    "Who was Ada Lovelace?",
    "How do I center a div in CSS?",
    "What is the difference between affect and effect?",
    "Why do leaves change color in autumn?",
    "Explain supply and demand.",
    "I'm planning a birthday party for my eight-year-old daughter with about twelve kids. "
    "We have a small backyard and a budget of around 150 dollars. Can you suggest a theme, "
    "a few games, and a simple schedule for a three-hour afternoon party?",
    "What is a prime number? Give a few examples.",
    "How does GPS know where I am?",
    "What is the Big Bang theory?",
    "How can I reduce my household's plastic waste?",
    "Explain the difference between TCP and UDP.",
    "What is stoicism?",
    "Why does ice float on water?",
    "How do I write a good cover letter?",
    "What happened during the French Revolution?",
    "Explain what a neural network is in simple terms.",
    "What are some healthy snacks for studying late at night?",
    "How does the moon affect ocean tides?",
    "Compare the advantages of renting versus buying a home for a young couple "
    "who might move to another city within five years.",
]

# Prefixes that make further copies of the questions distinct (scale scenarios
# with more than 64 requests), so the prefix cache only shares the chat template.
STYLES: list[str] = ["", "Answer briefly: ", "Explain step by step: ", "In plain language, "]

assert len(QUESTIONS) == 64 and len(set(QUESTIONS)) == 64


def add_engine_flags(ap) -> None:
    """The engine settings every benchmark takes (the same on each side it compares)."""
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, = cores)")
    ap.add_argument("--gguf-dequantize", action="store_true",
                    help="GGUF: dense weights only (default: Q4_0/Q4_1/Q8_0 weights kept for small batches)")


def engine_config(args, **overrides):
    """The EngineConfig of add_engine_flags' flags (plus --model / --dtype, which every benchmark has)."""
    from tessera_engine.config import EngineConfig

    return EngineConfig(**{"model": args.model, "dtype": args.dtype, "kv_cache_gib": args.kv_cache_gib,
                           "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                           "block_size": args.block_size, "enable_prefix_caching": not args.no_prefix_caching,
                           "num_threads": args.threads, "gguf_dequantize": args.gguf_dequantize,
                           **overrides})


def questions(n: int) -> list[str]:
    """n distinct user messages: the 64 questions, then styled copies, then numbered ones."""
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        style = STYLES[(i // len(QUESTIONS)) % len(STYLES)]
        lap = i // (len(QUESTIONS) * len(STYLES))
        text = style + (q[0].lower() + q[1:] if style else q)
        out.append(f"(variant {lap}) {text}" if lap else text)
    return out


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """Token ids of n distinct chat prompts (user turn + generation prompt)."""
    prompts = []
    for q in questions(n):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                            add_generation_prompt=True, return_dict=False)
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        prompts.append([int(t) for t in ids])
    return prompts


def draw_lengths(n: int, low: int, high: int, seed: int) -> list[int]:
    """Output lengths drawn uniformly from [low, high] (inclusive) with a fixed seed."""
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def log(msg: str) -> None:
    """Progress lines go to stderr; stdout holds the report."""
    print(msg, file=sys.stderr, flush=True)


# -- memory and CPU ---------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _this_process():
    """psutil's handle of this process, made once: building one reads /proc several times,
    which a 50 Hz sampler would pay on every sample."""
    import psutil

    return psutil.Process()


def _rss_bytes() -> int:
    try:
        return _this_process().memory_info().rss
    except ImportError:  # Linux fallback
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss_mib() -> float:
    """Peak RSS of this process since it started (getrusage; KiB on Linux)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1 << 20) if sys.platform == "darwin" else r / 1024


@dataclasses.dataclass
class Usage:
    wall_s: float = 0.0
    peak_rss_mib: float = 0.0      # highest sampled RSS of this process during the block
    start_rss_mib: float = 0.0
    cpu_s: float = 0.0             # CPU time of this process during the block
    foreign_cpu_s: float | None = None  # CPU time of everything else on the machine
    loadavg_1m: float = 0.0

    @property
    def foreign_cores(self) -> float | None:
        """Average number of cores other processes kept busy (noise indicator)."""
        if self.foreign_cpu_s is None or self.wall_s <= 0:
            return None
        return max(0.0, self.foreign_cpu_s) / self.wall_s

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["foreign_cores"] = self.foreign_cores
        return d


@contextlib.contextmanager
def measure_usage(interval_s: float = 0.02, sample_rss: bool = True):
    """Samples this process's RSS on a background thread and counts CPU time.

    Yields a Usage that is filled in when the block exits. With sample_rss=False no thread
    runs (peak_rss_mib is then only the larger of the RSS at entry and at exit): for
    benchmarks that do not report memory, where a 50 Hz thread would only be noise.
    """
    usage = Usage(loadavg_1m=os.getloadavg()[0])
    usage.start_rss_mib = usage.peak_rss_mib = _rss_bytes() / (1 << 20)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            usage.peak_rss_mib = max(usage.peak_rss_mib, _rss_bytes() / (1 << 20))

    thread = threading.Thread(target=sample, name="rss-sampler", daemon=True) if sample_rss else None
    sys_busy0 = system_busy_s()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if thread is not None:
        thread.start()
    try:
        yield usage
    finally:
        usage.wall_s = time.perf_counter() - t0
        stop.set()
        if thread is not None:
            thread.join()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        usage.cpu_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        sys_busy1 = system_busy_s()
        if sys_busy0 is not None and sys_busy1 is not None:
            usage.foreign_cpu_s = (sys_busy1 - sys_busy0) - usage.cpu_s
        usage.peak_rss_mib = max(usage.peak_rss_mib, _rss_bytes() / (1 << 20))


async def engine_session(addr: str, requests: Sequence, sent: list[float] | None = None,
                         channel_options: Sequence = ()):
    """Requests (tessera.v1 EngineRequests) on one Session stream straight to an engine service
    (no frontend, no tokenizer), all put on it at once as a frontend puts a burst (all but the
    last say more are coming; `sent` gets the time of each). Yields (arrival time,
    EngineStepOutputs) until every request has finished, then closes the stream."""
    import asyncio

    import grpc

    from tessera.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    async with grpc.aio.insecure_channel(addr, options=list(channel_options)) as channel:
        outbox: asyncio.Queue = asyncio.Queue()

        async def inputs():
            while (message := await outbox.get()) is not None:
                yield message

        call = engine_pb2_grpc.EngineServiceStub(channel).Session(inputs())
        try:
            for i, request in enumerate(requests):
                outbox.put_nowait(engine_pb2.SessionInput(add=[request], more_coming=i < len(requests) - 1))
                if sent is not None:
                    sent.append(time.perf_counter())
            live = {r.request_id for r in requests}
            async for step in call:
                yield time.perf_counter(), step
                live.difference_update(o.request_id for o in step.outputs
                                       if o.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED)
                if not live:
                    break
        finally:
            outbox.put_nowait(None)
            call.cancel()


def foreign_load(window_s: float = 1.0) -> float | None:
    """Cores kept busy by other processes over the next window_s seconds (call while idle)."""
    busy0 = system_busy_s()
    if busy0 is None:
        return None
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(window_s)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    own = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return max(0.0, system_busy_s() - busy0 - own) / window_s


def add_run_flags(ap, results_name: str, startup_timeout_s: float = 900.0) -> None:
    """The flags every benchmark that starts servers takes: --wait-quiet, --startup-timeout and
    --out (default results/<results_name>.json)."""
    ap.add_argument("--wait-quiet", type=float, default=20.0,
                    help="before each measurement wait up to this many seconds for other processes to use "
                         "< 0.3 cores (0 = never wait)")
    ap.add_argument("--startup-timeout", type=float, default=startup_timeout_s,
                    help=f"seconds a server may take to start (default {startup_timeout_s:g})")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "results", f"{results_name}.json"))


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.3, log: Callable[[str], None] | None = None) -> float:
    """Wait (at most max_wait_s) until other processes use under threshold_cores; returns seconds waited.

    Shared machines: another job's threads on our cores make torch's OpenMP barriers spin
    and can slow a measurement several-fold, so measurements are best started in a quiet spell.
    """
    if max_wait_s <= 0:
        return 0.0
    t0 = time.perf_counter()
    warned = False
    while True:
        load = foreign_load(0.5)
        if load is None or load < threshold_cores:
            return time.perf_counter() - t0
        waited = time.perf_counter() - t0
        if waited >= max_wait_s:
            if log:
                log(f"  machine still busy ({load:.2f} foreign cores) after {waited:.0f} s; measuring anyway")
            return waited
        if log and not warned:
            log(f"  other processes use {load:.2f} cores; waiting up to {max_wait_s:.0f} s for a quiet spell")
            warned = True


# -- environment ---------------------------------------------------------------------
def environment(packages: Sequence[str] = ("torch", "transformers")) -> dict:
    """What a result was measured on: Python, the given packages' versions (and torch's thread
    count when torch is one), the CPU, the git commit (`-dirty` with uncommitted changes), load, time."""
    cpu = platform.processor() or ""
    fields: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
        cpu = fields.get("model name", cpu)
    except OSError:
        pass
    # A VM may name only the vendor ("AMD EPYC"): the family and model tell Zen 4 (25 / 17) from
    # Zen 5 (26 / ...), and the flags what the kernels can use
    flags = set(fields.get("flags", "").split())
    cpu_id = {"cpu_family": fields.get("cpu family"), "cpu_model": fields.get("model"),
              "cpu_flags": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx_vnni")))}
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=here, timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=5, cwd=here).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    info: dict = {"python": platform.python_version()}
    for name in packages:
        info[name] = importlib.import_module(name).__version__
    if "torch" in packages:
        info["torch_threads"] = importlib.import_module("torch").get_num_threads()
    return info | {
        "cpu_count": os.cpu_count(),
        "cpu": cpu,
        **cpu_id,
        "platform": platform.platform(),
        "git_commit": commit + ("-dirty" if dirty else ""),
        "loadavg": list(os.getloadavg()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# -- report formatting -------------------------------------------------------------------
def fmt(x, spec: str, scale: float = 1.0) -> str:
    """format(x * scale, spec), or "-" for a missing (None or NaN) figure."""
    return "-" if x is None or x != x else format(x * scale, spec)


def format_table(header: Sequence[str], rows: Sequence[Sequence], rule_per_column: bool = False) -> list[str]:
    """A text table: the first column left-aligned, the others right-aligned, a rule under the header
    (one dash run across the whole line, or one per column with rule_per_column)."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    head = line(cells[0])
    rule = line(["-" * w for w in widths]) if rule_per_column else "-" * len(head)
    return [head, rule, *(line(r) for r in cells[1:])]


# -- step-time breakdown of the engine (profiling aid) --------------------------------
class StepBreakdown:
    """Wall-clock time per engine phase, by wrapping methods of live objects.

    Wraps (on the instances / classes given, restored by `restore()`):
    scheduler.schedule, runner._prepare, model.forward, PagedAttention.forward
    (inside the model), model.compute_logits, sampler.__call__,
    scheduler.update_after_step and EngineCore.step as the total. Nested phases
    are reported exclusive of their children (the model's time excludes attention).
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []
        self._stack: list[list[float]] = []

    def _wrap(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        is_class = isinstance(owner, type)
        breakdown = self

        def timed(*args, **kwargs):
            breakdown._stack.append([0.0])
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                child = breakdown._stack.pop()[0]
                breakdown.totals[name] = breakdown.totals.get(name, 0.0) + dt - child
                breakdown.counts[name] = breakdown.counts.get(name, 0) + 1
                if breakdown._stack:
                    breakdown._stack[-1][0] += dt

        if is_class:
            setattr(owner, attr, timed)
            self._undo.append(lambda: setattr(owner, attr, original))
        else:
            owner.__dict__[attr] = timed
            self._undo.append(lambda: owner.__dict__.pop(attr, None))

    def attach(self, core) -> "StepBreakdown":
        runner = core.executor.runner
        self._wrap(core, "run_step", "total_step")
        self._wrap(core.scheduler, "schedule", "scheduler.schedule")
        self._wrap(core.scheduler, "update_from_output", "scheduler.update_from_output")
        self._wrap(runner, "_prepare", "runner._prepare (inputs, slots, masks)")
        self._wrap(runner.model, "forward", "model forward excl. attention (matmuls, norms, rope)")
        self._wrap(type(runner.attention), "forward", "attention (gather, SDPA / decode kernel)")
        self._wrap(runner.model, "compute_logits", "lm_head (compute_logits)")
        self._wrap(type(runner.sampler), "__call__", "sampler")  # special method: class level
        return self

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def report(self) -> dict:
        total = self.totals.get("total_step", 0.0)
        # total_step's exclusive time is what no wrapped phase covers (output building, dict work)
        rows = {k: v for k, v in self.totals.items() if k != "total_step"}
        rows["other (outputs, runner bookkeeping)"] = total
        whole = sum(rows.values())
        return {
            "steps": self.counts.get("total_step", 0),
            "total_s": whole,
            "phases": {k: {"seconds": v, "share": v / whole if whole else 0.0}
                       for k, v in sorted(rows.items(), key=lambda kv: -kv[1])},
        }
