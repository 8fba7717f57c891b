"""Split generated text into content, reasoning and tool calls, as it streams.

The engine hands over text deltas; `OutputParser.feed` turns each into a
`Parsed` piece: content, reasoning and tool-call deltas. Text that might be the start of a marker is
held back until the next piece decides it, so no marker ever leaks into
content, even when a marker arrives split over several tokens.

A tool-call block is parsed whole at its end marker: only a complete, valid
call of an offered tool becomes `tool_calls`. In formats whose calls are a
JSON envelope that names the function first (Hermes / Qwen), the call is
announced as soon as its name is complete and its arguments stream as the
model writes them (chat/call_stream.py); other formats send a call in one
piece when it is complete. A complete block that does not parse goes back to
content verbatim with a logged warning, unless it had already been announced:
then it is dropped (a `dropped` index: non-streaming responses leave it out;
a stream has already sent its fragments and sends nothing more for it). A
block the output ends inside (cut off by max_tokens, or the model stopped) is
dropped the same way, never returned as content: clients send content back in
the next turn's history, and unfinished markup there would teach the model to
write it. Streaming and non-streaming responses use the same parser, so they
agree on every call that completes.
"""

from __future__ import annotations

import json
import logging
import secrets
import string
from dataclasses import dataclass, field

from flashserve.server.chat.call_stream import CallStream
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
    dropped: list[int] = field(default_factory=list)  # announced calls that did not complete

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.dropped)

    def merge(self, other: Parsed) -> Parsed:
        return Parsed(
            self.content + other.content,
            self.reasoning + other.reasoning,
            self.tool_calls + other.tool_calls,
            self.dropped + other.dropped,
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
        max_calls: int | None = None,
    ):
        """`max_calls`: calls kept at most (1 for parallel_tool_calls false); later
        blocks are read and left out, never announced and never content."""
        self._reasoning = reasoning
        self._max_calls = max_calls
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
        self._live: CallStream | None = None  # reads the current block as it grows
        self._live_call: ToolCall | None = None  # the current block's call, once announced
        self._next_index = 0  # indices of dropped calls are never reused
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
            streams = fmt.name == "hermes" and not self._calls_full()
            self._live = CallStream(self._offered()) if streams else None
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
                out = self._stream(block)
                return out.merge(self._calls(block, fmt.start + block + fmt.end))
        if not final:
            return self._stream(self._block) or None
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

    def _offered(self) -> set[str] | None:
        if self._tools is None:
            return None
        return {t["function"]["name"] for t in self._tools if "function" in t}

    def _stream(self, block: str) -> Parsed:
        """The announcement and argument fragments of the block's call, as far as written."""
        if self._live is None:
            return Parsed()
        fragment = self._live.advance(block)
        out = Parsed()
        if fragment.name is not None:
            self._held_ws = ""  # layout before a call
            self._live_call = ToolCall(new_call_id(), fragment.name, "")
            out.tool_calls.append(
                ToolCallDelta(self._next_index, self._live_call.id, fragment.name)
            )
        if fragment.arguments:
            assert self._live_call is not None
            self._live_call.arguments += fragment.arguments
            out.tool_calls.append(ToolCallDelta(self._next_index, arguments=fragment.arguments))
        return out

    def _drop_live(self, why: str) -> Parsed:
        """An announced call that did not complete as a valid call: it is left out."""
        call, self._live_call, self._live = self._live_call, None, None
        assert call is not None
        log.warning("tool call %s (%s) was streamed but %s; it is dropped", call.id, call.name, why)
        self._strip_lead = True
        index = self._next_index
        self._next_index += 1
        return Parsed(dropped=[index])

    def _unfinished(self, block: str) -> Parsed:
        self._held_ws = ""  # layout before the dropped call
        if self._live_call is not None:
            return self._drop_live("the output ended inside it")
        self._live = None
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
        if self._live_call is not None:
            return self._complete_live(block)
        self._live = None
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
        if self._max_calls is not None:
            keep = max(0, self._max_calls - len(self.tool_calls))
            if len(calls) > keep:
                log.info(
                    "parallel_tool_calls is false: %d more call(s) left out", len(calls) - keep
                )
                calls = calls[:keep]
        for name, arguments in calls:
            call = ToolCall(new_call_id(), name, arguments)
            index = self._next_index
            self._next_index += 1
            self.tool_calls.append(call)
            out.tool_calls.append(ToolCallDelta(index, call.id, name, ""))
            out.tool_calls.append(ToolCallDelta(index, arguments=arguments))
        return out

    def _calls_full(self) -> bool:
        return self._max_calls is not None and len(self.tool_calls) >= self._max_calls

    def _complete_live(self, block: str) -> Parsed:
        """The end of an announced call's block: keep it if the parser agrees with
        what was streamed, send its arguments now if none could be streamed."""
        call, live = self._live_call, self._live
        assert call is not None and live is not None
        try:
            calls = self._format.parse_calls(block, self._tools)  # type: ignore[union-attr]
        except ToolCallParseError as exc:
            return self._drop_live(f"is malformed ({exc})")
        if len(calls) != 1 or calls[0][0] != call.name:
            return self._drop_live("does not parse as that one call")
        parsed = calls[0][1]
        out = Parsed()
        if not call.arguments:
            call.arguments = parsed
            out.tool_calls.append(ToolCallDelta(self._next_index, arguments=parsed))
        elif not live.closed or _json_or_none(call.arguments) != json.loads(parsed):
            return self._drop_live("its streamed arguments are not what the parser read")
        self._live_call, self._live = None, None
        self._next_index += 1
        self.tool_calls.append(call)
        self._held_ws = ""
        self._strip_lead = True
        return out


def _json_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
