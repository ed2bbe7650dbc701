"""The engine process's memory allocator: tcmalloc where the machine has it, else glibc's.

Every torch op of every step allocates its output and frees its inputs' temporaries; with
glibc's malloc that churn cost a measurable share of served throughput and of a lone
request's decode speed, which tcmalloc won back when measured. vLLM's CPU backend gives
the same advice. An allocator replaces malloc only when it is loaded before the process
starts, so `python -m tessera_engine` (and the tessera-engine command) re-executes
itself once with the library in LD_PRELOAD, before torch is imported: same PID, same
arguments. `--allocator` / TESSERA_ALLOCATOR: auto (tcmalloc when found, the default),
tcmalloc (required: exit 2 when missing), system (glibc's).

Where tcmalloc is looked for: LD_PRELOAD already naming it, the copy `make install` puts in
the virtual environment (`python -m tessera_engine.allocator fetch`: Debian's
libtcmalloc-minimal4 unpacked, for machines without it installed), the system library
directories (the engine image installs the package). This module imports no torch.
"""
from __future__ import annotations

import argparse
import ctypes.util
import glob
import os
import shutil
import subprocess
import sys
import tempfile

CHOICES = ("auto", "tcmalloc", "system")
ENV = "TESSERA_ALLOCATOR"
# Set on the re-executed process: what was chosen and why (and it never re-executes twice).
CHOSEN_ENV = "TESSERA_ALLOCATOR_CHOSEN"
LIBRARY = "libtcmalloc_minimal.so.4"
VENV_DIR = os.path.join(sys.prefix, "lib", "tessera-tcmalloc")  # where `fetch` unpacks it


def _system_paths() -> list[str]:
    found = sorted(glob.glob(f"/usr/lib/*-linux-gnu/{LIBRARY}")) + [f"/usr/lib64/{LIBRARY}", f"/usr/lib/{LIBRARY}"]
    name = ctypes.util.find_library("tcmalloc_minimal")
    return found + ([name] if name and os.path.isabs(name) else [])


def find_tcmalloc() -> str | None:
    """The tcmalloc library to preload, or None."""
    for path in sorted(glob.glob(os.path.join(VENV_DIR, "usr", "lib", "*", LIBRARY))) + _system_paths():
        if os.path.isfile(path):
            return path
    return None


def _setting(argv: list[str]) -> str:
    """--allocator from the command line (its last value), else TESSERA_ALLOCATOR, else auto."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--allocator")
    known, _ = pre.parse_known_args(argv)
    return known.allocator or os.environ.get(ENV) or "auto"


def preload(argv: list[str]) -> None:
    """Re-execute this process with tcmalloc preloaded when the setting asks for it and it is
    found (returns otherwise: the setting is `system`, none was found, it is preloaded
    already, or this is the re-executed process). A bad setting or `tcmalloc` without the
    library is left to the server's argument parser, which exits 2 naming the flag."""
    if CHOSEN_ENV in os.environ:
        return
    setting = _setting(argv)
    if setting not in ("auto", "tcmalloc"):
        os.environ[CHOSEN_ENV] = "system: set by --allocator"
        return
    preloaded = os.environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preloaded:
        os.environ[CHOSEN_ENV] = "tcmalloc: already in LD_PRELOAD"
        return
    path = find_tcmalloc()
    if path is None:
        os.environ[CHOSEN_ENV] = ("system: no tcmalloc found (Debian's libtcmalloc-minimal4, or "
                                  "`python -m tessera_engine.allocator fetch`)")
        return
    env = dict(os.environ, LD_PRELOAD=f"{path}:{preloaded}" if preloaded else path)
    env[CHOSEN_ENV] = f"tcmalloc: {path} ({'required' if setting == 'tcmalloc' else 'auto'})"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "tessera_engine", *argv], env)


def in_use() -> dict:
    """The allocator this process runs with and why, for the start-up log."""
    loaded = False
    try:
        with open("/proc/self/maps") as maps:
            loaded = any("tcmalloc" in line for line in maps)
    except OSError:
        pass
    return {"allocator": "tcmalloc" if loaded else "system",
            "why": os.environ.get(CHOSEN_ENV, "started without the tessera-engine launcher")}


def release_free_memory() -> str | None:
    """Hand the pages a model load freed back to the system (the executor calls it once its
    engine is built): tcmalloc keeps freed pages for reuse, glibc freed small and medium chunks,
    a few hundred MiB after a load (dequantized tensors, the dense and repacked weights' first
    copies). Which call did it, or None (neither allocator's)."""
    try:
        process = ctypes.CDLL(None)
    except OSError:
        return None
    for name, args in (("MallocExtension_ReleaseFreeMemory", ()), ("malloc_trim", (0,))):
        call = getattr(process, name, None)  # tcmalloc's first: glibc's is there beside it
        if call is not None:
            call(*args)
            return name
    return None


def check(setting: str) -> str | None:
    """Why `setting` cannot be honoured (the argument parser's error), or None."""
    if setting == "tcmalloc" and find_tcmalloc() is None and "tcmalloc" not in os.environ.get("LD_PRELOAD", ""):
        return ("--allocator tcmalloc: no tcmalloc library found (install Debian's libtcmalloc-minimal4 or run "
                "`python -m tessera_engine.allocator fetch`)")
    return None


def fetch() -> int:
    """Unpack Debian's libtcmalloc-minimal4 into this virtual environment (no root needed:
    `apt-get download` and `dpkg -x`), unless tcmalloc is installed already. 0 when one is
    there afterwards; 1 (and a message) when it could not be fetched: the engine then runs
    with glibc's malloc."""
    path = find_tcmalloc()
    if path is not None:
        print(f"tcmalloc: {path}")
        return 0
    if not (shutil.which("apt-get") and shutil.which("dpkg")):
        print("tcmalloc: not found, and no apt-get / dpkg to fetch it; the engine will use glibc's malloc")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(["apt-get", "download", "libtcmalloc-minimal4"], cwd=tmp, check=True,
                           capture_output=True, timeout=300)
            debs = sorted(glob.glob(os.path.join(tmp, "libtcmalloc-minimal4_*.deb")))
            subprocess.run(["dpkg", "-x", debs[-1], VENV_DIR], check=True, capture_output=True, timeout=120)
        except (subprocess.SubprocessError, OSError, IndexError) as exc:
            print(f"tcmalloc: could not fetch Debian's libtcmalloc-minimal4 ({exc}); the engine will use glibc's malloc")
            return 1
    path = find_tcmalloc()
    print(f"tcmalloc: {path}" if path else "tcmalloc: unpacked, but no library found in the package")
    return 0 if path else 1


if __name__ == "__main__":
    if sys.argv[1:] != ["fetch"]:
        raise SystemExit("usage: python -m tessera_engine.allocator fetch")
    raise SystemExit(fetch())
