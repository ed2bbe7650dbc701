"""A short migration soak (the full one: tests/helpers/migration_soak.py as a script): three
engine replicas (the shared stack's and two of this module's, one compute thread each) behind
one frontend; streaming requests, greedy, seeded and JSON-schema constrained, 10% cancelled,
while the two extra engines are SIGKILLed and restarted, then drained one after the other with
SIGTERM (a rolling update). No client error, no hang, every completed text equal to an
undisturbed run's, every engine idle with every block free afterwards."""
from __future__ import annotations

import asyncio

import pytest

from helpers import migration_soak
from helpers.stack import Service, all_serving, frontend_service, stack  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REQUESTS = 64
CONCURRENCY = 16


@pytest.fixture(scope="module")
def replicas(stack):
    extra = [Service(f"engine-soak-{k}", "tessera_engine", migration_soak.launch.free_port(),
                     list(stack.engine.args) + ["--num-threads", "1"], stack.log_dir / f"engine-soak-{k}.log")
             for k in range(2)]
    frontend = frontend_service("frontend-soak", stack.tokenizer.addr,
                                ",".join([stack.engine.addr] + [e.addr for e in extra]), stack.log_dir)
    with all_serving(*extra, frontend):
        yield stack.engine, extra, frontend


@pytest.fixture(scope="module")
def reference(replicas):
    _, _, frontend = replicas
    specs = migration_soak.make_specs(REQUESTS, seed=5, max_tokens=(6, 24))
    return specs, asyncio.run(migration_soak.run_load(frontend.addr, specs, "soak-ref", CONCURRENCY, cancels=False))


@pytest.mark.parametrize("mode,every_s", [("kill", 3.0), ("rolling", 1.0)])
def test_engines_killed_or_drained_under_load_change_no_answer(replicas, reference, mode, every_s):
    engine_a, extra, frontend = replicas
    specs, ref = reference
    assert all(o.status == "complete" for o in ref.values()), {i: o for i, o in ref.items() if o.status != "complete"}
    report = asyncio.run(migration_soak.soak(frontend, extra, specs, mode, every_s, CONCURRENCY, ref))
    print(f"\n{mode}: {report['outcomes']} in {report['seconds']} s, {report['migrations']} migrations, "
          f"events {report['events']}")
    assert report["events"], "the load ended before any engine was disturbed"
    assert not report["errors"] and not report["hung"], report["errors"]
    assert not report["differ"], report["differ"]
    assert report["compared"] >= REQUESTS // 2, report["outcomes"]
    if mode == "kill":
        assert report["migrations"] >= 1, report  # the killed engines held requests
    if mode == "rolling":
        assert all(e["exit"] == 0 and e["drain_s"] < 15 for e in report["events"]), report["events"]
    assert all(state["idle"] for state in migration_soak.engine_states([engine_a, *extra]).values())
