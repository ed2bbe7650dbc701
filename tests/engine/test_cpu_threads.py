"""--cpu-threads-bind: the CPU list parser, auto's choice, and the binding itself (in a child
process, so that the test process's own threads stay unbound)."""
import json
import os
import subprocess
import sys

import pytest

from tessera_engine.config import EngineConfig
from tessera_engine.cpu_threads import auto_cpus, parse_cpu_list

pytestmark = pytest.mark.unit


def test_parse_cpu_list():
    assert parse_cpu_list("0-3") == [0, 1, 2, 3]
    assert parse_cpu_list("0,2,4-5") == [0, 2, 4, 5]
    assert parse_cpu_list(" 3 , 1 ") == [3, 1]  # order kept: thread i gets the i-th
    assert parse_cpu_list("1,1-2") == [1, 2]
    for bad in ("", "a", "3-1", "-1", "0-", "1,,2"):
        with pytest.raises(ValueError, match="cpu list"):
            parse_cpu_list(bad)


def test_auto_binds_only_a_team_that_fills_its_cpus():
    assert auto_cpus(4, [0, 1, 2, 3], [0, 1, 2, 3])[0] == [0, 1, 2, 3]
    # SMT: 8 logical CPUs on 4 cores, torch's 4 threads -> one per core
    assert auto_cpus(4, list(range(8)), [0, 2, 4, 6])[0] == [0, 2, 4, 6]
    # fewer threads than CPUs (a replica given part of the host, a quota): left alone
    cpus, why = auto_cpus(1, [0, 1], [0, 1])
    assert cpus is None and "1 threads on 2 CPUs" in why
    assert auto_cpus(4, list(range(16)), list(range(16)))[0] is None
    assert auto_cpus(1, [0], [0])[0] is None  # one thread: nothing to keep apart


def test_config_validates_the_mode():
    EngineConfig(cpu_threads_bind="auto").validate()
    EngineConfig(cpu_threads_bind="0-1", num_threads=2).validate()
    with pytest.raises(ValueError, match="cpu list 'x'"):
        EngineConfig(cpu_threads_bind="x").validate()
    with pytest.raises(ValueError, match="disagree"):
        EngineConfig(cpu_threads_bind="0-1", num_threads=3).validate()
    assert EngineConfig().cpu_threads_bind == "off"  # in-process: the caller's thread is not bound


def test_engine_flag_defaults_to_auto_and_rejects_a_bad_list(capsys):
    from tessera_engine.server import parse_args

    assert parse_args([]).cpu_threads_bind == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--cpu-threads-bind", "0-x"])
    assert "cpu list '0-x'" in capsys.readouterr().err


_CHILD = r"""
import json, os, sys, torch
from tessera_engine import cpu_kernels, cpu_threads
mode, kernel_at = sys.argv[1], sys.argv[2]
kernels = cpu_kernels.load()
def kernel():  # enough rows to run on the kernels' pool (its helper thread starts at the first)
    kernels.rms_norm(torch.randn(256, 64), torch.ones(64), 1e-5)
if kernel_at == "before":
    kernel()
got = cpu_threads.bind(mode, kernels)
if kernel_at == "after":
    kernel()
x = torch.randn(256, 256)
for _ in range(20):
    x = torch.tanh(x @ x)  # run the team so its threads exist
tasks = {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/status") as f:
        tasks[tid] = [l.split(":", 1)[1].strip() for l in f if l.startswith("Cpus_allowed_list")][0]
print(json.dumps({"got": got, "threads": torch.get_num_threads(), "tasks": tasks,
                  "main": sorted(os.sched_getaffinity(0))}))
"""


def _child(mode: str, kernel_at: str = "none") -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, kernel_at], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_bind_pins_each_thread_of_the_team_to_its_own_cpu():
    cpus = sorted(os.sched_getaffinity(0))[:2]
    res = _child(f"{cpus[0]},{cpus[1]}")
    assert res["got"] == cpus and res["threads"] == 2
    # the calling thread (the team's first) is on the first CPU, one other thread on the second
    assert res["main"] == [cpus[0]]
    pinned = sorted(v for v in res["tasks"].values() if v in (str(cpus[0]), str(cpus[1])))
    assert pinned == sorted([str(cpus[0]), str(cpus[1])])
    assert _child("off")["got"] is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
@pytest.mark.parametrize("kernel_at", ["before", "after"])
def test_bind_pins_the_kernels_pool_helper_as_the_teams_second_thread(kernel_at):
    """The kernels' loops run on a pool of their own (tile_queue.h): its helper goes where the
    team's second thread goes, whether it started before the binding or after (a helper started
    by the bound core thread would otherwise share that thread's one CPU)."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    res = _child(f"{cpus[0]},{cpus[1]}", kernel_at)
    assert res["got"] == cpus and res["main"] == [cpus[0]]
    pinned = sorted(v for v in res["tasks"].values() if v in (str(cpus[0]), str(cpus[1])))
    assert pinned == sorted([str(cpus[0]), str(cpus[1]), str(cpus[1])])  # main; team thread and helper


def test_openmp_settings_are_a_default_the_environment_can_override():
    """The engine service puts libgomp's spin count in its environment before torch loads it
    (openmp_env.apply, in its __main__): a default where none is given, the operator's kept."""
    from tessera_engine import openmp_env

    assert openmp_env.apply({}) == openmp_env.SETTINGS
    assert openmp_env.apply({"GOMP_SPINCOUNT": "5", "X": "1"}) == {"GOMP_SPINCOUNT": "5", "X": "1"}
