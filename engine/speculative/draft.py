"""A draft model: a small resident model with the target's vocabulary drafts greedily.

Each sequence keeps its own cache of the draft model (mlx-lm's KVCache, one
sequence, no batch). A draft call first brings that cache to the sequence's
context: the tokens it holds past the longest common prefix with the context
(drafted tokens the target rejected) are trimmed, the context's new tokens are
run, and then k tokens are generated greedily, one step each. The draft
model's passes are cheap next to the target's when the target streams from
disk; the adaptive length (adaptive.py) measures whole steps, drafting
included, so a draft model too slow to pay is switched off like any draft.

Loaded by the engine's loader (an mlx-lm directory, a GGUF file, a prepared
directory), resident. Refused when its tokenizer's vocabulary differs from
the target's, or when its cache cannot be trimmed (recurrent layers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # context tokens run per draft-model call when catching up


@dataclass
class DraftState:
    """One sequence's draft-model cache and the tokens it holds."""

    cache: list[Any]
    tokens: list[int] = field(default_factory=list)


class DraftModel:
    def __init__(self, model: Any) -> None:
        self.model = model

    @classmethod
    def load(cls, path: str, target_tokenizer: Any) -> DraftModel:
        """The draft model at `path`, checked against the target's tokenizer."""
        from flashserve.engine.compute import qmm
        from flashserve.engine.config import EngineConfig
        from flashserve.engine.loader import load

        # The kernels are chosen per process: the draft's load keeps the target's.
        loaded = load(EngineConfig(model=path, **qmm.process_settings()))
        if _vocabulary(loaded.tokenizer) != _vocabulary(target_tokenizer):
            raise ValueError(f"draft model {path}: its vocabulary differs from the model's")
        if not can_trim_prompt_cache(make_prompt_cache(loaded.model)):
            raise ValueError(f"draft model {path}: its cache cannot be trimmed (recurrent layers)")
        log.info("draft model %s loaded for speculative decoding", loaded.model_id)
        return cls(loaded.model)

    def new_state(self) -> DraftState:
        return DraftState(make_prompt_cache(self.model))

    def draft(self, state: DraftState, context: list[int], k: int) -> list[int]:
        """Up to k greedy tokens after `context`."""
        if k <= 0 or not context:
            return []
        same = 0
        limit = min(len(state.tokens), len(context) - 1)  # the last token is always run
        while same < limit and state.tokens[same] == context[same]:
            same += 1
        if same < len(state.tokens):
            trim_prompt_cache(state.cache, len(state.tokens) - same)
            del state.tokens[same:]
        new = context[same:]
        for start in range(0, len(new), PREFILL_CHUNK):
            logits = self.model(mx.array([new[start : start + PREFILL_CHUNK]]), cache=state.cache)
        state.tokens.extend(new)
        out: list[int] = []
        while True:
            token = int(mx.argmax(logits[0, -1]).item())
            out.append(token)
            if len(out) == k:
                return out
            logits = self.model(mx.array([[token]]), cache=state.cache)
            state.tokens.append(token)


def _vocabulary(tokenizer: Any) -> dict[str, int]:
    from flashserve.engine.weights.tokenizer import hf_tokenizer

    return dict(hf_tokenizer(tokenizer).get_vocab())
