"""The GGUF container: header, metadata as plain Python, tensor records over a memory map.

Read here rather than with `mx.load`: MLX expands K-quants to float16 and
refuses Q3_K, Q5_x and the IQ types, while every block this package converts
(weights/gguf/quants.py) must arrive as raw bytes. A tensor is a read-only
numpy view of the mapped file, so nothing is read before it is converted,
and one corrupt or truncated file is one line naming what is wrong.
"""

from __future__ import annotations

import logging
import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from flashserve.engine.weights.model import ModelLoadError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


class GGUFError(ModelLoadError, ValueError):
    """A GGUF file this package cannot turn into a model; the message is one line."""


# ggml tensor types: id -> (name, elements per block, bytes per block). Ids that
# llama.cpp retired (4, 5, 31-33, 36-38) are absent; an unknown id is refused.
# fmt: off
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}

# GGUF metadata value types: struct format of the fixed-size ones
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}
_NUMPY = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
    11: "<i8", 12: "<f8",
}
# fmt: on
_STRING, _ARRAY = 8, 9


def type_name(kind: int) -> str:
    return GGML_TYPES[kind][0] if kind in GGML_TYPES else f"type {kind}"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's record: numpy-order shape (slowest dimension first), ggml type, bytes."""

    name: str
    kind: int
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.kind)


class _Header:
    """A cursor over the mapped header; every read past the end is a struct.error."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        if self.pos + length > len(self.buf):
            raise struct.error("string past the end")
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.unpack("<IQ")
            if inner in _NUMPY:
                # Numeric arrays (token scores and types: 100k+ entries) in one read.
                size = np.dtype(_NUMPY[inner]).itemsize * count
                if self.pos + size > len(self.buf):
                    raise struct.error("array past the end")
                values = np.frombuffer(self.buf, _NUMPY[inner], count, self.pos).tolist()
                self.pos += size
                return values
            return [self.value(inner) for _ in range(count)]
        raise struct.error(f"metadata value type {kind}")


class GGUFFile:
    """A GGUF file's metadata and tensor records; `raw(name)` maps a tensor's bytes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
                if magic != GGUF_MAGIC:
                    raise GGUFError(f"{self.path}: not a GGUF file (bad magic {magic!r})")
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    self.metadata, self.tensors = self._parse(buf)
                    self.size = len(buf)
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot read: {exc.strerror or exc}") from exc
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")

    def _parse(self, buf: mmap.mmap) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        header = _Header(buf)
        try:
            header.pos = 4
            version, n_tensors, n_kv = header.unpack("<IQQ")
            if version < 2:
                raise GGUFError(f"{self.path}: GGUF version {version} is too old (need 2 or newer)")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = header.string()
                (kind,) = header.unpack("<I")
                metadata[key] = header.value(kind)
            records = []
            for _ in range(n_tensors):
                name = header.string()
                (n_dims,) = header.unpack("<I")
                dims = header.unpack(f"<{n_dims}Q")
                kind, offset = header.unpack("<IQ")
                records.append((name, dims, kind, offset))
        except (struct.error, UnicodeDecodeError, RecursionError, MemoryError) as exc:
            raise GGUFError(f"{self.path}: corrupt or truncated GGUF header") from exc
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
        start = -(-header.pos // alignment) * alignment
        tensors = {}
        for name, dims, kind, offset in records:
            tensors[name] = self._record(name, dims, kind, start + offset, len(buf))
        return metadata, tensors

    def _record(
        self, name: str, dims: tuple[int, ...], kind: int, offset: int, size: int
    ) -> TensorInfo:
        if kind not in GGML_TYPES:
            raise GGUFError(f"{self.path}: tensor {name} has unknown ggml type {kind}")
        _, block, block_bytes = GGML_TYPES[kind]
        if not dims or dims[0] % block:
            raise GGUFError(
                f"{self.path}: tensor {name} rows of {dims[0] if dims else 0} elements do not "
                f"fill whole {type_name(kind)} blocks of {block}"
            )
        nbytes = prod(dims[1:]) * (dims[0] // block) * block_bytes
        if offset + nbytes > size:
            raise GGUFError(
                f"{self.path}: truncated GGUF: tensor {name} ends past the end of the file"
            )
        # ggml lists dimensions fastest first; numpy wants them slowest first.
        return TensorInfo(name, kind, tuple(int(d) for d in reversed(dims)), offset, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, a read-only view of the mapped file (nothing read yet)."""
        info = self.tensors[name]
        return self._data[info.offset : info.offset + info.nbytes]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def meta(metadata: dict, key: str, default: Any = None) -> Any:
    return metadata.get(key, default)


def require(metadata: dict, key: str) -> Any:
    if key not in metadata:
        raise GGUFError(f"GGUF metadata lacks {key}")
    return metadata[key]
