"""tessera's fused CPU kernels (csrc/: one .cpp per kernel family, cpu_kernels.h and vec.h
shared), built on first use into one extension module.

torch.utils.cpp_extension compiles them for the machine they run on (gcc and
the Python headers; ninja from requirements) into TORCH_EXTENSIONS_DIR
(default ~/.cache/torch_extensions), once: later processes load the cached
build without compiling (ninja rebuilds the files that include any source or
header that changed). `python -m tessera_engine.cpu_kernels` builds them ahead
of time (make install does).

Built somewhere else (the engine image: built in its builder stage, which has gcc,
loaded in the runtime stage, which has none), a build for the builder's own CPU
(-march=native) would die of an illegal instruction on a node without the builder's
instruction sets. So `--variants DIR` builds one module per x86-64 level
(VARIANTS: AVX-512 with BF16 and VNNI, AVX-512, AVX2, baseline; the baseline alone on other
architectures) without loading any, and TESSERA_CPU_KERNELS_PREBUILT=DIR loads the
most capable one whose instruction sets this CPU has (/proc/cpuinfo's flags).
TESSERA_CPU_KERNELS_PREBUILT=<file> loads that one module file as it is.

Where they cannot be built (no compiler), load() returns None and the model runner
falls back to plain torch ops, with one warning. Whether to use them at all is
EngineConfig.cpu_kernels (the engine's --cpu-kernels flag), decided by the model runner.
"""
from __future__ import annotations

import logging
import os
import pathlib
import sys
import threading

log = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).with_name("csrc")
_lock = threading.Lock()
_modules: dict = {}  # prebuilt path (None: built here) -> module, or None where it failed
_errors: dict = {}


_NAME = "tessera_cpu_kernels"

# /proc/cpuinfo flags of the x86-64 micro-architecture levels (the psABI's v2, v3, v4)
_X86_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_X86_V3 = _X86_V2 | {"abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"}

