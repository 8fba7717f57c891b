"""From generated text to assistant-message deltas: the chat route's output path.

The chat route feeds every piece of generated text (already stop-trimmed by the
engine) to an OutputProcessor, which returns the ChatDeltas to send. The plain
processor passes text through as `content`. A tool-call or reasoning parser
subclasses OutputProcessor (server/chat_tools.py: ChatOutputProcessor holds back
`<tool_call>...</tool_call>` to emit `tool_calls` deltas and routes `<think>` text
to `reasoning_content`). Streaming sends the deltas as chunks;
non-streaming folds the same deltas into one message with MessageBuilder, so
both paths always agree.
"""

from __future__ import annotations

from .schemas import (
    ChatDelta,
    ChatMessageOut,
    FunctionCallOut,
    ToolCallOut,
)


class OutputProcessor:
    """Plain text: every piece of generated text is message content."""

    def feed(self, text: str) -> list[ChatDelta]:
        """Newly generated text -> deltas to send now (may be none while holding back)."""
        return [ChatDelta(content=text)] if text else []

    def finish(self) -> list[ChatDelta]:
        """Generation ended: release whatever is held back."""
        return []

    def finish_reason(self, engine_reason: str) -> str:
        """The engine's reason (stop | length) -> the API's (a parser may say tool_calls)."""
        return engine_reason


class MessageBuilder:
    """Folds streamed deltas into the one message of a non-streaming response."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, str]] = {}

    def add(self, deltas: list[ChatDelta]) -> None:
        for delta in deltas:
            if delta.content:
                self._content.append(delta.content)
            if delta.reasoning_content:
                self._reasoning.append(delta.reasoning_content)
            for call in delta.tool_calls or []:
                slot = self._calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                if call.function is not None:
                    slot["name"] = call.function.name or slot["name"]
                    slot["arguments"] += call.function.arguments or ""

    @property
    def text(self) -> str:
        return "".join(self._content)

    def message(self) -> ChatMessageOut:
        calls = [
            ToolCallOut(
                id=slot["id"],
                function=FunctionCallOut(name=slot["name"], arguments=slot["arguments"]),
            )
            for _, slot in sorted(self._calls.items())
        ]
        return ChatMessageOut(
            content=self.text if (self._content or not calls) else None,
            reasoning_content="".join(self._reasoning) if self._reasoning else None,
            tool_calls=calls or None,
        )
