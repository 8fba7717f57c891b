"""Which BLAS serves MLX's float32 matmuls on Linux.

The Linux `mlx[cpu]` wheel links the reference (netlib) BLAS: a scalar loop, so
a matmul costs the same per row whatever the number of rows. Batched decode
and prefill then gain nothing over one token at a time. MKL, from the `mkl`
wheel (a dependency on Linux x86_64), runs a 1024x4096 float32 matmul on one
thread 6.6x faster for one row, 12x for 8 rows and 23x for 256 (measured here).

MLX's float32 matmul calls `cblas_sgemm`. The dynamic linker binds that symbol
when libmlx.so loads, and it searches the global scope before libmlx's own
bundled BLAS. So loading libmkl_rt with RTLD_GLOBAL *before the first
`import mlx`* makes every MLX matmul in the process run on MKL; after that
import the choice is fixed. That is why `select()` runs first in the CLI,
before anything imports the engine.

MKL runs sequential (MKL_THREADING_LAYER=SEQUENTIAL unless the environment
says otherwise): MLX computes on one thread and the streaming reads need the
other core, and spinning OpenMP workers would take it from them.

Quantized matmuls do not use BLAS (MLX has its own kernels), so this matters
for float models and for float activations against float weights. macOS uses
Accelerate, which MLX links itself; there is nothing to choose.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

BlasChoice = Literal["auto", "mkl", "reference"]

_loaded: ctypes.CDLL | None = None


class BlasError(Exception):
    """The requested BLAS cannot be used in this process."""


def mkl_library() -> Path | None:
    """libmkl_rt from the installed `mkl` wheel, or None when it isn't installed."""
    try:
        files = metadata.files("mkl") or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.startswith("libmkl_rt.so"):
            path = Path(str(file.locate())).resolve()
            if path.is_file():
                return path
    return None


def select(choice: BlasChoice) -> str:
    """Load the chosen BLAS for MLX; returns what will serve its matmuls.

    "auto" is MKL when the wheel is installed (Linux), else the bundled one.
    Raises BlasError when "mkl" is asked for and cannot be had.
    """
    global _loaded
    if sys.platform == "darwin":
        if choice == "mkl":
            raise BlasError("blas 'mkl' is for Linux; on macOS MLX uses Accelerate")
        return describe()
    if choice == "reference" or _loaded is not None:
        return describe()
    library = mkl_library() if platform.machine() in ("x86_64", "AMD64") else None
    if library is None:
        if choice == "mkl":
            raise BlasError("blas 'mkl' needs the mkl package (pip install mkl), Linux x86_64")
        return describe()
    if "mlx.core" in sys.modules:
        if choice == "mkl":
            raise BlasError("blas 'mkl' must be chosen before mlx is imported")
        log.warning("mlx was imported before the BLAS was chosen: keeping the reference BLAS")
        return describe()
    os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
    try:
        _loaded = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        if choice == "mkl":
            raise BlasError(f"cannot load {library}: {exc}") from None
        log.warning("cannot load MKL (%s): keeping the reference BLAS", exc)
    return describe()


def describe() -> str:
    """The BLAS that serves cblas_sgemm in this process: mkl, accelerate or reference."""
    if sys.platform == "darwin":
        return "accelerate"
    return "mkl" if _loaded is not None else "reference"
