"""The prompt cache: a prompt starts from the longest prefix already computed.

Editors and agents resend the whole conversation every turn. The worker
stores each prompt's cache state (attention KV, or a hybrid model's recurrent
state) when its prefill reaches the prompt's last token, keyed by those
tokens. A later prompt starts from the longest stored prefix and prefills
only the rest.

Two tiers:
- memory: mlx-lm's LRUPromptCache, a token trie, least recently used first
  out, bounded here in bytes (`prompt_cache_bytes`). It returns a deep copy,
  so generation never changes a stored entry. Under memory pressure it gives
  memory back before resident layers are shed.
- disk (prompt_disk.py, optional): every stored state is also written to
  `prompt_cache_dir` (only the tokens past the longest prefix already there,
  for attention KV), so what memory evicted, and what a past run of the same
  weights computed, is read back instead of prefilled. A disk entry read
  back moves into memory. A state still queued for writing serves a lookup
  from its bytes in memory: a lookup never waits for the writer.
- disk only (`prompt_cache_disk_only`, set by the dense memory plan when it
  leaves no room for a memory tier): states go straight to disk, and a
  lookup that a queued write would serve waits for that write alone (a copy
  of its bytes would be a second state in memory) and reads it back.

An entry that runs past the new prompt (the prompt diverged, e.g. a template
dropped earlier reasoning) is trimmed to the common prefix, never more. A
cache that cannot be trimmed (recurrent state) is only reused when the whole
entry is a prefix of the prompt.

Everything here runs on the worker thread but the disk tier's writer;
`snapshot` only reads counters.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from flashserve.engine.config import EngineConfig
from flashserve.engine.kv.cache import kv_tag
from flashserve.engine.prompt_cache import disk as prompt_disk
from flashserve.engine.prompt_cache import files as prompt_files
from flashserve.engine.prompt_cache.disk import DiskTier
from flashserve.engine.weights.fingerprint import weights_fingerprint
from flashserve.engine.weights.model import LoadedModel, compute_dtype

log = logging.getLogger(__name__)

# Disk only: how long a lookup waits for the queued write of the state it wants
# (a context's KV at SSD speed) before it takes a copy of the queued bytes.
DISK_ONLY_WAIT = 5.0
# Entries are bounded by bytes; the count bound of LRUPromptCache is not used.
_NO_COUNT_LIMIT = 1 << 30
# Under memory pressure, how long shrink() waits for queued disk writes (a
# state of a few MB to a few hundred MB at SSD speed): a queued state holds its
# memory until it is written.
SHRINK_FLUSH_SECONDS = 5.0


@dataclass
class PromptCacheStats:
    """Counters since start over both tiers, served in /cache/stats and /metrics."""

    hits: int = 0  # prompts that started from a stored prefix (either tier)
    misses: int = 0  # prompts prefilled from the start
    tokens_reused: int = 0  # prompt tokens not prefilled thanks to the cache
    tokens_prefilled: int = 0  # prompt tokens prefilled by requests that asked the cache


@dataclass
class MemoryStats:
    hits: int = 0  # prompts served from memory
    misses: int = 0  # prompts memory could not serve (the disk tier is asked next)
    stored: int = 0  # entries written
    released_bytes: int = 0  # bytes given back under memory pressure


class PromptCache:
    """Longest-prefix reuse of prompt cache states, for one model."""

    def __init__(self, max_bytes: int, model_key: str, disk: DiskTier | None = None) -> None:
        self.max_bytes = int(max_bytes)
        self.model_key = model_key
        self.disk = disk
        self.stats = PromptCacheStats()
        self.memory_stats = MemoryStats()
        self._store = LRUPromptCache(max_size=_NO_COUNT_LIMIT, max_bytes=self.max_bytes)
        self._unstorable_logged = False

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
        prompt = list(prompt)
        cache, reused = self._from_memory(prompt)
        tier = "memory" if cache is not None else None
        if self.disk is not None:
            found = self.disk.lookup(prompt)
            queued = self.disk.queued(prompt)
            better = queued is not None and queued[1] > max(reused, found[2] if found else 0)
            if better and self.max_bytes <= 0 and self.disk.wait_written(queued[0], DISK_ONLY_WAIT):
                # Disk only (the memory plan left no room for a second copy of a
                # state): its own write lands first, then it is read back.
                found, queued, better = self.disk.lookup(prompt), None, False
            if better:
                # A better state is still on its way to disk (the answer just ended):
                # taken from the queued write's bytes, never waited for.
                entry, reused = queued  # type: ignore[misc]
                cache, tier = prompt_files.restore(entry), "disk"
                if len(entry.tokens) > reused:
                    trim_prompt_cache(cache, len(entry.tokens) - reused)
            elif found is not None and found[2] > reused:
                from_disk = self._from_disk(*found)
                if from_disk is not None:
                    cache, reused, tier = from_disk, found[2], "disk"
            if tier != "memory":
                self.disk.stats.hits += tier == "disk"
                self.disk.stats.misses += tier is None
        self.memory_stats.hits += tier == "memory"
        self.memory_stats.misses += tier != "memory"
        if cache is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        self.stats.tokens_reused += reused
        self.stats.tokens_prefilled += len(prompt) - reused
        return cache, reused

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep `cache` (the state after exactly `tokens`); it must not be used elsewhere."""
        if not tokens or (self.max_bytes <= 0 and self.disk is None):
            return
        tokens = list(tokens)
        if self.disk is not None and not self.disk.contains(tokens):
            try:
                # Memory keeps the copy the disk write reads (files.prepare_sharing).
                entry, cache = prompt_files.prepare_sharing(tokens, cache)
                self.disk.put(entry)
            except Exception as exc:  # the disk tier is an extra: never fail a request for it
                if not self._unstorable_logged:
                    log.warning("prompt cache states of this model stay in memory: %s", exc)
                    self._unstorable_logged = True
        if self.max_bytes > 0:
            self._store.insert_cache(self.model_key, tokens, cache)
            self.memory_stats.stored += 1

    def shrink(self, deficit: int) -> int:
        """Give back up to `deficit` bytes (oldest entries first); return bytes freed.

        A pressure hook of the residency manager: it runs before resident
        layers are shed. The disk tier's queued writes land first, so what is
        dropped here is read back from disk. The newest entry stays: it is the
        state the conversation in flight resends next (prompt + answer), and
        it is no larger than the memory tier's budget, which a memory plan
        reserved for it.
        """
        before = self.nbytes
        if self.disk is not None:
            self.disk.flush(SHRINK_FLUSH_SECONDS)
        target = max(0, before - int(deficit))
        while self.entries > 1 and self.nbytes > target:
            self._store.trim_to(n_sequences=self.entries - 1)
        freed = before - self.nbytes
        self.memory_stats.released_bytes += freed
        return freed

    def close(self, timeout: float = 30.0) -> None:
        """Finish the disk tier's pending writes (entries survive the restart)."""
        if self.disk is not None:
            self.disk.close(timeout)

    def snapshot(self) -> dict[str, Any]:
        return {
            **asdict(self.stats),
            "memory": {
                "max_bytes": self.max_bytes,
                "entries": self.entries,
                "bytes": self.nbytes,
                **asdict(self.memory_stats),
            },
            "disk": self.disk.snapshot() if self.disk is not None else None,
        }

    def _from_memory(self, prompt: list[int]) -> tuple[list[Any] | None, int]:
        cache, rest = self._store.fetch_nearest_cache(self.model_key, prompt)
        reused = len(prompt) - len(rest) if cache is not None else 0
        if cache is not None and reused >= len(prompt):
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, reused - len(prompt) + 1)
                reused = len(prompt) - 1
            else:
                cache, reused = None, 0
        if reused <= 0:
            return None, 0
        return cache, reused

    def _from_disk(self, name: str, entry_tokens: int, usable: int) -> list[Any] | None:
        """The disk entry `name` cut back to `usable` tokens; it also moves into memory."""
        assert self.disk is not None
        loaded = self.disk.load(name)
        if loaded is None:
            return None
        tokens, cache = loaded
        if self.max_bytes >= sum(c.nbytes for c in cache):  # else memory would drop it at once
            self._store.insert_cache(self.model_key, tokens, copy.deepcopy(cache))
        if entry_tokens > usable:
            trim_prompt_cache(cache, entry_tokens - usable)
        return cache


