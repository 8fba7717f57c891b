"""Read a JSON tool call's name and arguments while the model is still writing it.

Hermes-style calls (`<tool_call>{"name": "f", "arguments": {...}}</tool_call>`,
what Qwen, Hermes and `tool_instructions` use) name the function before its
arguments, so a client can be told which function is being called, and then
be sent the arguments object as it grows, long before the call's end marker.
CallStream follows one block: once the envelope's name is complete (and is an
offered tool) it reports the name; after that, every character of the
arguments object as it arrives, ending at the object's closing brace. Only
text inside that object is ever sent, so the fragments joined are exactly the
object the model wrote. Whether that object is a valid call is still decided
by the format's own parser when the block ends (chat/output_parser.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import regex

# The envelope up to the first character of the arguments value. `regex`
# answers partial matches: a prefix that may still become this is not a failure.
_HEADER = regex.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


@dataclass
class Fragment:
    name: str | None = None  # set once: the call's function, when first known
    arguments: str = ""  # the next piece of the arguments object's text


class CallStream:
    """One tool-call block, read incrementally. `advance` it with the block's text so far."""

    def __init__(self, offered: set[str] | None):
        self._offered = offered
        self.name: str | None = None
        self.arguments = ""  # the arguments text sent so far
        self.closed = False  # the arguments object ended
        self.gave_up = False  # not an envelope this reads: the block is parsed whole
        self._start = -1  # where the arguments object starts in the block
        self._scan = 0  # how far into the block the object has been scanned
        self._depth = 0
        self._in_string = False
        self._escaped = False

    @property
    def announced(self) -> bool:
        return self.name is not None

    def advance(self, block: str) -> Fragment:
        """What of `block` (the call's text so far, growing) is new to send."""
        out = Fragment()
        if self.gave_up or self.closed:
            return out
        if self.name is None:
            match = _HEADER.match(block, partial=True)
            if match is None:
                self.gave_up = True
                return out
            if match.partial:
                return out
            try:
                name = json.loads(f'"{match.group(1)}"')
            except json.JSONDecodeError:
                self.gave_up = True
                return out
            if self._offered is not None and name not in self._offered:
                self.gave_up = True  # the parser will refuse it: never announce it
                return out
            self.name = out.name = name
            self._start = self._scan = match.end()
        if self._scan == self._start:
            # The header's trailing \s* may have matched before the whitespace arrived.
            while self._start < len(block) and block[self._start] in " \t\r\n":
                self._start += 1
            self._scan = self._start
            if len(block) <= self._start:
                return out
            if block[self._start] != "{":
                # Arguments written as a JSON string (or anything else): they are
                # sent whole once the block is parsed.
                self.closed = True
                return out
        end = self._scan_object(block)
        out.arguments = block[self._start + len(self.arguments) : end]
        self.arguments += out.arguments
        return out

    def _scan_object(self, block: str) -> int:
        """Scan on from where the last call stopped; the end of the object's text so far."""
        i = self._scan
        while i < len(block):
            char = block[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.closed = True
                    break
        self._scan = i
        return i
