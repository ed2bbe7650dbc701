"""The OpenMP runtime's settings the engine runs with, put in the environment before torch loads
libgomp (which reads them once, when it is loaded): the service's `__main__` applies them, and
the benchmarks' in-process engines do, to run as the service does.

The kernels' loops run on a thread pool of their own (csrc/tile_queue.h); torch's ops (a
prompt's attention among them) run on torch's OpenMP team. libgomp's idle threads spin 300,000
turns after each parallel region by default, long enough to keep the pool's threads off the
cores through a prompt step: on a 2-core Intel Xeon, steps of 38 and 63 prompt rows took 40-60%
longer, and 10,000 turns brought them back.
"""
from __future__ import annotations

import os
from typing import MutableMapping

SETTINGS = {"GOMP_SPINCOUNT": "10000"}


def apply(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Each setting that `env` (default: this process's environment) does not already give;
    returns `env`. In this process it counts only before torch is first imported."""
    env = os.environ if env is None else env
    for name, value in SETTINGS.items():
        env.setdefault(name, value)
    return env
