"""Prompt-lookup drafts: continue the context the way it continued before.

Agents and editors repeat what is in the prompt (a file being edited, a
tool's output): the last few tokens of the context usually occurred earlier,
and what followed them then is a good guess for what follows now. The index
maps each n-gram (n = MIN_NGRAM..MAX_NGRAM) to the position after its latest
occurrence; it grows as tokens are emitted, so a lookup costs O(new tokens),
not a scan of the context.
"""

from __future__ import annotations

MAX_NGRAM = 4  # longest suffix matched: longer matches predict better
MIN_NGRAM = 2  # a single token matches too often to predict much


class NgramIndex:
    """One sequence's n-gram index over its context (prompt and output so far)."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index after its latest end
        self._indexed = 0  # n-grams ending before this position are in the index

    def draft(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the context's end."""
        end = len(context)
        # Index every n-gram that ends before the last token: the context's own
        # suffix must match an earlier occurrence, never itself.
        for stop in range(max(self._indexed, MIN_NGRAM), end):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, stop) + 1):
                self._next[tuple(context[stop - n : stop])] = stop
        self._indexed = max(self._indexed, end)
        if k <= 0:
            return []
        for n in range(min(MAX_NGRAM, end), MIN_NGRAM - 1, -1):
            start = self._next.get(tuple(context[end - n :]))
            if start is not None:
                return context[start : start + k]
        return []
