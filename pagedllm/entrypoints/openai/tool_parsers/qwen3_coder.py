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

A parameter's value is the raw text between its tags, less one newline on each side. A
value may hold the markup itself (a coding agent writing a parser's fixture), so a tag ends
it only where the call's markup goes on around it (``_Value``): ``</parameter>`` followed
by the next parameter (one not given yet, and declared where the request's tool declares
its parameters) or by the function's end; such a parameter's tag alone (the end tag left
out); or ``</function>`` not followed, before the next block, by a stray end tag.

Values are typed by the request's tool (``for_tools``): the types its
``parameters.properties`` give the name (``type``, a list of types, ``anyOf`` / ``oneOf``
branches, a local ``$ref``). ``string`` stays text; integers, numbers and booleans are read
as such; objects and arrays as JSON, else as Python literals (a JSON string of one is read
once more); ``null`` is null (but stays text for a string that may not be null), and so is
``None`` where the schema allows null. A value falls back to its text when it reads as none
of its types; a parameter the tool does not declare, or that may be a string, stays text.

A ``<tool_call>`` block may hold several functions; a ``<function=`` block outside one is a
call too (the model sometimes leaves the wrapper out). A block without a function is
content, verbatim; the last block may lack its end tags (generation stopped there).
Content may come before, between and after the blocks.

A stream emits a call's name once ``<function=name>`` is read, then its arguments as its
parameters end, a text parameter's value character by character as it is generated. A tag
that may end a value holds the value back until what follows decides it; the last value
of a call is decided by the next block or the end of the output.
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
from pagedllm.structured.json_schema import resolve_pointer

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# The tags of a function body (which of them end a value: ``_Value``).
_BODY_TAG = re.compile(re.escape(PARAMETER_END) + "|" + re.escape(PARAMETER) + "|"
                       + re.escape(FUNCTION_END))
_STRAY_END = re.compile(re.escape(PARAMETER_END) + "|" + re.escape(FUNCTION_END))
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
        call and the index after its end tag (None: it runs to the end of the text, or its
        end is not decided yet); (None, None) when its name is no name."""
        name_start = at + len(FUNCTION)
        name_end = text.find(">", name_start)
        name = text[name_start:name_end].strip() if name_end >= 0 else ""
        if not name or any(c.isspace() or c in "<>{}\"'" for c in name):
            return None, None  # no name (a template's ``{{ tool.name }}`` left in the text)
        arguments, end = self._body(text, name_end + 1, name, final)
        return PartialCall((at,), name, arguments), end

    def _body(self, text: str, pos: int, function: str, final: bool) -> tuple[str, int | None]:
        """The arguments of the function body from ``text[pos]`` (all of them once the body
        is complete, else the prefix its parameters so far fix) and the index after its
        ``</function>`` (None: not found, or not decided yet)."""
        types = self._types.get(function) or {}
        values: dict[str, Any] = {}
        open_text: tuple[str, str] | None = None  # a text parameter still being generated
        end: int | None = None
        while True:
            tag = _BODY_TAG.search(text, pos)
            if tag is None:
                break  # the body runs to the end of the text
            if tag.group() != PARAMETER:
                if tag.group() == FUNCTION_END:
                    end = tag.end()
                    break
                pos = tag.end()  # a stray end tag between parameters
                continue
            name_end = text.find(">", tag.end())
            if name_end < 0:
                break  # its name is still being generated
            name = text[tag.end():name_end].strip()
            value = _Value(text, name_end + 1, name, values.keys(), types, final)
            kinds = types.get(name)
            if value.end is None:
                if name not in values and _is_text(kinds):
                    held = value.text_so_far()
                    if not _may_become_null(held, kinds):
                        open_text = (name, held)
                break
            if name not in values:  # the first value of a name counts
                values[name] = _typed(_trim(text[name_end + 1:value.end]), kinds)
            pos = value.next
        if end is not None or final:
            return dumps_json(values), end
        if open_text is not None:
            values[open_text[0]] = open_text[1]
            return stable_dumps(values, '"}'), None
        return stable_dumps(values, "}"), None


class _Value:
    """Where a parameter's value ends: ``end`` (its last index + 1) and ``next`` (the tag
    after it), or ``end`` None while that is not decided (or the value runs to the end of a
    partial text), with ``text_so_far()`` the value that is certain.

    A value may hold text that looks like the markup (a coding agent writing a parser's
    fixture), so a tag ends it only where the markup goes on around it: ``</parameter>``
    followed by ``<parameter=NAME>`` of a parameter not given yet (and declared, when the
    request's tool declares its parameters), or by the function's end; a
    ``<parameter=NAME>`` of such a parameter (the end tag left out); and the function's
    end: ``</function>`` after which, up to the next ``<tool_call>`` or ``<function=``, no
    stray ``</parameter>`` or ``</function>`` follows. Any other tag is text of the value.
    """

    def __init__(self, text: str, start: int, name: str, given, types: dict,
                 final: bool) -> None:
        self.text, self.start = text, start
        self.end: int | None = None
        self.next: int | None = None
        self.undecided_at: int | None = None
        taken = set(given) | {name}
        for tag in _BODY_TAG.finditer(text, start):
            at = tag.start()
            if tag.group() == PARAMETER_END:
                after = skip_space(text, tag.end())
                if after == len(text) and final:
                    decision = True
                else:
                    decision = _markup_goes_on(text, after, taken, types, final)
            elif tag.group() == PARAMETER:
                after = at
                decision = _markup_goes_on(text, at, taken, types, final)
            else:  # </function>
                after = at
                decision = _function_ends(text, tag.end(), final)
            if decision is None:
                self.undecided_at = at
                return
            if decision:
                self.end, self.next = at, after
                return
        if final:
            self.end = self.next = len(text)

    def text_so_far(self) -> str:
        """The value's text that is certain (one leading newline less; the end that may still
        turn out to be a tag, or the newline before one, held back)."""
        stop = len(self.text) if self.undecided_at is None else self.undecided_at
        raw = self.text[self.start:stop]
        raw = raw[1:] if raw.startswith("\n") else raw
        if self.undecided_at is not None:
            return raw[:-1] if raw.endswith("\n") else raw
        return raw[:len(raw) - held_suffix_len(raw, _VALUE_END_MARKERS)]


def _markup_goes_on(text: str, at: int, taken: set[str], types: dict,
                    final: bool) -> bool | None:
    """Whether the markup goes on at ``text[at]`` after a value: a parameter not ``taken``
    (and declared, where ``types`` declares any) or the function's end. None while the text
    ends before that is decided."""
    if text.startswith(PARAMETER, at):
        name_end = text.find(">", at + len(PARAMETER))
        if name_end < 0:
            return None if not final else False
        name = text[at + len(PARAMETER):name_end].strip()
        return name not in taken and (not types or name in types)
    if text.startswith(FUNCTION_END, at):
        return _function_ends(text, at + len(FUNCTION_END), final)
    rest = text[at:]
    if not final and any(tag.startswith(rest) for tag in (PARAMETER, FUNCTION_END)):
        return None
    return False


def _function_ends(text: str, after: int, final: bool) -> bool | None:
    """Whether the ``</function>`` ending at ``after`` ends the function: no stray
    ``</parameter>`` or ``</function>`` follows before the next block. None while a partial
    text could still show one."""
    opening = _next_opening(text, after)
    stop = len(text) if opening is None else opening[0]
    if _STRAY_END.search(text, after, stop):
        return False
    if opening is None and not final:
        return None
    return True


def _next_opening(text: str, pos: int) -> tuple[int, bool] | None:
    """The next block from ``pos``: (its index, whether it is a ``<tool_call>``), or None."""
    wrapped, bare = text.find(START, pos), text.find(FUNCTION, pos)
    if wrapped >= 0 and (bare < 0 or wrapped < bare):
        return wrapped, True
    return (bare, False) if bare >= 0 else None


def _parameter_types(tools: list[dict]) -> dict[str, dict[str, frozenset[str] | None]]:
    """Each function's parameters by name, with the JSON types their schemas allow (None when
    a schema names none)."""
    types: dict[str, dict[str, frozenset[str] | None]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if not isinstance(properties, dict):
            properties = {}
        types[function["name"]] = {name: _schema_types(schema, parameters)
                                   for name, schema in properties.items()}
    return types


def _schema_types(schema: Any, root: dict, depth: int = 0) -> frozenset[str] | None:
    """The JSON types ``schema`` allows: its ``type`` (a name or a list of names), the
    union over its ``anyOf`` / ``oneOf`` branches (Pydantic's ``Optional[int]`` is
    ``anyOf: [{type: integer}, {type: null}]``), the schema a local ``$ref`` names, or
    ``object`` for a schema of ``properties``; None when it names none."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return frozenset({kind.strip().lower()})
    if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):
        return frozenset(k.strip().lower() for k in kind)
    branches = [b for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list)
                for b in schema[key]]
    if branches:
        kinds = [_schema_types(branch, root, depth + 1) for branch in branches]
        return None if None in kinds else frozenset().union(*kinds)
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        return _schema_types(resolve_pointer(root, ref[1:]), root, depth + 1)
    if isinstance(schema.get("properties"), dict):
        return frozenset({"object"})
    return None


