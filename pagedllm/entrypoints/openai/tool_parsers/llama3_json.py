"""``llama3_json``: Llama 3.1 / 3.2 JSON tool calls.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The calls start after a ``<|python_tag|>``, or at the first object of the output that is a
call (where the output starts, or after prose: "Here is the result: {...}", which the
models write too). Each call is an object with ``name`` and ``parameters`` (``arguments`` is
accepted too); calls are separated by ``;``. Text before and after the calls is content. An
object without a name and parameters is not a call, so JSON content is not mistaken for
one; while an object of the prose is still open, the content from its ``{`` waits until it
is known. ``<|python_tag|>`` is optional, so the parser works whether or not decoding skips
special tokens.
"""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.tool_parsers.base import (
    HOLD, Segment, ToolParser, content_tail, read_json_calls,
)
from pagedllm.entrypoints.openai.tool_parsers.partial import skip_space

PYTHON_TAG = "<|python_tag|>"
_CALL_OPTIONS = {"args_keys": ("parameters", "arguments"), "args_required": True}
# Where an object with a key may start in prose (the text may end inside it): only there is
# a call read, so code and prose full of other braces cost one regex scan, not a parse each.
_OBJECT_START = re.compile(r'\{\s*(?:"|$)')


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> list[Segment]:
        first = skip_space(text, 0)
        if text.startswith("{", first):
            return [text[:first], *_calls(text, first, first, final)]
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            return [text[:tag], *_calls(text, tag, tag + len(PYTHON_TAG), final)]
        for opening in _OBJECT_START.finditer(text):
            brace = opening.start()
            found = read_json_calls(text, brace, final, **_CALL_OPTIONS)
            if found is not None and (found[0] or found[1] is None):
                # A call, or an object still open that may turn out to be one.
                return [text[:brace], *(_calls(text, brace, brace, final) if found[0]
                                        else [HOLD])]
        return content_tail(text, (PYTHON_TAG, "{"), final)


def _calls(text: str, markup: int, pos: int, final: bool) -> list[Segment]:
    """The calls from ``text[pos]`` on; with none, the text from ``markup`` on is content."""
    segments: list[Segment] = []
    while True:
        pos = skip_space(text, pos)
        if pos == len(text) and not final:
            return [*segments, HOLD]
        found = read_json_calls(text, pos, final, **_CALL_OPTIONS)
        if found is None:
            return [*segments, text[markup:] if final else HOLD]
        calls, end = found
        segments.extend(calls)
        if end is None:
            return [*segments, HOLD]
        pos = skip_space(text, end)
        if text.startswith(";", pos):
            pos = skip_space(text, pos + 1)
        if not text.startswith("{", pos):
            return [*segments, *content_tail(text[pos:], (), final)]
        markup = pos
