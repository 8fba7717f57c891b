"""From generated text to output events: the chat pipeline's output path.

Every piece of generated text (already stop-trimmed by the engine) goes
through an OutputParser (chat/output_parser.py), which holds back
tool-call markup (streaming a call's arguments once its name is known) and
routes `<think>` text to reasoning. What it releases becomes ReasoningDelta,
TextDelta, ToolCallDelta and ToolCallDropped events; a dialect streams them as
chunks or folds them into one message, so streaming and non-streaming agree.
"""

from __future__ import annotations

from flashserve.server.chat.conversation import (
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallDropped,
)
from flashserve.server.chat.output_parser import OutputParser, Parsed
from flashserve.server.chat.tooling import ChatPlan


class ChatOutput:
    """Output events from the generated text of one chat request."""

    def __init__(self, plan: ChatPlan, prompt_text: str):
        markers = plan.tooling.reasoning
        self._parser = OutputParser(
            reasoning=markers,
            in_reasoning=bool(markers and markers.prompt_opens_reasoning(prompt_text)),
            tool_format=plan.tooling.tool_format,
            tools=plan.tools,
            max_calls=None if plan.parallel else 1,
        )

    def feed(self, text: str) -> list[OutputEvent]:
        """Newly generated text -> events to send now (may be none while holding back)."""
        return _events(self._parser.feed(text)) if text else []

    def finish(self, engine_reason: str) -> list[OutputEvent]:
        """Generation ended (stop | length): release whatever is held back."""
        return _events(self._parser.finish(cut=engine_reason == "length"))

    def finish_reason(self, engine_reason: str) -> str:
        """The engine's reason (stop | length) -> the pipeline's (tool_calls after a call)."""
        if self._parser.tool_calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def _events(parsed: Parsed) -> list[OutputEvent]:
    out: list[OutputEvent] = []
    if parsed.reasoning:
        out.append(ReasoningDelta(parsed.reasoning))
    if parsed.content:
        out.append(TextDelta(parsed.content))
    out.extend(parsed.tool_calls)
    out.extend(ToolCallDropped(index) for index in parsed.dropped)
    return out
