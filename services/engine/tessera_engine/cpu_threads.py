"""Which CPU each of the engine's compute threads runs on (--cpu-threads-bind).

torch's CPU ops run on its OpenMP team, tessera's kernels on a pool of their own
(csrc/tile_queue.h) whose helper k is bound with the team's thread k; both spin between
parallel regions (~280 a decode step). Served, the
engine shares the cores with the frontend, the tokenizer and the clients; left to float,
two of the team's threads can land on one core, and each region then waits a scheduler
time slice for the thread that is not running. One thread per CPU keeps them apart, as
vLLM's CPU backend does by default (VLLM_CPU_OMP_THREADS_BIND=auto); served, it measured
ahead in throughput and TTFT.

Modes:
- "auto": bind when the team fills the CPUs this process may use (one thread per CPU, or
  one per physical core on SMT machines); otherwise (fewer threads than CPUs: replicas
  sharing a host, a CPU quota) the threads are left to the scheduler, since which CPUs
  are someone else's is not known here.
- "off": never bind.
- a CPU list ("0-3", "0,2,4-5"): bind thread i to the i-th CPU listed; the team then
  has that many threads.

The team's first thread is the one that runs the engine's steps (the service's core
thread), so it is bound too, and threads it starts later inherit its CPU. In-process users
of EngineCore (tests, benchmarks) get "off" by default (EngineConfig): there the team's
first thread is the caller's own.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

MODES = ("auto", "off")


def parse_cpu_list(text: str) -> list[int]:
    """ "0-3,6" -> [0, 1, 2, 3, 6] (order kept, no repeats); ValueError naming what is wrong."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise ValueError(f"cpu list {text!r}: {part!r} is not a CPU number or a range like 0-3") from None
        if first < 0 or last < first:
            raise ValueError(f"cpu list {text!r}: {part!r} is not a range of CPU numbers")
        cpus.extend(c for c in range(first, last + 1) if c not in cpus)
    return cpus


def check_mode(mode: str) -> None:
    if mode not in MODES:
        parse_cpu_list(mode)


def physical_cores(cpus: list[int]) -> list[int]:
    """The first CPU of each physical core among `cpus` (all of them where topology is unknown)."""
    seen: set[tuple[str, str]] = set()
    firsts = []
    for cpu in cpus:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topo + "physical_package_id") as f, open(topo + "core_id") as g:
                key = (f.read().strip(), g.read().strip())
        except OSError:
            return list(cpus)
        if key not in seen:
            seen.add(key)
            firsts.append(cpu)
    return firsts


def auto_cpus(threads: int, allowed: list[int], cores: list[int]) -> tuple[list[int] | None, str]:
    """auto's choice for a team of `threads` on the `allowed` CPUs (`cores`: one CPU per
    physical core among them): the CPUs to bind to, or None, and why."""
    if threads == len(allowed) and threads > 1:
        return allowed, f"{threads} threads, one per CPU this process may use"
    if threads == len(cores) and threads > 1:
        return cores, f"{threads} threads, one per physical core"
    return None, (f"{threads} threads on {len(allowed)} CPUs ({len(cores)} cores): "
                  "the other CPUs may be another process's, so the scheduler places them")


def bind(mode: str, kernels) -> list[int] | None:
    """Apply `mode` to the calling thread's team (set torch's thread count first). Returns the
    CPU of each thread, or None where nothing was bound; logs either way."""
    import torch

    if mode == "off":
        return None
    if kernels is None or not hasattr(kernels, "bind_threads"):
        log.info("cpu threads not bound", extra={"why": "the fused CPU kernels are off or unavailable"})
        return None
    if mode == "auto":
        allowed = sorted(os.sched_getaffinity(0))
        cpus, why = auto_cpus(torch.get_num_threads(), allowed, physical_cores(allowed))
        if cpus is None:
            log.info("cpu threads not bound", extra={"why": why})
            return None
    else:
        cpus, why = parse_cpu_list(mode), "--cpu-threads-bind"
        torch.set_num_threads(len(cpus))
    got = list(kernels.bind_threads(cpus))
    if -1 in got:
        log.warning("cpu threads partly bound", extra={"cpus": got, "why": why})
    else:
        log.info("cpu threads bound", extra={"cpus": got, "why": why})
    return got
