"""The Python heap of a long-running service process.

`freeze_startup_heap` is called once a service has loaded what it keeps for its whole
life (model, tokenizer, compiled protos, imported modules): it collects once, then moves
every object that survived into the collector's permanent generation (gc.freeze). Later
full collections then walk only what requests allocate, not the few hundred thousand
objects of torch, transformers and the model. In the engine, a full collection during a
step walking all of those is a long pause, and it lands on the first step of a burst (its
requests' objects tip the collector over), so on those requests' time to first token.
"""
from __future__ import annotations

import gc
import logging
import time


def freeze_startup_heap(log: logging.Logger) -> None:
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("startup heap frozen", extra={"objects": gc.get_freeze_count(),
                                           "ms": round((time.perf_counter() - t0) * 1000, 1)})
