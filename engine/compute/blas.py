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

MKL runs on one thread except while a prompt chunk computes: a decode step's
float matmuls are too small to split, and the streaming reads want the other
core. Prefill is one large matmul after another, and on one thread it used
one of the machine's cores (issue 42), so `prompt_threads()` gives MKL every
core the process may use (compute/cores.py) around a prompt chunk's work
(compute/prompt_matmul.py). Its threads come from the Intel OpenMP runtime
(the `intel-openmp` wheel, a dependency of `mkl`) with KMP_BLOCKTIME=0: a
worker sleeps as soon as a matmul ends instead of spinning for the default
200 ms on the core the streaming reader or the decode kernel needs. Without
that runtime, or when MKL_THREADING_LAYER is set in the environment, MKL
threads as the environment says (SEQUENTIAL by default).

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
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

BlasChoice = Literal["auto", "mkl", "reference"]

_loaded: ctypes.CDLL | None = None
_threaded = False  # MKL may run more than one thread (the OpenMP layer was loaded)


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
    global _threaded
    if "MKL_THREADING_LAYER" not in os.environ and (library.parent / "libiomp5.so").is_file():
        # Read when MKL and the OpenMP runtime first initialize, after this.
        os.environ["MKL_THREADING_LAYER"] = "INTEL"
        os.environ.setdefault("KMP_BLOCKTIME", "0")
    os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
    try:
        _loaded = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        if choice == "mkl":
            raise BlasError(f"cannot load {library}: {exc}") from None
        log.warning("cannot load MKL (%s): keeping the reference BLAS", exc)
        return describe()
    _threaded = os.environ["MKL_THREADING_LAYER"].upper() != "SEQUENTIAL"
    if _threaded:
        _set_threads(1)  # one thread outside prompt chunks (the module docstring says why)
    return describe()


def _set_threads(n: int) -> None:
    assert _loaded is not None
    _loaded.MKL_Set_Num_Threads(ctypes.c_int(n))


def mkl_threads() -> int:
    """Threads MKL may use for its next call here (1 without a threaded MKL)."""
    if _loaded is None or not _threaded:
        return 1
    return int(_loaded.MKL_Get_Max_Threads())


def threaded() -> bool:
    """Whether MKL serves MLX's matmuls with a threading layer (prompt_threads() can widen it)."""
    return _loaded is not None and _threaded


@contextmanager
def prompt_threads(n: int) -> Iterator[None]:
    """MKL on `n` threads inside the block (a prompt chunk's evaluation), one after it.

    MKL's count is process-wide: MLX calls the BLAS from its own stream
    thread, so a thread-local count set here would not reach it (a decode
    step MLX computes meanwhile may take the threads too; its matmuls are
    too small for MKL to split). A no-op without a threaded MKL (macOS:
    Accelerate threads itself).
    """
    if not threaded() or n <= 1:
        yield
        return
    _set_threads(n)
    try:
        yield
    finally:
        _set_threads(1)


def describe() -> str:
    """The BLAS that serves cblas_sgemm in this process: mkl, accelerate or reference."""
    if sys.platform == "darwin":
        return "accelerate"
    return "mkl" if _loaded is not None else "reference"
