"""Split generated text into content, reasoning and tool calls, as it streams.

The engine hands over text deltas; `OutputParser.feed` turns each into a
`Parsed` piece: content, reasoning and tool-call deltas. Text that might be the start of a marker is
held back until the next piece decides it, so no marker ever leaks into
content, even when a marker arrives split over several tokens.

A tool-call block is buffered until its end marker and parsed whole: only a
complete, valid call of an offered tool becomes `tool_calls`. A complete
block that does not parse goes back to content verbatim with a logged
warning; a block the output ends inside (cut off by max_tokens, or the model
stopped) is dropped with a warning, never returned as content: clients send
content back in the next turn's history, and unfinished markup there would
teach the model to write it. The cost is that a
call's arguments arrive in one fragment when the call is complete rather
than token by token. Streaming and non-streaming responses use the same
parser, so the two always agree.
"""

from __future__ import annotations

import logging
import secrets
import string
from dataclasses import dataclass, field

from flashserve.server.chat.conversation import ToolCallDelta
from flashserve.server.chat.reasoning import ReasoningMarkers
from flashserve.server.chat.tool_parsers import PYTHON_TAG, ToolCallParseError, ToolFormat

log = logging.getLogger(__name__)

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def merge(self, other: Parsed) -> Parsed:
        return Parsed(
            self.content + other.content,
            self.reasoning + other.reasoning,
            self.tool_calls + other.tool_calls,
        )


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class OutputParser:
    """One per response. feed() each text delta, then finish() once."""

    def __init__(
        self,
        *,
        reasoning: ReasoningMarkers | None = None,
        in_reasoning: bool = False,
        tool_format: ToolFormat | None = None,
        tools: list[dict] | None = None,
    ):
        self._reasoning = reasoning
        self._format = tool_format if tools else None  # no tools offered: all text is content
        self._tools = tools
        self._buf = ""
        # start: before the first visible text (a reasoning block may open here)
        # reasoning / content / tool: inside that part of the reply
        # done: a block that runs to the end of the output was parsed
        self._state = "reasoning" if (reasoning and in_reasoning) else "start"
        self._strip_lead = False  # drop whitespace after reasoning and after calls
        self._held_ws = ""  # trailing whitespace of content, held while tools are active
        self._block = ""  # text of the current tool-call block
        self.content = ""
        self.reasoning_text = ""
        self.tool_calls: list[ToolCall] = []
        self._cut = False

    # -- public --------------------------------------------------------------------

    def feed(self, text: str) -> Parsed:
        self._buf += text
        return self._run(final=False)

    def finish(self, cut: bool = False) -> Parsed:
        """Release everything held back; call once after the last feed(). `cut`: the
        output was cut short (max_tokens), so a block it ends in is unfinished."""
        self._cut = cut
        out = self._run(final=True)
        if self._held_ws and not self.tool_calls:
            out.content += self._held_ws
            self.content += self._held_ws
        self._held_ws = ""
        return out

    def _run(self, final: bool) -> Parsed:
        out = Parsed()
        while (step := getattr(self, f"_step_{self._state}")(final)) is not None:
            out = out.merge(step)
        self.content += out.content
        self.reasoning_text += out.reasoning
        return out

    # -- states: each consumes input and returns a Parsed, or None when it needs more

    def _step_start(self, final: bool) -> Parsed | None:
        markers = self._reasoning
        stripped = self._buf.lstrip()
        if markers:
            if stripped.startswith(markers.start):
                self._buf = stripped[len(markers.start) :]
                self._state = "reasoning"
                return Parsed()
            if not final and markers.start.startswith(stripped):
                return None  # nothing yet, or a partial marker: wait
        fmt = self._format
        if fmt is not None and fmt.start == "":
            # Bare-JSON formats: a call only counts at the start of the output.
            if not final and (not stripped or PYTHON_TAG.startswith(stripped)):
                return None
            if stripped.startswith(("{", "[", PYTHON_TAG)):
                self._block, self._buf = self._buf, ""
                self._state = "tool"
                return Parsed()
        self._state = "content"
        return Parsed()

    def _step_reasoning(self, final: bool) -> Parsed | None:
        end = self._reasoning.end  # type: ignore[union-attr]
        at = self._buf.find(end)
        if at >= 0:
            text, self._buf = self._buf[:at], self._buf[at + len(end) :]
            self._state = "content"
            self._strip_lead = True
            return Parsed(reasoning=text)
        keep = 0 if final else _partial_suffix(self._buf, end)
        text = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(text) :]
        return Parsed(reasoning=text) if text else None

    def _step_content(self, final: bool) -> Parsed | None:
        if self._strip_lead:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return None
            self._strip_lead = False
        fmt = self._format
        if fmt is None or fmt.start == "":
            text, self._buf = self._buf, ""
            return Parsed(content=text) if text else None
        at = self._buf.find(fmt.start)
        if at >= 0:
            text = self._buf[:at]
            self._buf = self._buf[at + len(fmt.start) :]
            self._block = ""
            self._state = "tool"
            return self._content(text)
        keep = 0 if final else _partial_suffix(self._buf, fmt.start)
        text = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(text) :]
        return self._content(text) if text else None

    def _step_tool(self, final: bool) -> Parsed | None:
        fmt = self._format
        assert fmt is not None
        self._block += self._buf
        self._buf = ""
        if fmt.end:
            at = self._block.find(fmt.end)
            if at >= 0:
                block, rest = self._block[:at], self._block[at + len(fmt.end) :]
                self._block, self._buf = "", rest
                self._state = "content"
                return self._calls(block, fmt.start + block + fmt.end)
        if not final:
            return None
        block, self._block = self._block, ""
        self._state = "done"
        if fmt.end:
            return self._unfinished(block)
        # Formats without an end marker: the block runs to the end of the output.
        return self._calls(block, fmt.start + block, cut=self._cut)

    def _step_done(self, final: bool) -> Parsed | None:
        if self._buf:
            text, self._buf = self._buf, ""
            return Parsed(content=text)
        return None

    # -- helpers -------------------------------------------------------------------

    def _content(self, text: str) -> Parsed:
        """Content, with trailing whitespace held back: whitespace around tool
        calls is layout, dropped when a call follows or ends the reply."""
        body = text.rstrip()
        if not body:
            self._held_ws += text
            return Parsed()
        out = Parsed(content=self._held_ws + body)
        self._held_ws = text[len(body) :]
        return out

    def _unfinished(self, block: str) -> Parsed:
        self._held_ws = ""  # layout before the dropped call
        log.warning(
            "the output ended inside a %s tool call (%d characters); the unfinished call "
            "is dropped",
            self._format.name if self._format else "?",
            len(block),
        )
        return Parsed()

    def _calls(self, block: str, raw: str, cut: bool = False) -> Parsed:
        fmt = self._format
        assert fmt is not None
        try:
            calls = fmt.parse_calls(block, self._tools)
        except ToolCallParseError as exc:
            if cut:
                return self._unfinished(block)
            log.warning(
                "model wrote a malformed %s tool call (%s); returned as content", fmt.name, exc
            )
            text, self._held_ws = self._held_ws + raw, ""
            return Parsed(content=text)
        self._held_ws = ""
        self._strip_lead = True
        out = Parsed()
        for name, arguments in calls:
            call = ToolCall(new_call_id(), name, arguments)
            index = len(self.tool_calls)
            self.tool_calls.append(call)
            out.tool_calls.append(ToolCallDelta(index, call.id, name, ""))
            out.tool_calls.append(ToolCallDelta(index, arguments=arguments))
        return out
