"""The prompt cache's memory tier: reuse the longest cached prefix of a prompt.

Editors and agents resend the whole conversation every turn. The worker
stores each prompt's cache state (attention KV, or a hybrid model's recurrent
state) when its prefill reaches the prompt's last token, keyed by those
tokens. A later prompt starts from the longest stored prefix and prefills
only the rest.

The store is mlx-lm's LRUPromptCache: a token trie, least recently used
first out, bounded here in bytes. It returns a deep copy, so generation never
changes a stored entry. An entry that runs past the new prompt (the prompt
diverged, e.g. a template dropped earlier reasoning) is trimmed to the common
prefix, never more. A cache that cannot be trimmed (recurrent state) is only
reused when the whole entry is a prefix of the prompt.

Everything here runs on the worker thread; `snapshot` only reads counters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

# Entries are bounded by bytes; the count bound of LRUPromptCache is not used.
_NO_COUNT_LIMIT = 1 << 30


@dataclass
class PromptCacheStats:
    """Counters since start, served in /cache/stats and /metrics."""

    hits: int = 0  # prompts that started from a stored prefix
    misses: int = 0  # prompts prefilled from the start
    tokens_reused: int = 0  # prompt tokens not prefilled thanks to the cache
    tokens_prefilled: int = 0  # prompt tokens prefilled by requests that asked the cache
    stored: int = 0  # entries written
    released_bytes: int = 0  # bytes given back under memory pressure


class PromptCache:
    """Longest-prefix reuse of prompt cache states, for one model."""

    def __init__(self, max_bytes: int, model_key: str) -> None:
        self.max_bytes = int(max_bytes)
        self.model_key = model_key
        self.stats = PromptCacheStats()
        self._store = LRUPromptCache(max_size=_NO_COUNT_LIMIT, max_bytes=self.max_bytes)

    @property
    def nbytes(self) -> int:
        return int(self._store.nbytes)

    @property
    def entries(self) -> int:
        return len(self._store)

    def fetch(self, prompt: list[int]) -> tuple[list[Any] | None, int]:
        """(a private copy of the cache state, tokens it covers) for `prompt`.

        At least the prompt's last token is always left to prefill: the model
        must see it to produce the first new token's logits.
        """
        cache, rest = self._store.fetch_nearest_cache(self.model_key, list(prompt))
        reused = len(prompt) - len(rest) if cache is not None else 0
        if cache is not None and reused >= len(prompt):
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, reused - len(prompt) + 1)
                reused = len(prompt) - 1
            else:
                cache, reused = None, 0
        if reused <= 0:
            cache, reused = None, 0
        if cache is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        self.stats.tokens_reused += reused
        self.stats.tokens_prefilled += len(prompt) - reused
        return cache, reused

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep `cache` (the state after exactly `tokens`); it must not be used elsewhere."""
        if not tokens or self.max_bytes <= 0:
            return
        self._store.insert_cache(self.model_key, list(tokens), cache)
        self.stats.stored += 1

    def shrink(self, deficit: int) -> int:
        """Give back at least `deficit` bytes (oldest entries first); return bytes freed.

        A pressure hook of the residency manager: it runs before resident
        layers are shed.
        """
        before = self.nbytes
        self._store.trim_to(n_bytes=max(0, before - int(deficit)))
        freed = before - self.nbytes
        self.stats.released_bytes += freed
        return freed

    def snapshot(self) -> dict[str, Any]:
        return {
            "max_bytes": self.max_bytes,
            "entries": self.entries,
            "bytes": self.nbytes,
            **asdict(self.stats),
        }
