"""Up to how many rows the quantized matmul beats the dense one, and which is faster on a prompt
chunk, timed on the loaded model.

At one row a matmul is a pass over its weights, and the quantized one reads a fraction of the
bytes; as rows grow the dense matmul's better arithmetic wins. Where they cross depends on the
CPU (its memory bandwidth, AVX-512 / AMX), the thread count, the dtype and the weights' types
and shapes, so it is measured, over every layer that has quantized blocks (the real weights,
in order, so that caches behave as in a step), at a few batch sizes found by bisection; a prompt
chunk (prompt_rows_dense) at PROMPT_ROWS rows, over the decoder layers. The answers are cached
per CPU (cpu_identity: more than its name, which a VM may leave vague), threads, dtype, packing
and weight shapes, so an engine pays for the timing once per machine and model (the cache:
$TESSERA_CACHE_DIR, else $XDG_CACHE_HOME/tessera or ~/.cache/tessera).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import platform
import statistics
import time

import torch

from tessera.common.cpu_load import system_busy_s

log = logging.getLogger(__name__)

CANDIDATE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# a prompt chunk, for timing the prompt rows' path (prompt_rows_dense): a burst's chunks of
# the CPU token budget (512) hold a few prompts each; a lone chat prompt is tens of rows
PROMPT_ROWS = 256
REPEATS = 7
MIN_REPEATS = 3
REPEAT_BUDGET_S = 0.3  # past MIN_REPEATS, no more repeats once a row count has taken this long
ATTEMPTS = 3  # timings on a busy machine are taken again, up to this many times in all
CACHE_FILE = "quantized_max_rows.json"
# other processes' CPU use during the timing, in cores, past which the answer is used for this
# start but not cached: timings on a busy machine say little about an idle one
QUIET_CORES = 0.3
_measured: dict[str, int] = {}  # this process's answers, busy or not (engines built over one model)


@functools.lru_cache(maxsize=None)  # the CPU does not change under a process: read once
def cpu_identity(cpuinfo: str | None = None, cache_sizes: str | None = None) -> str:
    """This CPU as the cache knows it: its name and, since a VM may name only the vendor ("Intel(R)
    Xeon(R) Processor", "AMD EPYC") over hosts of several generations, its family / model /
    stepping, cache sizes and a digest of its flags, so that a disk or image moved to another
    kind of host times anew. `cpuinfo` and `cache_sizes` stand in for /proc/cpuinfo and sysfs."""
    if cpuinfo is None:
        lines = []
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                for line in f:  # the first CPU's block only (a large host lists hundreds)
                    if not line.strip():
                        break
                    lines.append(line)
        except OSError:
            pass
        cpuinfo = "".join(lines)
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    family = "/".join(fields.get(k, "?") for k in ("cpu family", "model", "stepping"))
    flags = hashlib.sha1(" ".join(sorted(fields.get("flags", "").split())).encode()).hexdigest()[:8]
    return f"{name}|{family}|{_cache_sizes() if cache_sizes is None else cache_sizes}|flags={flags}"


def _cache_sizes(base: str = "/sys/devices/system/cpu/cpu0/cache") -> str:
    """The first CPU's L2 and L3 sizes ("L2=2048K,L3=107520K"; "" where sysfs does not say)."""
    sizes = {}
    for index in sorted(pathlib.Path(base).glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if level in ("2", "3"):
            sizes[f"L{level}"] = size
    return ",".join(f"{k}={v}" for k, v in sorted(sizes.items()))


def cache_path() -> pathlib.Path:
    base = os.environ.get("TESSERA_CACHE_DIR")
    if base:
        return pathlib.Path(base) / CACHE_FILE
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(xdg) / "tessera" / CACHE_FILE


def _build_id(kernels) -> str:
    """Which build of the kernels (a rebuild or another variant times anew)."""
    path = getattr(kernels, "__file__", None)
    try:
        st = os.stat(path)
    except (OSError, TypeError):
        return "none"
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def cache_key(pairs, dtype: torch.dtype, packing: str, kernels=None) -> str:
    shapes = sorted(p.signature for p in pairs)
    digest = hashlib.sha1(repr((shapes, _build_id(kernels))).encode()).hexdigest()[:16]
    return f"{cpu_identity()}|threads={torch.get_num_threads()}|{str(dtype).removeprefix('torch.')}|{packing}|{digest}"


def _read_cache() -> dict:
    try:
        table = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _write_cache(key: str, entry: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = _read_cache()
        table[key] = entry
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:  # a read-only home: measured again next start
        log.warning("quantized crossover not cached", extra={"path": str(path), "error": str(exc)})


def _pass_time(fns, inputs) -> float:
    t0 = time.perf_counter()
    for fn, x in zip(fns, inputs):
        fn(x)
    return time.perf_counter() - t0


@torch.inference_mode()
def _quantized_wins(pairs, rows: int, dtype: torch.dtype, timings: dict) -> bool:
    """Whether the quantized pass over every pair beats the dense one at `rows` rows: each
    repeat times one pass of each back to back, and the median of their ratios decides, so
    that another process taking a core slows both sides of most repeats alike."""
    gen = torch.Generator().manual_seed(rows)
    by_k = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {p.in_features for p in pairs}}
    inputs = [by_k[p.in_features] for p in pairs]
    quantized, dense = [p.quantized for p in pairs], [p.dense for p in pairs]
    _pass_time(quantized, inputs), _pass_time(dense, inputs)  # first use of this shape: kernel setup
    qs, ds = [], []
    for i in range(REPEATS):  # which goes first alternates; long passes (many rows) repeat less
        if i >= MIN_REPEATS and sum(qs) + sum(ds) > REPEAT_BUDGET_S:
            break
        if i % 2:
            ds.append(_pass_time(dense, inputs))
            qs.append(_pass_time(quantized, inputs))
        else:
            qs.append(_pass_time(quantized, inputs))
            ds.append(_pass_time(dense, inputs))
    ratio = statistics.median(q / d for q, d in zip(qs, ds))
    timings[rows] = (round(min(qs) * 1000, 3), round(min(ds) * 1000, 3), round(ratio, 3))
    return ratio < 1.0


def measure(pairs, dtype: torch.dtype) -> tuple[int, dict]:
    """The largest candidate row count at which the quantized pass is faster (0: none), by
    bisection over CANDIDATE_ROWS (the dense matmul's advantage grows with rows); and the
    timings taken, {rows: (best quantized ms, best dense ms, median quantized / dense)}."""
    timings: dict[int, tuple[float, float]] = {}
    if not _quantized_wins(pairs, CANDIDATE_ROWS[0], dtype, timings):
        return 0, timings
    lo, hi = 0, len(CANDIDATE_ROWS)  # wins at lo; hi: first known loss (or past the end)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _quantized_wins(pairs, CANDIDATE_ROWS[mid], dtype, timings):
            lo = mid
        else:
            hi = mid
    return CANDIDATE_ROWS[lo], timings


def crossover_rows(model, ops, dtype: torch.dtype) -> tuple[int, str]:
    """quantized_max_rows for this model on this machine, and why (measured now, or cached)."""
    pairs = model.matmul_pairs()
    key = cache_key(pairs, dtype, f"{ops.dense_packing.name}|{ops.quantized_matmul}", getattr(ops, "kernels", None))
    return _answer(key, "rows", int, lambda: measure(pairs, dtype),
                   lambda rows: f"quantized faster up to {rows} rows")


def measure_prompt_rows(pairs, dtype: torch.dtype) -> tuple[bool, dict]:
    """Whether the dense pass beats the quantized one at PROMPT_ROWS rows, and the timings."""
    timings: dict[int, tuple[float, float, float]] = {}
    return not _quantized_wins(pairs, PROMPT_ROWS, dtype, timings), timings


def _prompt_key(pairs, ops, dtype: torch.dtype) -> str:
    return cache_key(pairs, dtype, f"{ops.dense_packing.name}|{ops.quantized_matmul}|prompt{PROMPT_ROWS}",
                     getattr(ops, "kernels", None))


def _describe_prompt(dense: bool) -> str:
    return f"{'dense' if dense else 'quantized'} faster on {PROMPT_ROWS}-row prompt chunks"


def prompt_rows_dense(model, ops, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether a prompt chunk's rows are faster on the decoder layers' dense weights than on their
    quantized ones on this machine (timed over those layers at PROMPT_ROWS rows, or cached): with
    AMX the dense bf16 matmul is several times the int8 one on a prompt chunk, without it the
    int8 one may stay ahead. The answer does not depend on the token budget, so that every
    engine on this machine and model computes a prompt alike."""
    pairs = model.matmul_pairs(lm_head=False)
    return _answer(_prompt_key(pairs, ops, dtype), "prompt_dense", bool, lambda: measure_prompt_rows(pairs, dtype),
                   _describe_prompt)


def known_prompt_rows_dense(model, ops, dtype: torch.dtype) -> tuple[bool, str] | None:
    """prompt_rows_dense's answer where it needs no timing (this process's or the cache's), else
    None. Needs only the quantized weights prepared (their shapes make the key): the backend plan
    asks before packing the dense ones, which a known quantized answer would free at once."""
    known = _known(_prompt_key(model.matmul_pairs(lm_head=False), ops, dtype), "prompt_dense", bool)
    return None if known is None else (known[0], f"{_describe_prompt(known[0])}: {known[1]}")


def _known(key: str, field: str, kind: type) -> tuple | None:
    """(answer, where from) of an answer already timed: by this process, or cached; else None."""
    if key in _measured:
        return _measured[key], "timed by this process for an earlier engine"
    cached = _read_cache().get(key)
    if isinstance(cached, dict) and type(cached.get(field)) is kind:
        return cached[field], f"timed on this CPU before ({cache_path()})"
    return None


def _answer(key: str, field: str, kind: type, timed, describe) -> tuple:
    """A timed answer (`timed()` -> (answer, timings)): this process's earlier one, the cache's,
    or timed now, again while other processes keep the CPUs busy (ATTEMPTS in all: the middle
    answer then), and cached only when the machine was quiet."""
    known = _known(key, field, kind)
    if known is not None:
        return known
    t0 = time.perf_counter()
    answers = []
    for _ in range(ATTEMPTS):
        answer, timings, foreign = _timed_measure(timed)
        answers.append(answer)
        quiet = foreign is not None and foreign <= QUIET_CORES
        if quiet:
            break
    else:  # never quiet: the middle answer of the attempts
        answer = sorted(answers)[len(answers) // 2]
    wall = time.perf_counter() - t0
    _measured[key] = answer
    log.info("matmul paths timed", extra={
        field: answer, "took_ms": round(wall * 1000, 1), "attempts": answers, "last_timings_ms": timings,
        "foreign_cores": None if foreign is None else round(foreign, 2), "cached": quiet})
    if quiet:
        _write_cache(key, {field: answer, "timings_ms": {str(r): t for r, t in timings.items()},
                           "measured": time.strftime("%Y-%m-%dT%H:%M:%S")})
        return answer, f"timed at start: {describe(answer)} (cached for later starts)"
    return answer, f"timed at start on a busy machine: {describe(answer)} (not cached)"


def _timed_measure(timed) -> tuple[object, dict, float | None]:
    """timed()'s answer and timings, and the other processes' CPU use meanwhile, in cores (None: unknown)."""
    t0, busy0, own0 = time.perf_counter(), system_busy_s(), time.process_time()
    answer, timings = timed()
    wall = time.perf_counter() - t0
    busy1, own1 = system_busy_s(), time.process_time()
    foreign = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    return answer, timings, foreign
