"""Build flashserve's one compiled part: the CPU quantized matmul (engine/compute/csrc).

Everything else about the package is in pyproject.toml. The extension is an
MLX primitive bound with nanobind (MLX's documented extension mechanism),
compiled against the headers and libmlx of the `mlx[cpu]` wheel that
pyproject.toml's [build-system] brings into the build environment; nanobind
is compiled in from its own sources (src/nb_combined.cpp), so no CMake is
needed, only a C++20 compiler.

It is built on Linux x86-64 only. Elsewhere, and wherever the build fails (no
compiler, no headers), the package installs without it and the engine uses
MLX's own kernel (engine/compute/qmm.py says so in one log line). Set
FLASHSERVE_NO_EXTENSION=1 to skip it on purpose.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = [
    "engine/compute/csrc/qmm_module.cpp",
    "engine/compute/csrc/qmm_kernels.cpp",
    "engine/compute/csrc/qmm_avx512.cpp",
    "engine/compute/csrc/qmm_avx512_int.cpp",
    "engine/compute/csrc/qmm_avx2_int.cpp",
    "engine/compute/csrc/qmm_int_prepare.cpp",
    "engine/compute/csrc/step_ops.cpp",
    "engine/compute/csrc/step_sdpa.cpp",
    "engine/compute/csrc/step_sdpa_quant.cpp",
    "engine/compute/csrc/step_cache.cpp",
    "engine/compute/csrc/prompt_sdpa.cpp",
    "engine/compute/csrc/prompt_dequant.cpp",
    "engine/compute/csrc/prompt_qgemm.cpp",
    "engine/compute/csrc/prompt_qgemm_avx512.cpp",
    "engine/compute/csrc/prompt_qgemm_avx2.cpp",
    "engine/compute/csrc/expert_ops.cpp",
]
# The headers and the included tile bodies: build_ext compares these with the
# built file as it does the sources, so an edit to one alone rebuilds it.
DEPENDS = sorted(
    str(p)
    for p in (Path(__file__).resolve().parent / "engine/compute/csrc").iterdir()
    if p.suffix in (".h", ".inc")
)


def _wanted() -> bool:
    return (
        sys.platform == "linux"
        and platform.machine() in ("x86_64", "AMD64")
        and os.environ.get("FLASHSERVE_NO_EXTENSION") != "1"
    )


def _mlx_root() -> Path:
    """The folder holding MLX's include/ and lib/ (the mlx-cpu wheel puts them in mlx/)."""
    import mlx

    for location in mlx.__path__:
        root = Path(location)
        if (root / "include" / "mlx" / "version.h").is_file() and (root / "lib").is_dir():
            return root
    raise RuntimeError("MLX's C++ headers were not found (is mlx-cpu installed?)")


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: a failed build leaves MLX's kernel in use."""

    def finalize_options(self) -> None:
        super().finalize_options()
        # Compile the five sources at once (nanobind's alone takes ~20 s).
        if self.parallel is None:
            self.parallel = True

    def build_extension(self, ext: Extension) -> None:
        try:
            import nanobind

            nb = Path(nanobind.__file__).parent
            mlx_root = _mlx_root()
            ext.sources = [*SOURCES, str(nb / "src" / "nb_combined.cpp")]
            ext.include_dirs += [
                str(nb / "include"),
                str(nb / "ext" / "robin_map" / "include"),
                str(mlx_root / "include"),
                "engine/compute/csrc",
            ]
            ext.library_dirs += [str(mlx_root / "lib")]
            super().build_extension(ext)
        except Exception as exc:  # any failure: install without the fast path
            sys.stderr.write(
                f"flashserve: the fast quantized matmul was not built ({exc}); "
                "MLX's kernel will be used\n"
            )


def _extensions() -> list[Extension]:
    if not _wanted():
        return []
    return [
        Extension(
            "flashserve.engine.compute._qmm",
            sources=SOURCES,
            depends=DEPENDS,
            language="c++",
            libraries=["mlx"],
            define_macros=[("NDEBUG", None), ("NB_COMPACT_ASSERTIONS", None), ("NB_DOMAIN", "mlx")],
            extra_compile_args=[
                "-std=c++20",
                "-O3",
                "-fvisibility=hidden",
                "-fno-strict-aliasing",
                "-ffunction-sections",
                "-fdata-sections",
            ],
            # libmlx.so is found next to mlx's package when installed; it is
            # also already loaded (mlx.core imports first), which is what an
            # editable install relies on.
            extra_link_args=["-s", "-Wl,--gc-sections", "-Wl,-rpath,$ORIGIN/../../../mlx/lib"],
        )
    ]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
