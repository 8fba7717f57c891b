"""Constrained decoding as logits processors (llguidance).

A grammar (Lark syntax with embedded JSON schemas, see llguidance's docs)
becomes a `GrammarProcessor`: each step it advances the grammar matcher by
the token just sampled, asks it for the bitmask of allowed next tokens (CPU;
about half a millisecond a token with a 49k vocabulary, mask included) and
sets every other logit to -inf. When the grammar is complete only EOS is
allowed, so generation stops there.

Also `ForcedTokens`, which makes a model emit an exact token sequence: the
test suite uses it to script a tiny random model's output.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from typing import Any

import mlx.core as mx
import numpy as np

from flashserve.engine.weights.tokenizer import hf_tokenizer

log = logging.getLogger(__name__)


# Tokens a grammar can be taken back by: more than a speculative draft's longest
# (speculative_max_draft is at most 64) plus the token after it.
MAX_ROLLBACK = 72


class GrammarError(ValueError):
    """A grammar (or JSON schema) that cannot be compiled or stopped working during
    generation; the message says why, `param` names the request field it came from."""

    status = 400  # the request's grammar, not the server, is at fault
    code = "constraint_failed"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _reason(error: str) -> str:
    """llguidance's reason without the parser state and grammar it appends."""
    return error.split("\n<state>", 1)[0].strip().splitlines()[0] if error.strip() else error


_lltok_cache: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_lltok_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any) -> Any:
    """The llguidance tokenizer for a (wrapped) Hugging Face tokenizer, built once."""
    import llguidance.hf

    hf = hf_tokenizer(tokenizer)
    with _lltok_lock:
        cached = _lltok_cache.get(hf)
        if cached is None:
            eos = getattr(tokenizer, "eos_token_ids", None) or hf.eos_token_id
            eos = sorted(eos) if isinstance(eos, (set, list, tuple)) else [eos]
            cached = llguidance.hf.from_tokenizer(hf, eos_token=eos)
            _lltok_cache[hf] = cached
        return cached


def literal(tokenizer: Any, text: str) -> str:
    """`text` as a Lark terminal: a special token where the tokenizer has one
    (a real model writes `<tool_call>` as one token, never as its characters),
    else a quoted string."""
    ids = hf_tokenizer(tokenizer).encode(text, add_special_tokens=False)
    if len(ids) == 1 and ll_tokenizer(tokenizer).is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def compile_grammar(tokenizer: Any, lark: str) -> str:
    """Check a Lark grammar against the tokenizer; return llguidance's grammar
    text for GrammarProcessor. Raises GrammarError with llguidance's reason."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_lark(lark)
    error = LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    if error and not error.startswith("WARNING"):
        raise GrammarError(_reason(error))
    return grammar


class GrammarProcessor:
    """A logits processor that keeps generation inside a grammar.

    Stateful: one per request. mlx-lm calls it with every token so far
    (prompt included) and the logits of the next position.
    """

    def __init__(
        self,
        tokenizer: Any,
        grammar: str,
        after: list[int] | None = None,
        param: str | None = None,
    ):
        """`after`: leave the output free until it ends with these tokens (a
        reasoning block the prompt opened must close before the grammar starts).
        `param`: the request field the grammar enforces, named in errors."""
        from llguidance import LLMatcher

        self._param = param
        self._matcher = LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
        self._check()
        self._seen: int | None = None  # tokens already given to the matcher
        self._after = list(after or [])
        self._recent: list[int] = []  # the last tokens given, for a speculative rollback
        self._past_stop = 0  # how many of them came after the matcher stopped

    def _check(self) -> None:
        # A matcher in error would leave the logits unmasked (or all masked):
        # the request must end with the reason, never continue unconstrained.
        if self._matcher.is_error():
            reason = _reason(self._matcher.get_error())
            raise GrammarError(
                f"Cannot enforce {self._param or 'the grammar'}: {reason}", self._param
            )

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._after:
            # Free text until the gate closes; the grammar starts after it.
            n = len(self._after)
            if tokens.shape[0] < n or tokens[-n:].tolist() != self._after:
                return logits
            self._after = []
            self._seen = tokens.shape[0]
        elif self._seen is None:
            self._seen = tokens.shape[0]  # the prompt
        else:
            self._roll_back(tokens)
            if tokens.shape[0] > self._seen:
                new = tokens[self._seen :].tolist()
                self._seen = tokens.shape[0]
                self._recent = (self._recent + new)[-MAX_ROLLBACK:]
                self._give(new)
        mask = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        self._check()
        return apply_bitmask(logits, mask)

    @property
    def speculative_ok(self) -> bool:
        """Whether a speculative step may run it ahead over drafted tokens: it rolls
        back what was rejected (not while a reasoning gate is open: its closing
        is not rolled back)."""
        return not self._after

    def _give(self, new: list[int]) -> None:
        if self._matcher.is_stopped():
            # Past the grammar's end (a drafted EOS after the closing brace): the
            # matcher takes nothing more and keeps no record of it, so a rollback
            # must not count these.
            self._past_stop = min(self._past_stop + len(new), len(self._recent))
            return
        if not self._matcher.consume_tokens(new):
            # The grammar grew too complex for the parser's limits (a schema
            # that requires itself), or another processor overrode the mask.
            self._check()
            raise GrammarError(f"Cannot enforce {self._param or 'the grammar'}", self._param)

    def _roll_back(self, tokens: mx.array) -> None:
        """Take back the tokens given to the matcher that `tokens` no longer has there:
        drafted tokens a speculative step ran the grammar over, then rejected. A
        stop is taken back too (llguidance's rollback undoes it): a rejected draft
        that completed the grammar, or drafted EOS, must not end the output."""
        if self._seen is None or not self._recent:
            return
        start = self._seen - len(self._recent)
        now = tokens[start : min(self._seen, tokens.shape[0])].tolist()
        same = 0
        while same < len(now) and now[same] == self._recent[same]:
            same += 1
        back = len(self._recent) - same
        if back:
            ignored = min(back, self._past_stop)
            self._past_stop -= ignored
            if back > ignored:
                self._matcher.rollback(back - ignored)
            self._recent = self._recent[:same]
            self._seen -= back


def apply_bitmask(logits: mx.array, mask: np.ndarray) -> mx.array:
    """Keep the logits whose bit is set in `mask` (little-endian bit per token)."""
    vocab = logits.shape[-1]
    allowed = np.unpackbits(mask, bitorder="little")
    if allowed.shape[0] >= vocab:
        allowed = allowed[:vocab]
    else:  # the model's embedding is padded past the tokenizer's vocabulary
        allowed = np.concatenate([allowed, np.zeros(vocab - allowed.shape[0], np.uint8)])
    return mx.where(mx.array(allowed.astype(np.bool_)), logits, -mx.inf)


class ForcedTokens:
    """A logits processor that makes the model emit `token_ids`, then `eos_id`.

    For tests: a tiny random-weight model becomes a model that says exactly
    what the test scripts, through the real generation path.
    """

    speculative_ok = True  # its mask depends on the context's length alone

    def __init__(self, token_ids: list[int], eos_id: int):
        self._script = [*list(token_ids), eos_id]
        self._start: int | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._start is None:
            self._start = tokens.shape[0]
        step = min(tokens.shape[0] - self._start, len(self._script) - 1)
        vocab = logits.shape[-1]
        onehot = np.full((vocab,), -np.inf, dtype=np.float32)
        onehot[self._script[step]] = 0.0
        return mx.broadcast_to(mx.array(onehot), logits.shape).astype(logits.dtype)
