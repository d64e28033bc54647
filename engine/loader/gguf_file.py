"""A GGUF file's metadata and tensor index, read with `struct` from a memory map.

Why not `gguf.GGUFReader`: it builds a numpy view for every part of every field, and a
tokenizer's vocabulary and merges are some 100,000 strings: seconds of CPU at every engine
and router start, most of a router's. This reads the same format (versions 2 and 3,
little-endian) with one `struct` call per value, and gives each tensor's data as `GGUFReader`
shapes it (quantized types as bytes, rows last), so `gguf.quants.dequantize` makes the same
floats of it (tests/engine/test_loaders.py compares the two readers).

Format (github.com/ggml-org/ggml, docs/gguf.md): magic, version, tensor count, metadata count;
the metadata as (key, value type, value); each tensor's (name, dims, type, offset); then the
tensor data, from the next multiple of `general.alignment` (32 by default).
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
# Value types with a fixed size: struct format of one value.
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# ggml tensor types read as plain arrays (GGUFReader's list); all others as bytes.
PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GGUFError(ValueError):
    """Not a GGUF file this reader takes (magic, version, byte order, a truncated field)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]       # as stored: the innermost (row) dimension first
    ggml_type: int
    offset: int                 # of its data, from the start of the file


class GGUFFile:
    """`fields`: metadata key -> str, number, or list of them (arrays); `tensors`: in file order."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 24:
                raise GGUFError(f"{path}: not a GGUF file (shorter than its header)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} (this reader takes 2 and 3, little-endian)")
        self._pos = 24
        self.fields: dict[str, object] = {}
        try:
            for _ in range(n_fields):
                key = self._string()
                (vtype,) = self._unpack("<I")
                self.fields[key] = self._value(vtype)
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                (n_dims,) = self._unpack("<I")
                dims = self._unpack(f"<{n_dims}Q")
                ggml_type, offset = self._unpack("<IQ")
                infos.append((name, dims, ggml_type, offset))
        except struct.error as err:
            raise GGUFError(f"{path}: truncated or corrupt metadata ({err})") from None
        align = int(self.fields.get("general.alignment", 32))  # type: ignore[call-overload]
        start = -(-self._pos // align) * align
        self.tensors = [TensorInfo(n, tuple(d), t, start + o) for n, d, t, o in infos]
        for t in self.tensors:
            if t.offset + self.nbytes(t) > len(buf):
                raise GGUFError(f"{path}: tensor {t.name} ends past the end of the file (truncated)")

    @staticmethod
    def nbytes(t: TensorInfo) -> int:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        except ValueError:
            raise GGUFError(f"tensor {t.name}: unknown ggml type {t.ggml_type}") from None
        return int(np.prod(t.dims)) * size // block

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        raw = self._map[self._pos:self._pos + n]
        if len(raw) != n:
            raise struct.error("string past the end of the file")
        self._pos += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> object:
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            etype, count = self._unpack("<IQ")
            if etype == STRING:
                return [self._string() for _ in range(count)]
            if etype in SCALARS:
                return list(self._unpack(f"<{count}{SCALARS[etype]}"))
            return [self._value(etype) for _ in range(count)]   # arrays of arrays
        if vtype in SCALARS:
            return self._unpack("<" + SCALARS[vtype])[0]
        raise struct.error(f"unknown value type {vtype}")

    def data(self, t: TensorInfo) -> np.ndarray:
        """The tensor's data (read-only, on the map), shaped as GGUFReader's `tensor.data`."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        shape = tuple(reversed(t.dims))
        if t.ggml_type in PLAIN:
            return np.frombuffer(self._map, PLAIN[t.ggml_type], int(np.prod(t.dims)), t.offset).reshape(shape)
        return np.frombuffer(self._map, np.uint8, self.nbytes(t), t.offset).reshape(
            quant_shape_to_byte_shape(shape, GGMLQuantizationType(t.ggml_type)))
