"""Logprobs in the OpenAI shapes, from the engine's token events.

The engine gives token ids and their logprobs (engine/generation/logprobs.py
says which distribution: after the request's penalties, logit_bias and
grammar, before temperature and top-p / top-k / min-p truncation). Here they
become what the two APIs answer:

- Chat Completions: `choices[].logprobs.content[]`, one entry per generated
  token, with `token`, `logprob`, `bytes` and `top_logprobs`.
- Completions: `choices[].logprobs` = parallel lists `tokens`,
  `token_logprobs`, `top_logprobs` ({token: logprob}, the sampled token
  included) and `text_offset` (where each token starts in the choice's text).

A token's string is its own text at the tokenizer's level: for byte-level BPE
the bytes it stands for, which may be part of a character (`bytes` then holds
them; `token` is them decoded with U+FFFD for what is incomplete, as OpenAI
does).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    _byte_decoder,
)

from flashserve.engine.generation.requests import PromptLogprobsEvent, TokenEvent
from flashserve.server.openai.completions_protocol import CompletionLogprobs
from flashserve.server.openai.protocol import ChoiceLogprobs, TokenLogprob, TopLogprob

# OpenAI's logprob for a very unlikely token; JSON has no -inf.
LOGPROB_FLOOR = -9999.0
_SPM_SPACE = "\u2581".encode()


def _shown(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenStrings:
    """Token id -> (text, UTF-8 bytes) for one tokenizer, each id worked out once."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        # The detokenizer mlx-lm picked from tokenizer.json's decoder says how tokens
        # map to bytes (read only: its token map).
        self._detokenizer = getattr(tokenizer, "_detokenizer", None)
        # Added tokens (<|im_end|>, <tool_call>) are their text as written, outside
        # the byte-level alphabet.
        try:
            self._added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())
        except Exception:  # a tokenizer without the table: none are added
            self._added = set()

    def __call__(self, token: int) -> tuple[str, bytes]:
        found = self._cache.get(token)
        if found is None:
            raw = self._bytes(token)
            found = self._cache[token] = (raw.decode("utf-8", "replace"), raw)
        return found

    def text(self, token: int) -> str:
        return self(token)[0]

    def _bytes(self, token: int) -> bytes:
        detokenizer = self._detokenizer
        if token in self._added:
            return self._tokenizer.convert_ids_to_tokens(token).encode("utf-8")
        if isinstance(detokenizer, BPEStreamingDetokenizer) and token < len(detokenizer.tokenmap):
            # GPT-2's byte-to-character map, reversed; special tokens are plain text.
            decoder = _byte_decoder()
            out = bytearray()
            for char in detokenizer.tokenmap[token] or "":
                byte = decoder.get(char)
                out.extend(bytes([byte]) if byte is not None else char.encode("utf-8"))
            return bytes(out)
        if isinstance(detokenizer, SPMStreamingDetokenizer) and token < len(detokenizer.tokenmap):
            # SentencePiece: byte tokens (<0x0A>) already read as their byte; ▁ is a space.
            return detokenizer.tokenmap[token].replace(_SPM_SPACE, b" ")
        return self._tokenizer.decode([token]).encode("utf-8")


_strings: weakref.WeakKeyDictionary[Any, TokenStrings] = weakref.WeakKeyDictionary()


def token_strings(tokenizer: Any) -> TokenStrings:
    """The TokenStrings of `tokenizer`, kept as long as the tokenizer lives."""
    try:
        found = _strings.get(tokenizer)
        if found is None:
            found = _strings[tokenizer] = TokenStrings(tokenizer)
        return found
    except TypeError:  # not weakly referenceable: a fresh map per request
        return TokenStrings(tokenizer)


# -- Chat Completions ------------------------------------------------------------------


def _top(strings: TokenStrings, token: int, logprob: float) -> TopLogprob:
    text, raw = strings(token)
    return TopLogprob(token=text, logprob=_shown(logprob), bytes=list(raw))


def chat_logprobs(tokens: Sequence[TokenEvent], strings: TokenStrings) -> ChoiceLogprobs | None:
    """`logprobs` of a chat choice (or chunk) for these tokens; None when there are none."""
    if not tokens:
        return None
    content = []
    for event in tokens:
        text, raw = strings(event.token)
        content.append(
            TokenLogprob(
                token=text,
                logprob=_shown(event.logprob if event.logprob is not None else -math.inf),
                bytes=list(raw),
                top_logprobs=[_top(strings, t, lp) for t, lp in event.top_logprobs or ()],
            )
        )
    return ChoiceLogprobs(content=content)


# -- Completions -----------------------------------------------------------------------


def _top_dict(
    strings: TokenStrings, top: Sequence[tuple[int, float]], sampled: int, logprob: float
) -> dict[str, float]:
    """The k most likely, then the sampled token if it is not among them (OpenAI and
    vLLM list it too). Tokens with the same text (partial characters all read as
    U+FFFD) keep the most likely one's value."""
    out: dict[str, float] = {}
    for token, value in (*top, (sampled, logprob)):
        out.setdefault(strings.text(token), _shown(value))
    return out


class CompletionLogprobsWriter:
    """One choice's `logprobs`, piece by piece: text_offset runs on from piece to piece."""

    def __init__(self, strings: TokenStrings):
        self._strings = strings
        self.offset = 0  # where the next token starts in the choice's text

    def prompt(self, event: PromptLogprobsEvent, prompt_text: str) -> CompletionLogprobs:
        """The echoed prompt's tokens (the first has no logprob: nothing precedes it).
        The completion's tokens then count from the end of the prompt's text."""
        out = CompletionLogprobs()
        for i, token in enumerate(event.tokens):
            logprob = event.logprobs[i] if i < len(event.logprobs) else None
            top = event.top_logprobs[i] if i < len(event.top_logprobs) else None
            self._add(out, token, logprob, top)
        self.offset = len(prompt_text)
        return out

    def tokens(self, tokens: Sequence[TokenEvent]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for event in tokens:
            logprob = event.logprob if event.logprob is not None else -math.inf
            self._add(out, event.token, logprob, event.top_logprobs or [])
        return out

    def _add(
        self,
        out: CompletionLogprobs,
        token: int,
        logprob: float | None,
        top: Sequence[tuple[int, float]] | None,
    ) -> None:
        text = self._strings.text(token)
        out.tokens.append(text)
        out.text_offset.append(self.offset)
        self.offset += len(text)
        if logprob is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            return
        out.token_logprobs.append(_shown(logprob))
        out.top_logprobs.append(_top_dict(self._strings, top or (), token, logprob))


def joined(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    """The pieces of one choice as one `logprobs` (a non-streamed response)."""
    out = CompletionLogprobs()
    for part in parts:
        out.tokens += part.tokens
        out.token_logprobs += part.token_logprobs
        out.top_logprobs += part.top_logprobs
        out.text_offset += part.text_offset
    return out
