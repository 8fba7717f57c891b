"""Fill-in-the-middle (FIM): a code model's FIM tokens, and prompts arranged around them.

A code model trained for FIM reads the code before the cursor, the code after
it and a marker, then writes what goes between. Each family names its markers
differently; the tokenizer's vocabulary says which ones a model has, so they
are looked up there (never guessed from the model's name), once per loaded
model.

Prompts are arranged on token ids, not on text: the prefix and the suffix are
encoded separately, with special-token strings in them read as plain text (as
llama.cpp does for /infill), and the FIM token ids go between them. Code that
happens to contain `<fim_suffix>` then cannot turn into the marker, and text
next to a marker cannot merge with it. The order is PSM (prefix, suffix,
middle), the order every family here was trained on and llama.cpp's default.

Used by /v1/completions (`suffix`) and llama.cpp's /infill; dialect-neutral.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flashserve.engine.weights.tokenizer import hf_tokenizer
from flashserve.server.chat.prompts import check_unicode, encode
from flashserve.server.http.errors import invalid_request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FimStyle:
    """One family's FIM vocabulary. Each role lists the spellings to look for, first match
    wins (CodeLlama's markers are `▁<PRE>` in its own tokenizer, `<PRE>` in conversions)."""

    name: str
    prefix: tuple[str, ...]
    suffix: tuple[str, ...]
    middle: tuple[str, ...]
    pad: tuple[str, ...] = ()
    file_sep: tuple[str, ...] = ()
    repo_name: tuple[str, ...] = ()
    # Tokens that end a fill: the end of text, and the markers a model writes when it
    # moves on to another hole or file (llama.cpp ends generation on them too).
    end: tuple[str, ...] = ()


# DeepSeek's markers use the fullwidth vertical line (U+FF5C), not "|".
_BAR = "\uff5c"

STYLES = (
    FimStyle(
        "qwen",  # Qwen2.5-Coder, CodeGemma
        ("<|fim_prefix|>",),
        ("<|fim_suffix|>",),
        ("<|fim_middle|>",),
        pad=("<|fim_pad|>",),
        file_sep=("<|file_sep|>", "<|file_separator|>"),
        repo_name=("<|repo_name|>",),
        end=("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|file_separator|>", "<|repo_name|>"),
    ),
    FimStyle(
        "starcoder",  # StarCoder, StarCoder2, Granite Code, SantaCoder
        ("<fim_prefix>", "<fim-prefix>"),
        ("<fim_suffix>", "<fim-suffix>"),
        ("<fim_middle>", "<fim-middle>"),
        pad=("<fim_pad>", "<fim-pad>"),
        file_sep=("<file_sep>",),
        repo_name=("<repo_name>", "<reponame>"),
        end=("<|endoftext|>", "<fim_pad>", "<fim-pad>", "<file_sep>", "<repo_name>"),
    ),
    FimStyle(
        "codellama",
        ("▁<PRE>", "<PRE>"),
        ("▁<SUF>", "<SUF>"),
        ("▁<MID>", "<MID>"),
        end=("▁<EOT>", "<EOT>"),
    ),
    FimStyle(
        "deepseek",  # DeepSeek-Coder
        (f"<{_BAR}fim▁begin{_BAR}>",),
        (f"<{_BAR}fim▁hole{_BAR}>",),
        (f"<{_BAR}fim▁end{_BAR}>",),
        end=("<|EOT|>", f"<{_BAR}end▁of▁sentence{_BAR}>"),
    ),
)


@dataclass(frozen=True)
class FimTokens:
    """A model's FIM token ids (found once per loaded model: `fim_tokens`)."""

    style: str
    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    file_sep: int | None = None
    repo_name: int | None = None
    end_of_text: int | None = None  # the first of the style's end tokens the model has
    bos: int | None = None  # put first, when the tokenizer starts every encoding with it
    # Stop strings for the tokens that end a fill. The request carries stop strings
    # only; the detokenizer writes a special token as its text, which these match.
    stops: tuple[str, ...] = ()


@dataclass
class _Found:
    fim: FimTokens | None
    missing: str  # why there is no FIM, for the 400
    plain: Any  # a copy of the Rust tokenizer reading special-token strings as text


_CACHE: weakref.WeakKeyDictionary[Any, _Found] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The model's FIM tokens, or None when its vocabulary has no complete set."""
    return _found(tokenizer).fim


def require_fim(tokenizer: Any, param: str) -> FimTokens:
    """The model's FIM tokens; a 400 naming `param` and the missing tokens otherwise."""
    found = _found(tokenizer)
    if found.fim is None:
        raise invalid_request(
            f"{param} needs a model trained for fill-in-the-middle; {found.missing}", param
        )
    return found.fim


def _found(tokenizer: Any) -> _Found:
    # Render threads ask concurrently; the lookup walks the whole vocabulary once.
    with _LOCK:
        found = _CACHE.get(tokenizer)
        if found is None:
            found = _CACHE[tokenizer] = _detect(tokenizer)
        return found


def _detect(tokenizer: Any) -> _Found:
    hf = hf_tokenizer(tokenizer)
    vocab: dict[str, int] = hf.get_vocab()

    def first(spellings: Sequence[str]) -> tuple[str, int] | None:
        return next(((s, vocab[s]) for s in spellings if s in vocab), None)

    best: tuple[int, FimStyle] | None = None
    for style in STYLES:
        roles = [first(style.prefix), first(style.suffix), first(style.middle)]
        have = sum(role is not None for role in roles)
        if have == 3:
            fim = _tokens(style, roles, first, tokenizer, hf)
            log.info("fill-in-the-middle tokens: %s style %s", style.name, fim)
            return _Found(fim, "", _plain_tokenizer(hf))
        if have and (best is None or have > best[0]):
            best = (have, style)
    if best is None:
        wanted = "; ".join(f"{s.prefix[0]} {s.suffix[0]} {s.middle[0]}" for s in STYLES)
        missing = f"this model's vocabulary has no FIM tokens (looked for {wanted})."
    else:
        style = best[1]
        absent = [
            spellings[0]
            for spellings in (style.prefix, style.suffix, style.middle)
            if first(spellings) is None
        ]
        missing = f"this model's vocabulary lacks the FIM tokens {' '.join(absent)}."
    return _Found(None, missing, None)


def _tokens(style: FimStyle, roles: list[Any], first: Any, tokenizer: Any, hf: Any) -> FimTokens:
    ends = [found for spelling in style.end if (found := first((spelling,))) is not None]
    stops: list[str] = []
    for text, _ in ends:
        # SentencePiece's ▁ is a space once detokenized: stop at " <EOT>" before "<EOT>"
        # (the matcher takes the earliest), so no trailing space is left in the fill.
        for variant in (text, text.replace("▁", " "), text.lstrip("▁")):
            if variant.strip() and variant not in stops:
                stops.append(variant)
    with_special = encode(tokenizer, "a", add_special_tokens=True)
    without = encode(tokenizer, "a", add_special_tokens=False)
    bos = hf.bos_token_id
    adds_bos = bos is not None and with_special[:1] == [bos] and without[:1] != [bos]
    optional = {
        role: (found[1] if (found := first(spellings)) else None)
        for role, spellings in (
            ("pad", style.pad),
            ("file_sep", style.file_sep),
            ("repo_name", style.repo_name),
        )
    }
    return FimTokens(
        style=style.name,
        prefix=roles[0][1],
        suffix=roles[1][1],
        middle=roles[2][1],
        end_of_text=ends[0][1] if ends else None,
        bos=bos if adds_bos else None,
        stops=tuple(stops),
        **optional,
    )


def _plain_tokenizer(hf: Any) -> Any:
    """A copy of the Rust tokenizer that reads special-token strings in text as text.

    A copy, because the flag is the tokenizer's state and other requests use the
    model's tokenizer at the same time. None for a tokenizer without a Rust backend.
    """
    backend = getattr(hf, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_special_tokens"):
        log.warning("fill-in-the-middle: special-token strings in code will be read as tokens")
        return None
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(backend.to_str())
    plain.no_truncation()
    plain.no_padding()
    plain.encode_special_tokens = True
    return plain


def encode_text(tokenizer: Any, text: str, param: str) -> list[int]:
    """Token ids of a piece of code: no BOS or EOS, special-token strings as plain text."""
    check_unicode(text, param)
    if not text:
        return []
    plain = _found(tokenizer).plain
    if plain is None:
        return encode(tokenizer, text, add_special_tokens=False)
    return list(plain.encode_batch_fast([text], add_special_tokens=False)[0].ids)


def arrange(
    fim: FimTokens, prefix: list[int], suffix: list[int], context: Sequence[int] = ()
) -> list[int]:
    """PSM: [BOS] context <prefix> prefix <suffix> suffix <middle>; the model writes the
    middle. `context` is other files (`repo_context`), before the prefix marker."""
    head = [fim.bos] if fim.bos is not None else []
    return [*head, *context, fim.prefix, *prefix, fim.suffix, *suffix, fim.middle]


# llama.cpp's separator between extra chunks for models without a file-separator token.
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
# llama.cpp's repository name: the prompt shape the models were trained on needs one.
REPO_NAME = "myproject"
# llama.cpp names the file being edited so; clients send no name for it.
CURRENT_FILE = "filename"


def repo_context(
    tokenizer: Any,
    fim: FimTokens,
    chunks: Sequence[tuple[str, str]],
    param: str,
    budget: int | None = None,
) -> tuple[list[int], int]:
    """Other files (filename, text) before the current one, as llama.cpp arranges them;
    and how many chunks were left out.

    With file-separator tokens (Qwen2.5-Coder, StarCoder2):
    `<repo_name>myproject\\n<file_sep>{filename}\\n{text}...<file_sep>filename\\n`,
    the repository-level shape those models were trained on. Without them, each
    chunk follows a plain-text snippet separator. No chunks: nothing. Within a
    `budget` of tokens, the last chunks (clients send the nearest context last)
    that fit whole: editor plugins send what they have and leave the fitting to
    the server, as llama.cpp does it.
    """
    if not chunks:
        return [], 0
    head: list[int] = []
    tail: list[int] = []
    if fim.repo_name is not None and fim.file_sep is not None:
        head = [fim.repo_name, *encode_text(tokenizer, REPO_NAME + "\n", param)]
    if fim.file_sep is not None:
        tail = [fim.file_sep, *encode_text(tokenizer, CURRENT_FILE + "\n", param)]
    parts: list[list[int]] = []
    for index, (filename, text) in enumerate(chunks):
        where = f"{param}.{index}"
        if fim.file_sep is not None:
            part = [fim.file_sep, *encode_text(tokenizer, filename + "\n", where + ".filename")]
        else:
            part = encode_text(tokenizer, SNIPPET_SEPARATOR, where)
        parts.append(part + encode_text(tokenizer, text, where + ".text"))
    kept = parts
    if budget is not None:
        room, kept = budget - len(head) - len(tail), []
        for part in reversed(parts):
            if len(part) > room:
                break
            kept.insert(0, part)
            room -= len(part)
        if not kept:
            return [], len(parts)
    return [*head, *(t for part in kept for t in part), *tail], len(parts) - len(kept)


def suffix_prompt(
    tokenizer: Any, prefix: str | list[int], suffix: str, *, suffix_param: str = "suffix"
) -> list[int]:
    """/v1/completions with a `suffix`: the prompt is the prefix (text, or token ids
    already checked against the vocabulary, used as they are)."""
    fim = require_fim(tokenizer, suffix_param)
    head = encode_text(tokenizer, prefix, "prompt") if isinstance(prefix, str) else prefix
    return arrange(fim, head, encode_text(tokenizer, suffix, suffix_param))


def fill_stops(tokenizer: Any, suffix: str | None) -> list[str]:
    """Stop strings for a request with `suffix` (none without one): the fill's end tokens.
    Cheap after the prompt was arranged (the tokens are cached by then)."""
    fim = fim_tokens(tokenizer) if suffix else None
    return list(fim.stops) if fim is not None else []
