"""The GGUF container: its header, its tensor types, and its metadata as plain Python.

`mx.load` parses GGUF itself; this module reads the header on its own first,
so an unsupported tensor type is refused naming the tensor and its type, and
a corrupt file is one line rather than an MLX error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx

from flashserve.engine.weights.model import ModelLoadError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


class GGUFError(ModelLoadError, ValueError):
    """A GGUF file this module cannot turn into a model; the message is one line."""


# ggml tensor types by id; mx.load keeps the first group packed (affine, group 32)
# or plain, and dequantizes the second group to float16.
# fmt: off
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
}
NATIVE_TYPES = {0, 1, 2, 3, 8}
DEQUANTIZED_TYPES = {10, 12, 14, 30}  # Q2_K, Q4_K, Q6_K, BF16: become float16

# GGUF metadata value types: struct format of the fixed-size ones
_GGUF_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}
# fmt: on
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """Tensor name -> ggml type id, read from the GGUF header (mx.load does not report
    types and silently drops tensors of types it does not know)."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            if version < 2:
                raise GGUFError(f"{path}: GGUF version {version} is too old (need 2 or newer)")
            pos = 24

            def skip_value(kind: int, pos: int) -> int:
                if kind in _GGUF_SCALARS:
                    return pos + struct.calcsize(_GGUF_SCALARS[kind])
                if kind == _GGUF_STRING:
                    return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
                if kind == _GGUF_ARRAY:
                    inner, count = struct.unpack_from("<IQ", buf, pos)
                    pos += 12
                    if inner in _GGUF_SCALARS:
                        return pos + count * struct.calcsize(_GGUF_SCALARS[inner])
                    for _ in range(count):
                        pos = skip_value(inner, pos)
                    return pos
                raise GGUFError(f"{path}: corrupt GGUF header (metadata value type {kind})")

            for _ in range(n_kv):
                pos = skip_value(_GGUF_STRING, pos)
                (kind,) = struct.unpack_from("<I", buf, pos)
                pos = skip_value(kind, pos + 4)
            types = {}
            for _ in range(n_tensors):
                (length,) = struct.unpack_from("<Q", buf, pos)
                name = bytes(buf[pos + 8 : pos + 8 + length]).decode("utf-8")
                pos += 8 + length
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                pos += 4 + 8 * n_dims
                (kind,) = struct.unpack_from("<I", buf, pos)
                pos += 4 + 8
                types[name] = kind
        except (struct.error, UnicodeDecodeError, IndexError, RecursionError) as exc:
            raise GGUFError(f"{path}: corrupt or truncated GGUF header") from exc
    return types


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors and metadata of a GGUF file, with one-line errors for bad files."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic {magic!r})")
    types = gguf_tensor_types(path)
    for name, kind in types.items():
        if kind not in NATIVE_TYPES | DEQUANTIZED_TYPES:
            supported = ", ".join(
                GGML_TYPE_NAMES[t] for t in sorted(NATIVE_TYPES | DEQUANTIZED_TYPES)
            )
            raise GGUFError(
                f"{path}: tensor {name} has type {GGML_TYPE_NAMES.get(kind, kind)}, "
                f"which is not supported (supported: {supported})"
            )
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # mlx raises RuntimeError/ValueError with its own wording
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GGUFError(f"{path}: cannot read GGUF: {detail}") from exc
    missing = [name for name in types if name not in weights]
    if missing:
        raise GGUFError(f"{path}: MLX could not read tensor {missing[0]}")
    dequantized = [name for name, kind in types.items() if kind in DEQUANTIZED_TYPES]
    if dequantized:
        log.warning(
            "%d GGUF tensors (%s) are not kept packed: MLX dequantizes them to float16",
            len(dequantized),
            ", ".join(sorted({GGML_TYPE_NAMES[types[n]] for n in dequantized})),
        )
    return weights, metadata


def meta_value(value: Any) -> Any:
    """GGUF metadata as plain Python: mx.load returns scalars and numeric lists as arrays."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def meta(metadata: dict, key: str, default: Any = None) -> Any:
    return meta_value(metadata[key]) if key in metadata else default


def require(metadata: dict, key: str) -> Any:
    if key not in metadata:
        raise GGUFError(f"GGUF metadata lacks {key}")
    return meta_value(metadata[key])


# --------------------------------------------------------------------------- config
