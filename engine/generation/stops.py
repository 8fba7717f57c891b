"""Stop strings matched on generated text, never emitted.

Text that could be the start of a stop string is held back until the next
piece shows whether it is one, so a streamed response never shows part of a
stop string that is later cut.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.hit = False
        self.matched: str | None = None  # which stop string ended the text, once hit

    def feed(self, piece: str) -> str:
        """Add newly decoded text; return what is safe to emit now."""
        if self.hit or not self.stops:
            return "" if self.hit else piece
        text = self._held + piece
        found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda hit: hit[0])
            self.hit = True
            self._held = ""
            return text[:cut]
        keep = self._longest_partial_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """Release held-back text at the end of generation."""
        held, self._held = self._held, ""
        return "" if self.hit else held

    def _longest_partial_suffix(self, text: str) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-n:]):
                    best = n
                    break
        return best
