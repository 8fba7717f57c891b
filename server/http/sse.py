"""The one event-stream response every streaming route returns.

A JSON chunk may carry U+2028, U+2029 or U+0085 raw inside a string (pydantic
writes non-ASCII as is). SSE splits lines only at CR and LF, but common client
line readers (httpx's `iter_lines`, Python's `str.splitlines`) also split at
those three, and cut the event in half. They are escaped here: the JSON means
the same, and every reader sees one line per event.
"""

from collections.abc import AsyncIterable
from typing import Any

from sse_starlette import EventSourceResponse

_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def escape_line_breaks(data: str) -> str:
    """`data` (one JSON document) with the Unicode line breaks that are not CR or LF
    written as JSON escapes."""
    return data.translate(_LINE_BREAKS)


async def _escaped(items: AsyncIterable[Any]) -> AsyncIterable[Any]:
    async for item in items:
        if isinstance(item, str):
            yield escape_line_breaks(item)
        elif isinstance(item, dict) and isinstance(item.get("data"), str):
            yield item | {"data": escape_line_breaks(item["data"])}
        else:
            yield item


class EventStream(EventSourceResponse):
    """An `EventSourceResponse` with LF line ends whose data lines survive any
    client's line splitting."""

    def __init__(self, items: AsyncIterable[Any], **kwargs: Any) -> None:
        super().__init__(_escaped(items), sep="\n", **kwargs)
