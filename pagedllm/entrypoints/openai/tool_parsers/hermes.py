"""``hermes``: calls as JSON objects between ``<tool_call>`` and ``</tool_call>``.

    I'll look both up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Tokyo"}}
    </tool_call>

The format of Hermes 2 Pro and later, and of the Qwen2.5 and Qwen3 chat templates (use this
parser for those models). Content may come before, between and after the blocks. A block
whose JSON is not a call object (or a list of them) is content. The last block may lack its
end marker (generation stopped there). The markers are plain text in these tokenizers.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    HOLD, Segment, ToolParser, content_tail, read_json_calls,
)
from pagedllm.entrypoints.openai.tool_parsers.partial import skip_space

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos: int | None = 0
        while (start := text.find(START, pos)) >= 0:
            segments.append(text[pos:start])
            block, pos = _block(text, start, final)
            segments.extend(block)
            if pos is None:
                return segments
        segments.extend(content_tail(text[pos:], (START,), final))
        return segments


def _block(text: str, start: int, final: bool) -> tuple[list[Segment], int | None]:
    """The block at ``text[start]``: its segments and the index after it (None: it runs to
    the end of the text)."""
    body = skip_space(text, start + len(START))
    found = read_json_calls(text, body, final)
    if found is not None:
        calls, end = found
        if end is None:
            return [*calls, HOLD], None
        after = skip_space(text, end)
        if text.startswith(END, after):
            return [*calls], after + len(END)
        if END.startswith(text[after:]):  # no end marker yet, or none at all
            return [*calls, *([] if final else [HOLD])], None
    close = text.find(END, body)
    if close < 0:
        return [text[start:] if final else HOLD], None
    return [text[start:close + len(END)]], close + len(END)