def _is_text(kinds: frozenset[str] | None) -> bool:
    """Whether a value of these types is kept as its text (no type, or a text type)."""
    return kinds is None or not kinds - {"null"} or bool(kinds & _TEXT_TYPES)


def _trim(raw: str) -> str:
    """A value less one newline on each side."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


_UNREAD = object()


def _typed(value: str, kinds: frozenset[str] | None) -> Any:
    """``value`` read as one of its declared JSON types; the text itself when it reads as
    none of them. With several types (a union), each non-text type is tried in turn and
    must match exactly (``true``/``false`` for a boolean, an object for an object)."""
    if _null_text(value, kinds):
        return None
    if _is_text(kinds):
        return value
    exact = len(kinds - {"null"}) > 1
    for kind in sorted(kinds - {"null"}, key=_read_order):
        result = _read_as(value, kind, exact)
        if result is not _UNREAD:
            return result
    return value


def _null_text(value: str, kinds: frozenset[str] | None) -> bool:
    """Whether ``value`` stands for null: ``null`` (any case), unless the schema allows a
    string and no null, and Python's ``None`` where the schema allows null."""
    if value.lower() == "null":
        return kinds is None or "null" in kinds or not kinds & _TEXT_TYPES
    return value == "None" and kinds is not None and "null" in kinds


