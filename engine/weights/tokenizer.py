"""The Hugging Face tokenizer behind mlx-lm's TokenizerWrapper.

Apart from engine/generation/constraints.py because the server's settings validation
needs it without importing mlx: the BLAS is chosen before mlx loads
(engine/compute/blas.py).
"""

from __future__ import annotations

from typing import Any


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (or itself)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