def prompt_cache_for(config: EngineConfig, loaded: LoadedModel) -> PromptCache | None:
    """The worker's prompt cache for `loaded` (None when turned off): memory, and
    the disk tier when asked for and its directory is usable."""
    if config.prompt_cache_bytes <= 0 and not config.prompt_cache_disk_only:
        return None
    disk = None
    if config.prompt_cache_disk_bytes > 0:
        directory = config.prompt_cache_dir
        try:
            # States of another KV precision (kv_bits) are another model's: never mixed.
            precision = str(compute_dtype()) + kv_tag(config.kv_bits, config.kv_group_size)
            fingerprint = weights_fingerprint(loaded.path, loaded.config, precision)
            directory = directory or prompt_disk.default_dir(fingerprint)
            disk = DiskTier(
                Path(directory),
                config.prompt_cache_disk_bytes,
                fingerprint,
                config.prompt_cache_write_bytes_per_hour,
                drop_page_cache=config.prompt_cache_disk_only,
                yield_to_prefills=getattr(loaded.streamer, "memory_plan", None) is None,
            )
        except OSError as exc:
            log.warning("prompt cache stays in memory: %s is not usable (%s)", directory, exc)
    key = loaded.model_id + kv_tag(config.kv_bits, config.kv_group_size)
    cache = PromptCache(config.prompt_cache_bytes, key, disk)
    residency = getattr(loaded.streamer, "residency", None)
    if residency is not None:
        # Under memory pressure the prompt cache gives memory back before
        # resident layers are shed (hooks run before shedding).
        residency.add_pressure_hook(cache.shrink)
    return cache