def _may_become_null(held: str, kinds: frozenset[str] | None) -> bool:
    """Whether a value generated so far could still turn out to stand for null."""
    return any(word.lower().startswith(held.lower()) if word == "null" else word.startswith(held)
               for word in ("null", "None") if _null_text(word, kinds))


def _read_order(kind: str) -> tuple[int, str]:
    return (0 if _is_int(kind) else 1 if _is_number(kind) else 2 if kind in _BOOLEAN else 3, kind)


def _is_int(kind: str) -> bool:
    return kind.startswith(("int", "uint", "long", "short", "unsigned"))


def _is_number(kind: str) -> bool:
    return kind.startswith(("num", "float", "double"))


_BOOLEAN = ("boolean", "bool", "binary")


def _read_as(value: str, kind: str, exact: bool) -> Any:
    """``value`` as a ``kind`` (a JSON type name, or a common alias), else ``_UNREAD``."""
    text = value.strip()
    if _is_int(kind):
        try:
            return int(text)
        except ValueError:
            return _UNREAD
    if _is_number(kind):
        try:
            number = float(text)
        except ValueError:
            return _UNREAD
        if not math.isfinite(number):
            return _UNREAD
        return int(number) if number.is_integer() and abs(number) < 2**53 else number
    if kind in _BOOLEAN:
        if exact and text.lower() not in ("true", "false"):
            return _UNREAD
        return text.lower() == "true"
    result = _literal(value)
    if isinstance(result, str) and kind in ("object", "array"):
        result = _literal(result)  # a JSON string of the value's text: read once more
    wanted = {"object": dict, "array": list}.get(kind)
    if result is _UNREAD or (wanted is not None and (exact or isinstance(result, str))
                             and not isinstance(result, wanted)):
        return _UNREAD
    return result


def _literal(text: str) -> Any:
    """``text`` read as JSON, else as a Python literal; ``_UNREAD`` when it is neither (or
    holds what JSON cannot)."""
    for read in (json.loads, ast.literal_eval):
        try:
            result = read(text)
            dumps_json(result)
            return result
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            continue
    return _UNREAD
