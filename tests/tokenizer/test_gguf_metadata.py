"""`gguf_metadata.read_metadata`: a GGUF header's values equal to what gguf-py's GGUFReader reads,
on the default model's file, on a written file with every value type, and big-endian (handed to
gguf-py)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from tessera.common.model_source import resolve_model
from tessera_tokenizer.gguf_metadata import read_metadata

pytestmark = pytest.mark.unit


def gguf_py(path) -> dict:
    reader = GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def write(path, endianess=GGUFEndian.LITTLE) -> None:
    writer = GGUFWriter(str(path), "llama", endianess=endianess)
    for kind, value in ((GGUFValueType.UINT8, 200), (GGUFValueType.INT8, -100), (GGUFValueType.UINT16, 60000),
                        (GGUFValueType.INT16, -30000), (GGUFValueType.UINT32, 4_000_000_000),
                        (GGUFValueType.INT32, -2_000_000_000), (GGUFValueType.FLOAT32, 0.5),
                        (GGUFValueType.UINT64, 2**63 + 5), (GGUFValueType.INT64, -(2**62)),
                        (GGUFValueType.FLOAT64, 1e-300), (GGUFValueType.BOOL, True)):
        writer.add_key_value(f"test.{kind.name.lower()}", value, kind)
    writer.add_string("test.string", "héllo ▁ 🎉")
    writer.add_array("test.strings", ["", "a", "  ", "日本", "<end_of_turn>"])
    writer.add_array("test.floats", [0.25, -1.5, 3.0])
    writer.add_key_value("test.ints", [1, -2, 3], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    writer.add_key_value("test.flags", [True, False], GGUFValueType.ARRAY, sub_type=GGUFValueType.BOOL)
    writer.add_tensor("w", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_default_model_file():
    path = resolve_model(None).path
    ours = read_metadata(path)
    assert ours == gguf_py(path)
    assert len(ours["tokenizer.ggml.tokens"]) == 49152 and ours["general.architecture"] == "llama"


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_type(tmp_path, endianess):
    path = tmp_path / "all.gguf"
    write(path, endianess)
    ours = read_metadata(path)
    assert ours == gguf_py(path)
    assert ours["test.uint64"] == 2**63 + 5 and ours["test.bool"] is True
    assert ours["test.strings"] == ["", "a", "  ", "日本", "<end_of_turn>"]
    assert ours["test.ints"] == [1, -2, 3] and ours["test.flags"] == [True, False]


def test_not_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_metadata(path)