# The builds `--variants` makes, most capable first: name, compiler target flags, the
# /proc/cpuinfo flags a CPU must have to run it. "generic" is the compiler's default
# target (the architecture's baseline: the kernels' scalar paths).
VARIANTS: tuple[tuple[str, tuple[str, ...], frozenset[str]], ...] = (
    ("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"), _X86_V4 | {"avx512_bf16", "avx512_vnni"}),
    ("avx512", ("-march=x86-64-v4",), _X86_V4),
    ("avx2", ("-march=x86-64-v3",), _X86_V3),
    ("generic", (), frozenset()),
)


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags (the first "flags" line of /proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def buildable_variants(machine: str | None = None) -> list[str]:
    """The variants a compiler for this architecture can target: all on x86-64, else "generic"."""
    machine = (machine or os.uname().machine).lower()
    return [v[0] for v in VARIANTS] if machine in ("x86_64", "amd64") else ["generic"]


def choose_variant(available: list[str], flags: frozenset[str]) -> str | None:
    """The most capable of `available` whose instruction sets `flags` has; None if none runs here."""
    for name, _, needs in VARIANTS:
        if name in available and needs <= flags:
            return name
    return None


def _variant_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Variant name -> module file, for the builds `--variants` left in `directory`."""
    files = {}
    for path in directory.glob(f"{_NAME}_*.so"):
        name = path.name.split(".", 1)[0][len(_NAME) + 1:]
        if any(name == v[0] for v in VARIANTS):
            files[name] = path
    return files


def _import_module_file(path: pathlib.Path):
    """A built extension module file, imported as it is (its module name is the file's stem)."""
    import importlib.util

    import torch  # noqa: F401  (the module links against torch's libraries)

    spec = importlib.util.spec_from_file_location(path.name.split(".", 1)[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_prebuilt(prebuilt: str):
    """A build made elsewhere: a module file, or a `--variants` directory (the best variant this CPU runs)."""
    path = pathlib.Path(prebuilt)
    if not path.is_dir():
        return _import_module_file(path)
    files = _variant_files(path)
    flags = cpu_flags()
    name = choose_variant(sorted(files), flags)
    if name is None:
        raise RuntimeError(f"{path} has no build of the CPU kernels this CPU can run (it has: {sorted(files)})")
    module = _import_module_file(files[name])
    module.variant = name
    log.info("fused CPU kernels: prebuilt variant chosen for this CPU",
             extra={"variant": name, "available": sorted(files)})
    return module


def _sources() -> list[str]:
    """Every .cpp of csrc/ (one per kernel family, and the bindings): compiled into one module."""
    return [str(p) for p in sorted(_CSRC.glob("*.cpp"))]


def _headers() -> list[str]:
    """The headers the sources include (csrc/*.h): a change to one rebuilds the module too."""
    return [str(p) for p in sorted(_CSRC.glob("*.h"))]


def _venv_bin_on_path() -> None:
    """ninja comes from the venv (requirements); a venv's python run by path has no
    activated PATH, so put its bin directory first for torch's build step."""
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def _build_variant(name: str, out_dir: str) -> list[pathlib.Path]:
    import tempfile

    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    target = next(v[1] for v in VARIANTS if v[0] == name)
    # -g0: Python's default CFLAGS ask for debug info (slower builds, 10x bigger modules).
    # depends: build_ext skips a module already in out_dir that is newer than its sources
    # and these, so the headers count as its sources do.
    ext = CppExtension(f"{_NAME}_{name}", _sources(), depends=_headers(),
                       extra_compile_args=["-O3", "-g0", *target, "-fopenmp"], extra_link_args=["-fopenmp"])
    with tempfile.TemporaryDirectory(prefix="tessera-kernels-") as tmp:
        setup(name=f"{_NAME}_{name}", ext_modules=[ext], cmdclass={"build_ext": BuildExtension},
              script_args=["-q", "build_ext", "--build-lib", out_dir, "--build-temp", tmp])
    return sorted(pathlib.Path(out_dir).glob(f"{_NAME}_{name}.*.so"))


def build_variants(out_dir: str | os.PathLike, names: list[str] | None = None) -> list[pathlib.Path]:
    """Build each variant (default: every one this architecture can target) into out_dir as
    `tessera_cpu_kernels_<variant>.*.so`, without loading any (the build machine need not
    run them), one process per variant in parallel. setuptools' build_ext with torch's
    BuildExtension, so the modules get torch's own compile flags."""
    from concurrent.futures import ProcessPoolExecutor

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = names or buildable_variants()
    _venv_bin_on_path()
    with ProcessPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        return [path for paths in pool.map(_build_variant, names, [str(out)] * len(names)) for path in paths]


def _build(prebuilt: str | None):
    if prebuilt:
        return _load_prebuilt(prebuilt)
    _venv_bin_on_path()
    from torch.utils.cpp_extension import load

    # The cached build is ninja's: it recompiles a source when it, or a header it includes
    # (gcc's dependency files), changes, and relinks the module.
    return load(name=_NAME, sources=_sources(),
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                verbose=os.environ.get("TESSERA_CPU_KERNELS_VERBOSE") == "1")


def load(prebuilt: str | None = None):
    """The compiled module (built for this CPU, or `prebuilt`: a module file or a `--variants`
    directory), or None where it cannot be built or loaded (the error is in _errors)."""
    with _lock:
        if prebuilt not in _modules:
            try:
                _modules[prebuilt] = _build(prebuilt)
                log.info("fused CPU kernels loaded", extra={"file": getattr(_modules[prebuilt], "__file__", None)})
            except Exception as e:  # no compiler, headers or ninja: plain torch ops instead
                log.warning("fused CPU kernels unavailable, using torch ops", extra={"error": str(e)[-500:]})
                _modules[prebuilt], _errors[prebuilt] = None, e
        return _modules[prebuilt]


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    # --variants DIR: build every variant for this architecture into DIR (for
    # TESSERA_CPU_KERNELS_PREBUILT=DIR), then load the one this CPU would use, as a check
    prebuilt = None
    if "--variants" in sys.argv:
        at = sys.argv.index("--variants") + 1
        if at >= len(sys.argv) or sys.argv[at].startswith("-"):
            sys.exit("usage: python -m tessera_engine.cpu_kernels [--require] --variants DIR "
                     "(--variants needs the directory to build into)")
        out_dir = sys.argv[at]
        print("tessera CPU kernels: built", ", ".join(p.name for p in build_variants(out_dir)))
        prebuilt = out_dir
    mod = load(prebuilt)
    print("tessera CPU kernels:", f"loaded ({getattr(mod, 'variant', 'native')})" if mod is not None else
          f"NOT available, the engine uses torch ops: {str(_errors.get(prebuilt))[-2000:]}")
    # --require: fail where they cannot be built (a build that must have them)
    sys.exit(1 if mod is None and "--require" in sys.argv else 0)
