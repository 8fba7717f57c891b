"""A fingerprint of a model's weights: what makes a cached prompt state reusable.

The prompt cache's SSD tier keeps states across restarts; a state computed
by other weights must never be reused, even under the same model name. Hashing
every byte of a 10 GB model at each start would cost a full read, so large
files are sampled: their size and 8 spread 64 KiB pieces, plus the config
and the activation dtype. Small files (config, tiny models) are hashed whole.
Re-quantizing, re-preparing, or swapping weights changes sizes or sampled
bytes; an edit of a few bytes between the samples of a large file would go
unnoticed here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_WHOLE = 1 << 20  # files up to this size are hashed whole
_SAMPLES = 8
_SAMPLE = 64 * 1024


def weights_fingerprint(path: Path | None, config: dict, dtype: str) -> str:
    """Hex digest identifying the weights at `path` as loaded (config, dtype)."""
    digest = hashlib.blake2b(digest_size=20)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(dtype.encode())
    if path is None:
        return digest.hexdigest()
    path = Path(path)
    files = [path] if path.is_file() else _files(path)
    for file in files:
        size = file.stat().st_size
        name = file.name if file == path else str(file.relative_to(path))
        digest.update(f"{name}\0{size}\0".encode())
        with open(file, "rb") as f:
            if size <= _WHOLE:
                digest.update(f.read())
                continue
            step = (size - _SAMPLE) // (_SAMPLES - 1)
            for i in range(_SAMPLES):
                f.seek(i * step)
                digest.update(f.read(_SAMPLE))
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
