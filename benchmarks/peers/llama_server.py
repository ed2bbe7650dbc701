"""llama.cpp's own server, llama-server, as a served peer (issue 33, item 1).

Built once, from the llama.cpp that the llama-cpp-python source package on PyPI vendors
(the same version as llama_cpp_python.py), for this CPU (GGML_NATIVE: its AMX and AVX-512
paths where the CPU has them, as a user building it here gets), only the llama-server
target, into the benchmark cache. Two things a plain build of that tree trips on here:
- LLAMA_USE_PREBUILT_UI is ON by default and fetches the web UI at configure time: OFF
  (this machine has no internet but PyPI);
- with GCC 12 the AMX path crashes at start-up: `_tile_loadconfig(&tc)` does not tell the
  compiler that it reads `tc`, which may then drop the stores that filled it (upstream
  llama.cpp issue 20824). An empty asm statement that reads the whole struct first keeps them.

    python benchmarks/peers/llama_server.py                 # build (once) and print the binary's path
    python benchmarks/peers/llama_server.py --command M.gguf --port 8080   # how it is served
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import sys
import tarfile

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent
if str(BENCHMARKS) not in sys.path:  # run as a script
    sys.path.insert(0, str(BENCHMARKS))

from peers import cache_dir, log, run  # noqa: E402
from peers.llama_cpp_python import LLAMA_CPP_VERSION, download_sdist  # noqa: E402

READY_STAMP = ".tessera-ready"
AMX_TILE_CONFIG = "ggml/src/ggml-cpu/amx/mmq.cpp"
TILE_LOAD = re.compile(r"^(\s*)_tile_loadconfig\(&(\w+)\);", re.M)
PATCH_MARK = "tessera: the tile config's stores kept"


def default_dir() -> pathlib.Path:
    return cache_dir() / f"llama-server-{LLAMA_CPP_VERSION}"


def patch_tile_config(source: pathlib.Path) -> bool:
    """Make `_tile_loadconfig(&cfg)` read cfg as far as the compiler knows (see the module doc);
    False where the call is not found (the tree moved on: check the AMX path by hand)."""
    path = source / AMX_TILE_CONFIG
    text = path.read_text()
    if PATCH_MARK in text:
        return True
    patched, n = TILE_LOAD.subn(
        lambda m: f'{m.group(1)}asm volatile("" : : "m"({m.group(2)}));  // {PATCH_MARK}\n{m.group(0)}', text)
    if n:
        path.write_text(patched)
    return n > 0


def unpack_source(work: pathlib.Path) -> pathlib.Path:
    """The vendored llama.cpp of llama-cpp-python's source package (downloaded from PyPI once)."""
    source = work / "llama.cpp"
    if (source / "CMakeLists.txt").exists():
        return source
    archive = download_sdist(work / "sdist")
    prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(source, members=[m for m in members if m.name], filter="data")
    return source


def ensure_llama_server(work: pathlib.Path | None = None, jobs: int | None = None) -> pathlib.Path:
    """The llama-server binary, built once (minutes)."""
    work = work or default_dir()
    binary = work / "build" / "bin" / "llama-server"
    if (work / READY_STAMP).exists() and binary.exists():
        return binary
    if shutil.which("cmake") is None:
        raise SystemExit("building llama-server needs cmake (Debian: apt-get install cmake)")
    log(f"building llama-server from llama-cpp-python {LLAMA_CPP_VERSION}'s llama.cpp into {work} (once) ...")
    source = unpack_source(work)
    if not patch_tile_config(source):
        log(f"  note: no _tile_loadconfig call found in {AMX_TILE_CONFIG}; AMX path left as it is")
    build = work / "build"
    run(["cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_SERVER=ON",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF"])
    run(["cmake", "--build", build, "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 1)])
    if not binary.exists():
        raise SystemExit(f"the build made no {binary}")
    (work / READY_STAMP).write_text(LLAMA_CPP_VERSION)
    return binary


def server_command(binary: pathlib.Path, gguf: str, port: int, host: str = "127.0.0.1",
                   parallel: int = 64, ctx: int = 32768, threads: int | None = None) -> list[str]:
    """llama-server as the benchmarks run it: one slot per concurrent request (the burst's 64),
    their contexts sharing `ctx`, continuous batching, one thread per core."""
    return [str(binary), "-m", gguf, "--host", host, "--port", str(port), "--parallel", str(parallel),
            "-c", str(ctx), "--cont-batching", "-t", str(threads or os.cpu_count() or 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=pathlib.Path, default=None, help="build folder (default: in the benchmark cache)")
    ap.add_argument("--command", metavar="GGUF", help="print the serving command for this file instead")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args(argv)
    binary = ensure_llama_server(args.dir)
    print(" ".join(server_command(binary, args.command, args.port)) if args.command else binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
