"""Test-only fault injection for the engine service, kept out of the production classes.

With TESSERA_ENGINE_FAULT_AFTER_STEPS=N in its environment, the engine service's core
raises instead of running step N+1 (the health tests kill the core loop that way); with
TESSERA_ENGINE_HANG_AFTER_STEPS=N step N+1 never returns (the watchdog's test):
`arm_from_env` wraps one EngineCore's run_step from outside.
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

FAULT_ENV = "TESSERA_ENGINE_FAULT_AFTER_STEPS"
HANG_ENV = "TESSERA_ENGINE_HANG_AFTER_STEPS"


def arm_from_env(core) -> None:
    """Arm the fault on this core when FAULT_ENV or HANG_ENV is set; otherwise leave it untouched."""
    raw = os.environ.get(FAULT_ENV, "").strip()
    if raw:
        arm(core, int(raw))
    raw = os.environ.get(HANG_ENV, "").strip()
    if raw:
        arm_hang(core, int(raw))


def arm_hang(core, after_steps: int) -> None:
    """Step after_steps + 1 never returns (the watchdog's test)."""
    run_step = core.run_step

    def run_step_or_hang():
        if core.has_unfinished() and core.step_count >= after_steps:
            log.warning("fault injection: this step hangs", extra={"env": HANG_ENV})
            threading.Event().wait()
        return run_step()

    core.run_step = run_step_or_hang
    log.warning("fault injection armed: step %d will hang", after_steps + 1, extra={"env": HANG_ENV})


def arm(core, after_steps: int) -> None:
    run_step = core.run_step

    def run_step_or_fail():
        if core.has_unfinished() and core.step_count >= after_steps:
            raise RuntimeError(f"injected fault after {core.step_count} steps ({FAULT_ENV})")
        return run_step()

    core.run_step = run_step_or_fail
    log.warning("fault injection armed: the core loop will die after %d steps", after_steps,
                extra={"env": FAULT_ENV})
