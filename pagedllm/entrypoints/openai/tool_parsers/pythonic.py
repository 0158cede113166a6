"""``pythonic``: calls as a Python list of function calls (Llama 3.2, Llama 4).

    [get_weather(city="San Francisco", unit="celsius"), get_time()]

The output starts (after any whitespace) with the list, which Llama 4 wraps in
``<|python_start|>`` ... ``<|python_end|>`` (kept when decoding keeps special tokens); text
after it is content. ``llama4_pythonic`` (vLLM's name for Llama 4) is the same. Arguments
are keywords whose values are Python literals (str, int, float, bool, None, lists, tuples,
dicts), turned into a JSON object. The list is read with ``ast`` and the values with
``ast.literal_eval``: nothing is evaluated. A list with anything else in it (a positional
argument, a name, an expression, a value JSON cannot hold) is content, whole.

A stream emits a call's name once ``name(`` is read, and its arguments, whole, once the
call's closing parenthesis is.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Hashable

from pagedllm.entrypoints.openai.tool_parsers.base import (
    HOLD, PartialCall, Segment, ToolParser, content_tail,
)
from pagedllm.entrypoints.openai.tool_parsers.partial import dumps_json, skip_space

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_FIRST_CALL = re.compile(r"\[\s*([A-Za-z_]\w*)\s*\(")
_NEXT_CALL = re.compile(r"\s*,\s*([A-Za-z_]\w*)\s*\(")
_LIST_END = re.compile(r"\s*\]")
_BRACKET = re.compile(r"\]")
# A ")" that may close a call of the list: one followed by "," or "]" or the end of the text.
_CALL_END = re.compile(r"\)(?=\s*(?:[,\]]|$))")
_CALL_END_TRIES = 8
# What the start of a list may look like before its first name( is read.
_UNDECIDED_START = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def scan(self, text: str, final: bool) -> list[Segment]:
        markup = skip_space(text, 0)
        start = markup
        if text.startswith(PYTHON_START, start):
            start = skip_space(text, start + len(PYTHON_START))
        elif not final and text[start:] and PYTHON_START.startswith(text[start:]):
            return [HOLD]
        head = _FIRST_CALL.match(text, start)
        if head is None:
            if not final and (start == len(text) or _UNDECIDED_START.fullmatch(text, start)):
                return [HOLD]
            return content_tail(text, (), final)
        found = _final_list(text, start) if final else _partial_list(text, start, head.group(1))
        if found is None:
            return [text] if final else [HOLD]
        calls, end = found
        if end is not None:
            after = skip_space(text, end)
            if text.startswith(PYTHON_END, after):
                end = after + len(PYTHON_END)
            elif not final and PYTHON_END.startswith(text[after:]):
                end = None  # the end marker may still come
        tail = [HOLD] if end is None else content_tail(text[end:], (), final)
        return [text[:markup], *calls, *tail]


class Llama4PythonicToolParser(PythonicToolParser):
    """vLLM's name for the pythonic calls of Llama 4."""

    name = "llama4_pythonic"


def _final_list(text: str, start: int) -> tuple[list[PartialCall], int] | None:
    """The calls of the list at ``text[start]`` and the index after it; None if it is no list
    of calls. The list ends at the first ``]`` where it parses."""
    for close in (m.start() for m in _BRACKET.finditer(text, start)):
        elements = _list_elements(text[start:close + 1])
        if elements is not None:
            calls = _calls(elements, start)
            return None if calls is None else (calls, close + 1)
    return None


def _partial_list(text: str, start: int,
                  first_name: str) -> tuple[list[PartialCall], int | None] | None:
    """The calls of the list being generated at ``text[start]``: the complete ones, then the
    open one (its name only), and the index after the list once it is closed. None if a
    complete call is not valid.

    Only the last few ``)`` that may close a call are tried, so a scan costs one parse or a
    few; a call whose end is not among them is reported complete by a later scan.
    """
    ends = [m.start() for m in _CALL_END.finditer(text, start)]
    for paren in reversed(ends[-_CALL_END_TRIES:]):
        elements = _list_elements(text[start:paren + 1] + "]")
        if elements is not None:
            calls = _calls(elements, start)
            if calls is None:
                return None
            pos = paren + 1
            break
    else:
        return [PartialCall((start, 0), first_name, "")], None
    if opened := _NEXT_CALL.match(text, pos):
        return [*calls, PartialCall((start, len(calls)), opened.group(1), "")], None
    if closed := _LIST_END.match(text, pos):
        return calls, closed.end()
    return calls, None


def _list_elements(source: str) -> list[ast.expr] | None:
    """The elements of a Python list display; None if the source is not one."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return tree.body.elts if isinstance(tree.body, ast.List) else None


def _calls(elements: list[ast.expr], start: int) -> list[PartialCall] | None:
    """The calls of a list's elements, keyed ``(start, i)``; None unless all are valid."""
    calls = [_call(node, (start, i)) for i, node in enumerate(elements)]
    return calls if calls and None not in calls else None


def _call(node: ast.expr, key: Hashable) -> PartialCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(keyword.arg is None for keyword in node.keywords):
        return None
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return PartialCall(key, node.func.id, dumps_json(arguments))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
