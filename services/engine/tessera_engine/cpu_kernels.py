"""tessera's fused CPU kernels (csrc/cpu_kernels.cpp), built on first use.

torch.utils.cpp_extension compiles them for the machine they run on (gcc and
the Python headers; ninja from requirements) into TORCH_EXTENSIONS_DIR
(default ~/.cache/torch_extensions), once (~30 s): later processes load the
cached build in well under a second. `python -m tessera_engine.cpu_kernels`
builds them ahead of time (make install does). TESSERA_CPU_KERNELS_PREBUILT=<file>
loads a module built elsewhere instead (the engine image: built in its builder
stage, which has gcc, copied into the runtime stage, which has none).

Where they cannot be built (no compiler), or with --cpu-kernels false
(TESSERA_CPU_KERNELS=0), get()
returns None and the model falls back to plain torch ops, with one warning.
"""
from __future__ import annotations

import logging
import os
import pathlib
import sys
import threading

log = logging.getLogger(__name__)

_SOURCE = pathlib.Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
_lock = threading.Lock()
_state: dict = {}


def enabled() -> bool:
    """TESSERA_CPU_KERNELS (the engine's --cpu-kernels flag sets it): on unless 0/false/no/off."""
    return os.environ.get("TESSERA_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _load_prebuilt(path: str):
    """A build made elsewhere (the engine image builds it in its builder stage, which has
    gcc; the runtime stage has none): the extension module file, imported as it is."""
    import importlib.util

    import torch  # noqa: F401  (the module links against torch's libraries)

    spec = importlib.util.spec_from_file_location("tessera_cpu_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build():
    prebuilt = os.environ.get("TESSERA_CPU_KERNELS_PREBUILT")
    if prebuilt:
        return _load_prebuilt(prebuilt)
    # ninja comes from the venv (requirements); a venv's python run by path has no
    # activated PATH, so put its bin directory first for torch's build step
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import load

    return load(name="tessera_cpu_kernels", sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                verbose=os.environ.get("TESSERA_CPU_KERNELS_VERBOSE") == "1")


def get():
    """The compiled module, or None where it is turned off or cannot be built."""
    if not enabled():
        return None
    with _lock:
        if "module" not in _state:
            try:
                _state["module"] = _build()
                log.info("fused CPU kernels loaded", extra={"file": getattr(_state["module"], "__file__", None)})
            except Exception as e:  # no compiler, headers or ninja: plain torch ops instead
                log.warning("fused CPU kernels unavailable, using torch ops", extra={"error": str(e)[-500:]})
                _state["module"], _state["error"] = None, e
        return _state["module"]


if __name__ == "__main__":
    import shutil

    logging.basicConfig(level=logging.WARNING)
    mod = get()
    # --copy-to PATH: put the built module file there (for TESSERA_CPU_KERNELS_PREBUILT)
    if mod is not None and "--copy-to" in sys.argv:
        shutil.copy(mod.__file__, sys.argv[sys.argv.index("--copy-to") + 1])
    print("tessera CPU kernels:", "built" if mod is not None else
          "off (TESSERA_CPU_KERNELS=0)" if not enabled() else
          f"NOT available, the engine uses torch ops: {str(_state.get('error'))[-2000:]}")
    # --require: fail where they cannot be built (a build that must have them)
    sys.exit(1 if mod is None and enabled() and "--require" in sys.argv else 0)
