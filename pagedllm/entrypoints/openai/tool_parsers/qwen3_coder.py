"""``qwen3_coder``: calls as XML-like blocks of parameters (Qwen3-Coder's chat template).

    Let me check.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    San Francisco
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is the raw text between its tags, less one newline on each side. It
ends at ``</parameter>``, or at the next ``<parameter=`` or ``</function>`` when its end tag
is missing. Values are typed by the request's tool (``for_tools``): the type its
``parameters.properties`` give the name (``string`` stays text; integers, numbers and
booleans are read as such; objects and arrays as JSON, else as Python literals; ``null``
is null for any type), falling back to the text when it does not read as that type; a
parameter the tool does not declare stays text. When the same name comes twice, the first
value counts. A ``<tool_call>`` block may hold several functions; a ``<function=`` block
outside one is a call too (the model sometimes leaves the wrapper out). A block without a
function is content, verbatim; the last block may lack its end tags (generation stopped
there). Content may come before, between and after the blocks.

A stream emits a call's name once ``<function=name>`` is read, then its arguments as its
parameters end, a text parameter's value character by character as it is generated.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import (
    HOLD, PartialCall, Segment, ToolParser, content_tail,
)
from pagedllm.entrypoints.openai.tool_parsers.partial import (
    dumps_json, held_suffix_len, skip_space, stable_dumps,
)

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# Where a parameter's value ends (its own end tag, or the next tag when that is missing).
_VALUE_END = re.compile(re.escape(PARAMETER_END) + "|" + re.escape(PARAMETER) + "|"
                        + re.escape(FUNCTION_END))
# What the end of a value still being generated may turn out to be the start of (the
# newline before a tag is not part of the value).
_VALUE_END_MARKERS = tuple(newline + tag for tag in (PARAMETER_END, PARAMETER, FUNCTION_END)
                           for newline in ("\n", ""))
_TEXT_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, tokenizer=None, tools: list[dict] | None = None) -> None:
        super().__init__(tokenizer)
        self._types = _parameter_types(tools or [])

    def for_tools(self, tools: list[dict] | None) -> Qwen3CoderToolParser:
        return Qwen3CoderToolParser(self.tokenizer, tools)

    def scan(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos: int | None = 0
        while (opened := _next_opening(text, pos)) is not None:
            start, wrapped = opened
            segments.append(text[pos:start])
            block, pos = self._block(text, start, wrapped, final)
            segments.extend(block)
            if pos is None:
                return segments
        segments.extend(content_tail(text[pos:], (START, FUNCTION), final))
        return segments

    def _block(self, text: str, start: int, wrapped: bool,
               final: bool) -> tuple[list[Segment], int | None]:
        """The block at ``text[start]`` (a ``<tool_call>`` when ``wrapped``, else a bare
        function): its segments and the index after it (None: it runs to the end)."""
        calls: list[Segment] = []
        pos = start + len(START) if wrapped else start
        while True:
            at = skip_space(text, pos) if wrapped else pos
            if not text.startswith(FUNCTION, at):
                break
            if not final and text.find(">", at + len(FUNCTION)) < 0:
                return [*calls, HOLD], None  # its name is still being generated
            call, end = self._function(text, at, final)
            if call is None:
                break
            calls.append(call)
            if end is None:
                return [*calls, *([] if final else [HOLD])], None
            pos = end
            if not wrapped:
                return calls, end
        if not wrapped:  # ``<function=`` with no name: the marker is content
            return [FUNCTION], start + len(FUNCTION)
        if not calls:  # no function where one should start: content, up to the end tag
            if not final and FUNCTION.startswith(text[skip_space(text, pos):]):
                return [HOLD], None  # not decided yet
            close = text.find(END, pos)
            if close < 0:
                return [text[start:] if final else HOLD], None
            return [text[start:close + len(END)]], close + len(END)
        after = skip_space(text, pos)
        if text.startswith(END, after):
            return calls, after + len(END)
        if END.startswith(text[after:]):  # no end tag yet, or none at all
            return [*calls, *([] if final else [HOLD])], None
        return calls, pos  # what follows the functions is content

    def _function(self, text: str, at: int,
                  final: bool) -> tuple[PartialCall | None, int | None]:
        """The function at ``text[at]`` (``<function=``, its name read up to ``>``): its
        call and the index after its end tag (None: it runs to the end of the text);
        (None, None) when its name is no name."""
        name_start = at + len(FUNCTION)
        name_end = text.find(">", name_start)
        name = text[name_start:name_end].strip() if name_end >= 0 else ""
        if not name or any(c in name for c in "<\n"):
            return None, None
        close = text.find(FUNCTION_END, name_end)
        body_end = len(text) if close < 0 else close
        arguments = self._arguments(text, name_end + 1, body_end, name, close >= 0 or final)
        return PartialCall((at,), name, arguments), (None if close < 0 else close + len(FUNCTION_END))

    def _arguments(self, text: str, pos: int, end: int, function: str, complete: bool) -> str:
        """The arguments text of the function body ``text[pos:end]``: all of it when the
        body is ``complete``, else the prefix its parameters so far fix."""
        values: dict[str, Any] = {}
        open_text: tuple[str, str] | None = None  # a text parameter still being generated
        types = self._types.get(function, {})
        while (at := text.find(PARAMETER, pos, end)) >= 0:
            name_end = text.find(">", at + len(PARAMETER), end)
            if name_end < 0:
                break  # its name is still being generated
            name = text[at + len(PARAMETER):name_end].strip()
            value_end = _VALUE_END.search(text, name_end + 1, end)
            closed = value_end is not None or complete
            raw = text[name_end + 1:value_end.start() if value_end else end]
            pos = value_end.end() if value_end and value_end.group() == PARAMETER_END else (
                value_end.start() if value_end else end)
            if name in values:
                continue  # the first value of a name counts
            if closed:
                values[name] = _typed(_trim(raw), types.get(name))
            elif _is_text(types.get(name)):
                raw = raw[1:] if raw.startswith("\n") else raw
                held = raw[:len(raw) - held_suffix_len(raw, _VALUE_END_MARKERS)]
                if not "null".startswith(held.lower()):  # "null" would be read as null
                    open_text = (name, held)
            if not closed:
                break
        if complete:
            return dumps_json(values)
        if open_text is not None:
            values[open_text[0]] = open_text[1]
            return stable_dumps(values, '"}')
        return stable_dumps(values, "}")


def _next_opening(text: str, pos: int) -> tuple[int, bool] | None:
    """The next block from ``pos``: (its index, whether it is a ``<tool_call>``), or None."""
    wrapped, bare = text.find(START, pos), text.find(FUNCTION, pos)
    if wrapped >= 0 and (bare < 0 or wrapped < bare):
        return wrapped, True
    return (bare, False) if bare >= 0 else None


def _parameter_types(tools: list[dict]) -> dict[str, dict[str, str | None]]:
    """Each function's parameters by name, with the JSON type its schema gives (None when
    it gives none)."""
    types: dict[str, dict[str, str | None]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        declared: dict[str, str | None] = {}
        for name, schema in (properties or {}).items() if isinstance(properties, dict) else ():
            kind = schema.get("type") if isinstance(schema, dict) else None
            declared[name] = str(kind).strip().lower() if isinstance(kind, str) else None
        types[function["name"]] = declared
    return types


def _is_text(kind: str | None) -> bool:
    return kind is None or kind in _TEXT_TYPES


def _trim(raw: str) -> str:
    """A value less one newline on each side."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _typed(value: str, kind: str | None) -> Any:
    """``value`` read as its declared JSON type; the text itself when it does not read so."""
    if value.lower() == "null":
        return None
    if _is_text(kind):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value.strip())
        except ValueError:
            return value
    if kind.startswith(("num", "float", "double")):
        try:
            number = float(value.strip())
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() and abs(number) < 2**53 else number
    if kind in ("boolean", "bool", "binary"):
        return value.strip().lower() == "true"
    for read in (json.loads, ast.literal_eval):
        try:
            result = read(value)
            dumps_json(result)
            return result
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            continue
    return value

