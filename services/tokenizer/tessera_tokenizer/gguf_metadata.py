"""A GGUF file's metadata (its key/value header) as Python values, read fast.

The tokenizer needs only the header, but that holds the whole vocabulary: three arrays of
262144 entries for Gemma 3. gguf-py's `GGUFReader` builds a numpy view per element of every
array (~20 s for Gemma's header on this machine's cores); this reads the same values with one
`struct` call per string and one `numpy.frombuffer` per numeric array (~0.3 s).
A file this does not cover (big-endian, GGUF v1) goes to `GGUFReader`, which does.
"""
from __future__ import annotations

import mmap
import pathlib
import struct
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF's fixed-size value types: (struct format, numpy dtype), little-endian.
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}


def read_metadata(path: str | pathlib.Path) -> dict[str, Any]:
    """{key: value} of the file's header: str, int, float, bool, or a list of them."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
        version = struct.unpack_from("<I", data, 4)[0]
        if version not in (2, 3):  # big-endian files read as a huge version; v1 counted in 32 bits
            return _read_with_gguf_py(path)
        count = struct.unpack_from("<Q", data, 16)[0]
        reader = _Reader(data, 24)
        meta = {}
        for _ in range(count):
            key = reader.string()
            meta[key] = reader.value(reader.u32())
        return meta


class _Reader:
    """Values read from `data` at a moving offset."""

    def __init__(self, data: mmap.mmap, offset: int) -> None:
        self.data, self.offset = data, offset

    def u32(self) -> int:
        (value,) = struct.unpack_from("<I", self.data, self.offset)
        self.offset += 4
        return value

    def u64(self) -> int:
        (value,) = struct.unpack_from("<Q", self.data, self.offset)
        self.offset += 8
        return value

    def string(self) -> str:
        size = self.u64()
        start, self.offset = self.offset, self.offset + size
        return self.data[start:self.offset].decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, size = self.u32(), self.u64()
            if item == _STRING:
                return [self.string() for _ in range(size)]
            if item == _ARRAY:
                return [self.value(self.u32()) for _ in range(size)]  # nested arrays: none seen in practice
            dtype = _scalar(item)[1]
            values = np.frombuffer(self.data, dtype=dtype, count=size, offset=self.offset)
            self.offset += values.nbytes
            return values.tolist()
        fmt = _scalar(kind)[0]
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value


def _scalar(kind: int) -> tuple[str, Any]:
    try:
        return _SCALARS[kind]
    except KeyError:
        raise ValueError(f"GGUF metadata: unknown value type {kind}") from None


def _read_with_gguf_py(path: str | pathlib.Path) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
