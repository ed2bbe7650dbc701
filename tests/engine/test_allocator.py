"""The engine's memory allocator (tessera_engine.allocator): tcmalloc preloaded by one
re-execution when found, glibc's malloc when asked for or when none is there."""
import json
import os

import pytest

from helpers.stack import engine_service
from tessera_engine import allocator


def _maps_have_tcmalloc(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return any("tcmalloc" in line for line in maps)


def _allocator_log(service) -> dict:
    for line in service.log_path.read_text().splitlines():
        if line.startswith("{") and json.loads(line).get("msg") == "memory allocator":
            return json.loads(line)
    raise AssertionError(f"no 'memory allocator' line in the engine log:\n{service.log_tail()}")


@pytest.fixture
def unchosen(monkeypatch):
    """No allocator chosen yet in this process's environment, and whatever preload() sets
    there undone after the test (setenv first, so that monkeypatch records the variable)."""
    monkeypatch.setenv(allocator.CHOSEN_ENV, "")
    monkeypatch.delenv(allocator.CHOSEN_ENV)
    return monkeypatch


@pytest.mark.unit
def test_setting_flag_beats_env_beats_default(monkeypatch):
    monkeypatch.delenv(allocator.ENV, raising=False)
    assert allocator._setting([]) == "auto"
    monkeypatch.setenv(allocator.ENV, "system")
    assert allocator._setting(["--port", "1"]) == "system"
    assert allocator._setting(["--allocator", "tcmalloc"]) == "tcmalloc"
    assert allocator._setting(["--allocator=auto", "--allocator", "system"]) == "system"


@pytest.mark.unit
def test_no_reexec_in_the_reexecuted_process_or_for_system(unchosen):
    monkeypatch = unchosen
    def no_exec(*args):
        raise AssertionError("re-executed")

    monkeypatch.setattr(os, "execve", no_exec)
    monkeypatch.setenv(allocator.CHOSEN_ENV, "tcmalloc: /x (auto)")
    allocator.preload([])  # the re-executed process: never again
    monkeypatch.delenv(allocator.CHOSEN_ENV)
    allocator.preload(["--allocator", "system"])
    assert os.environ[allocator.CHOSEN_ENV] == "system: set by --allocator"


@pytest.mark.unit
def test_auto_without_a_library_runs_on_glibc(unchosen):
    monkeypatch = unchosen
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("re-executed without a library"))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    allocator.preload([])
    assert os.environ[allocator.CHOSEN_ENV].startswith("system: no tcmalloc found")


@pytest.mark.unit
def test_required_tcmalloc_missing_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert "--allocator tcmalloc" in allocator.check("tcmalloc")
    assert allocator.check("auto") is None and allocator.check("system") is None
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "/usr/lib/libtcmalloc_minimal.so.4")
    assert allocator.check("tcmalloc") is None


@pytest.mark.integration
def test_engine_process_preloads_tcmalloc_when_found():
    """The default (auto): the engine's own process (same PID: one exec, no child) runs on
    tcmalloc when the machine or the venv has it (make install fetches it), else on glibc's,
    and its log says which and why."""
    found = allocator.find_tcmalloc()
    with engine_service() as engine:
        pid = engine.process.pid
        assert _maps_have_tcmalloc(pid) == (found is not None)
        line = _allocator_log(engine)
        if found:
            assert line["allocator"] == "tcmalloc" and found in line["why"]
        else:
            assert line["allocator"] == "system" and "no tcmalloc found" in line["why"]


@pytest.mark.integration
def test_engine_process_on_glibc_when_asked():
    with engine_service("--allocator", "system") as engine:
        assert not _maps_have_tcmalloc(engine.process.pid)
        line = _allocator_log(engine)
        assert line["allocator"] == "system" and line["why"] == "system: set by --allocator"


@pytest.mark.unit
def test_an_unknown_allocator_is_a_usage_error_naming_the_flag():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "tessera_engine", "--allocator", "jemalloc"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "argument --allocator: invalid choice: 'jemalloc'" in done.stderr, done.stderr[-500:]


@pytest.mark.unit
def test_release_free_memory_hands_freed_pages_back():
    """What a load frees (many heap blocks under the mmap threshold) goes back to the system:
    glibc keeps it in its heap, tcmalloc (when this process has it) in its free lists."""
    from tessera_engine.executor import rss_mib

    blocks = [bytearray(100_000) for _ in range(2000)]  # ~200 MB of heap, each block touched
    pin = bytearray(100_000)  # above them: glibc cannot give the freed blocks back by trimming its top
    held = rss_mib()
    del blocks
    assert rss_mib() > held - 50  # freed, still held by the allocator
    assert allocator.release_free_memory() in ("MallocExtension_ReleaseFreeMemory", "malloc_trim")
    assert rss_mib() < held - 150
    del pin
