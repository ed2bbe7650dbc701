"""How busy the whole machine's CPUs have been, for telling our own work from other processes'
(the engine's crossover timing, the benchmarks' quiet-machine checks)."""
from __future__ import annotations

import os


def system_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot, all CPUs together, from
    /proc/stat (user nice system irq softirq steal; guest time is inside user already); None
    where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")
