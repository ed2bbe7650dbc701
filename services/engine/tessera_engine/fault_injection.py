"""Test-only fault injection for the engine service, kept out of the production classes.

With TESSERA_ENGINE_FAULT_AFTER_STEPS=N in its environment, the engine service's core
raises instead of running step N+1 (the health tests kill the core loop that way); with
TESSERA_ENGINE_HANG_AFTER_STEPS=N step N+1 never returns (the watchdog's test); with
TESSERA_ENGINE_STEP_ERROR_AFTER_STEPS=N the model run of step N+1 raises once, inside the
step (its requests fail, the engine goes on): `arm_from_env` wraps one EngineCore's
run_step, or its executor's execute_model, from outside.
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

FAULT_ENV = "TESSERA_ENGINE_FAULT_AFTER_STEPS"
HANG_ENV = "TESSERA_ENGINE_HANG_AFTER_STEPS"
STEP_ERROR_ENV = "TESSERA_ENGINE_STEP_ERROR_AFTER_STEPS"


def arm_from_env(core) -> None:
    """Arm the faults set in this process's environment on this core; otherwise leave it untouched."""
    raw = os.environ.get(FAULT_ENV, "").strip()
    if raw:
        arm(core, int(raw))
    raw = os.environ.get(HANG_ENV, "").strip()
    if raw:
        arm_hang(core, int(raw))
    raw = os.environ.get(STEP_ERROR_ENV, "").strip()
    if raw:
        arm_step_error(core, int(raw))


def arm_step_error(core, after_steps: int) -> None:
    """The model run of step after_steps + 1 raises, once."""
    execute_model = core.executor.execute_model
    fired = False

    def execute_model_with_error(sched):
        nonlocal fired
        if not fired and core.step_count >= after_steps:
            fired = True
            raise RuntimeError(f"injected step error after {core.step_count} steps ({STEP_ERROR_ENV})")
        return execute_model(sched)

    core.executor.execute_model = execute_model_with_error
    log.warning("fault injection armed: step %d will raise", after_steps + 1, extra={"env": STEP_ERROR_ENV})


def arm(core, after_steps: int) -> None:
    """Step after_steps + 1 raises: the core loop dies."""
    def fail():
        raise RuntimeError(f"injected fault after {core.step_count} steps ({FAULT_ENV})")

    _before_step(core, after_steps, fail)
    log.warning("fault injection armed: the core loop will die after %d steps", after_steps,
                extra={"env": FAULT_ENV})


def arm_hang(core, after_steps: int) -> None:
    """Step after_steps + 1 never returns (the watchdog's test)."""
    def hang():
        log.warning("fault injection: this step hangs", extra={"env": HANG_ENV})
        threading.Event().wait()

    _before_step(core, after_steps, hang)
    log.warning("fault injection armed: step %d will hang", after_steps + 1, extra={"env": HANG_ENV})


def _before_step(core, after_steps: int, fault) -> None:
    """Wrap core.run_step: once after_steps steps have run and there is work, `fault()` first."""
    run_step = core.run_step

    def run_step_with_fault():
        if core.has_unfinished() and core.step_count >= after_steps:
            fault()
        return run_step()

    core.run_step = run_step_with_fault
