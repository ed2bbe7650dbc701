"""EngineCoreLoop's burst start: an idle engine told `more_coming` waits for the rest of
a burst (up to idle_batch_wait_ms) and prefills it in one step; without the hint, or
once the wait is up, it steps at once. A tiny random Llama keeps the steps fast."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tessera_engine.config import EngineConfig
from tessera_engine.core import EngineCore, EngineCoreLoop
from tessera_engine.request import EngineCoreRequest
from tessera_engine.sampling_params import SamplingParams

from helpers.engine_fixtures import tiny_hf_llama, tiny_loaded

pytestmark = pytest.mark.unit


def _core(idle_batch_wait_ms: float) -> EngineCore:
    return EngineCore(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=32, block_size=16,
                                   idle_batch_wait_ms=idle_batch_wait_ms),
                      tiny_loaded(*tiny_hf_llama()))


class _Run:
    """The loop on its own thread; records (monotonic time, step, request ids with tokens) per callback."""

    def __init__(self, core: EngineCore) -> None:
        self.events: list[tuple[float, int, set[str]]] = []
        self.loop = EngineCoreLoop(core, self._on_outputs)
        self.loop.start()

    def _on_outputs(self, outs, stats, iteration) -> None:
        step = iteration.step if iteration is not None else None  # None: no step ran (an abort)
        self.events.append((time.monotonic(), step, {o.request_id for o in outs if o.new_token_ids}))

    def add(self, request_id: str) -> None:
        self.loop.add(EngineCoreRequest(request_id, [1, 2, 3, 4, 5],
                                        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))

    def first_step_of(self, request_id: str, timeout: float = 10.0) -> tuple[float, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, step, ids in list(self.events):
                if request_id in ids:
                    return t, step
            time.sleep(0.001)
        raise AssertionError(f"{request_id} got no token")

    def stop(self) -> None:
        self.loop.stop()
        self.loop.thread.join(5)


@pytest.fixture
def run():
    runs: list[_Run] = []

    def make(wait_ms: float) -> _Run:
        runs.append(_Run(_core(wait_ms)))
        return runs[-1]

    yield make
    for r in runs:
        r.stop()


def test_burst_announced_as_coming_starts_in_one_step(run):
    r = run(2000.0)
    r.add("a")
    r.loop.more_coming(True)
    time.sleep(0.2)  # far longer than a step of this model: without the hint "a" would have run
    assert r.events == []
    r.add("b")
    r.loop.more_coming(False)  # the burst is complete
    _, step_a = r.first_step_of("a")
    _, step_b = r.first_step_of("b")
    assert step_a == step_b == 1


def test_without_the_hint_the_first_arrival_steps_at_once(run):
    r = run(2000.0)
    r.add("a")
    r.loop.more_coming(False)
    r.first_step_of("a")
    r.add("b")
    r.loop.more_coming(False)
    assert r.first_step_of("b")[1] > r.first_step_of("a")[1]


def test_the_wait_ends_after_idle_batch_wait_ms(run):
    r = run(150.0)
    sent = time.monotonic()
    r.add("a")
    r.loop.more_coming(True)  # nothing else ever comes
    t, step = r.first_step_of("a")
    assert step == 1
    assert 0.14 <= t - sent < 2.0


def test_zero_wait_ignores_the_hint(run):
    r = run(0.0)
    sent = time.monotonic()
    r.add("a")
    r.loop.more_coming(True)
    t, _ = r.first_step_of("a")
    assert t - sent < 1.0
    assert len(r.events) >= 1


def test_running_engine_never_waits_for_a_burst(run):
    r = run(5000.0)
    r.loop.add(EngineCoreRequest("long", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=120,
                                                                    ignore_eos=True)))
    r.loop.more_coming(False)
    r.first_step_of("long")
    sent = time.monotonic()
    r.add("b")
    r.loop.more_coming(True)  # the engine is busy: the hint is ignored
    t, _ = r.first_step_of("b")
    assert t - sent < 2.0


def test_negative_wait_is_refused():
    with pytest.raises(ValueError, match="idle_batch_wait_ms"):
        EngineConfig(idle_batch_wait_ms=-1).validate()
    # the service says so as a usage error before loading anything
    result = subprocess.run([sys.executable, "-m", "tessera_engine", "--idle-batch-wait-ms", "-1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "idle_batch_wait_ms must be >= 0" in result.stderr and "Traceback" not in result.stderr


def test_abort_one_sample_leaves_its_sibling_running():
    core = _core(0.0)
    core.add_request(EngineCoreRequest("r", [1, 2, 3, 4], SamplingParams(temperature=1.0, seed=3, n=2,
                                                                          max_tokens=8, ignore_eos=True)))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for o in core.step():
        tokens[o.index].extend(o.new_token_ids)
    aborted = core.abort_samples([("r", 0), ("r", 5), ("nope", 0)])  # unknown ones are ignored
    assert [(o.index, o.finish_reason) for o in aborted] == [(0, "abort")]
    finals = {}
    while core.has_unfinished():
        for o in core.step():
            assert o.index == 1
            tokens[1].extend(o.new_token_ids)
            if o.finish_reason:
                finals[o.index] = o.finish_reason
    assert finals == {1: "length"} and len(tokens[0]) == 1 and len(tokens[1]) == 8
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
