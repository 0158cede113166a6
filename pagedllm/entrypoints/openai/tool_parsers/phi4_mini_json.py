"""``phi4_mini_json``: Phi-4-mini's calls, a JSON list after ``functools``.

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

Each call is an object with ``name`` and ``arguments`` (``parameters`` is accepted too).
Content may come before ``functools`` and after the list. A ``functools`` not followed by a
list of calls (``import functools``, a list of other values) is content.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    HOLD, Segment, ToolParser, content_tail, read_json_calls,
)
from pagedllm.entrypoints.openai.tool_parsers.partial import skip_space

FUNCTOOLS = "functools"
_CALL_OPTIONS = {"args_keys": ("arguments", "parameters")}


class Phi4MiniJsonToolParser(ToolParser):
    name = "phi4_mini_json"

    def scan(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        while (start := text.find(FUNCTOOLS, pos)) >= 0:
            at = skip_space(text, start + len(FUNCTOOLS))
            if at == len(text) and not final:
                return [*segments, text[pos:start], HOLD]  # a list may follow
            found = read_json_calls(text, at, final, **_CALL_OPTIONS) \
                if text.startswith("[", at) else None
            if found is None:  # no list of calls: the word is content
                segments.append(text[pos:at])
                pos = at
                continue
            calls, end = found
            segments.extend([text[pos:start], *calls])
            if end is None:
                return [*segments, HOLD]
            pos = end
        segments.extend(content_tail(text[pos:], (FUNCTOOLS,), final))
        return segments
