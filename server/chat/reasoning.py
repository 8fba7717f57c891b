"""Reasoning markers: which text of a reply is the model thinking.

The markers come from the tokenizer the way mlx-lm finds them (`<think>`,
`<longcat_think>`, `<|think:start|>`, channel markers...), or from the chat
template when the vocabulary lacks them. The `reasoning_parser` setting
overrides: "none" turns reasoning parsing off, "think" forces
`<think>`/`</think>`, "auto" (or unset) infers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashserve.engine.weights.tokenizer import hf_tokenizer

NAMES = ("auto", "none", "think", "qwen3", "deepseek_r1")


@dataclass(frozen=True)
class ReasoningMarkers:
    start: str
    end: str

    def prompt_opens_reasoning(self, prompt_text: str) -> bool:
        """Whether the prompt leaves the model inside a reasoning block.

        Templates such as DeepSeek-R1's and Qwen3.5's end the generation
        prompt with the start marker, so the reply begins mid-thought and
        only the end marker shows up in the output.
        """
        start = prompt_text.rfind(self.start)
        return start >= 0 and start > prompt_text.rfind(self.end)


THINK = ReasoningMarkers("<think>", "</think>")


def check_setting(value: str | None) -> None:
    if value is not None and value not in NAMES:
        raise ValueError(f"unknown reasoning parser {value!r} (known: {', '.join(NAMES)})")


def resolve_markers(tokenizer: Any, setting: str | None) -> ReasoningMarkers | None:
    """The markers for this model, or None when reasoning is not parsed."""
    check_setting(setting)
    if setting == "none":
        return None
    if setting in ("think", "qwen3", "deepseek_r1"):
        return THINK
    start = getattr(tokenizer, "think_start", None)
    end = getattr(tokenizer, "think_end", None)
    if isinstance(start, str) and isinstance(end, str) and start and end:
        return ReasoningMarkers(start, end)
    hf = hf_tokenizer(tokenizer)
    template = getattr(hf, "chat_template", None)
    if isinstance(template, str) and THINK.start in template and THINK.end in template:
        return THINK
    return None
