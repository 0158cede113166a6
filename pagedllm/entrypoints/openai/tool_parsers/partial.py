"""Reading text that is still being generated: marker prefixes and JSON prefixes.

Every helper here answers "what part of this prefix of the output can no longer change?",
which is what a stream may emit:

- ``held_suffix_len``: the end of the text that may be the start of a marker (``<tool_`` before
  ``<tool_call>``), to be held back until the next text decides it.
- ``parse_partial_json`` + ``stable_dumps``: for a prefix of a JSON value, the prefix of
  ``dumps_json(final value)`` it fixes. Incomplete JSON is completed by ``partial-json-parser``
  (with partial strings, objects and arrays allowed, and partial numbers, ``true``/``false``/
  ``null`` dropped, as they may still grow or change); the closers it appended are then cut off
  the dumped text, so an open string or container stays open and what remains is a prefix of
  the final text whatever comes next (a high surrogate at the very end is cut too, as its pair
  may follow).

JSON is read as RFC 8259 has it: ``NaN``, ``Infinity`` and floats too large for a double are
refused, so arguments always dump to valid JSON.

The library completes an open string character by character in Python, so a long string
argument (a file's text) would cost time quadratic in its length over a stream. The string
still open at the end of the text is therefore cut off before the library reads the rest,
decoded by the ``json`` module's C scanner, and put back in the value.
"""

from __future__ import annotations

import json
from json.decoder import scanstring
from typing import Any

import partial_json_parser
from partial_json_parser.core.options import Allow

# Partial strings and containers are safe to complete: what they hold so far stays. A partial
# number or literal is not ("1" may become "12", "tru" is not a value yet), so it is dropped.
_PARTIAL = Allow.STR | Allow.OBJ | Allow.ARR
_CLOSERS = '"]}'


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} does not fit a double")
    return value


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def dumps_json(value: Any) -> str:
    """The JSON text of a value as calls carry it: non-ASCII kept, default separators."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def decode_json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The complete JSON value starting at ``text[pos]`` and the index after it, else None."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def skip_space(text: str, pos: int) -> int:
    """The first index at or after ``pos`` that is not whitespace (``len(text)`` if none)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def held_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of one of ``markers``."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def parse_partial_json(text: str) -> tuple[Any, str] | None:
    """A prefix of one JSON value: (the value it holds so far, the closers appended to it).

    The closers are the characters ``"``, ``]`` and ``}`` that close what is still open,
    innermost first; empty when the value is complete. None when nothing can be read yet or
    the text is no prefix of a JSON value.
    """
    text = text.lstrip()
    if not text:
        return None
    open_quote = _open_string_start(text)
    if open_quote is not None:
        open_string = _decode_string_prefix(text[open_quote + 1:])
        if open_string is None:
            return None
        text = text[: open_quote + 1]
    try:
        head, closers = partial_json_parser.fix_fast(text, _PARTIAL)
        value = _DECODER.decode(head + closers)
    except (ValueError, AssertionError, IndexError):
        # The library signals text it cannot complete with assorted exceptions.
        return None
    if closers.strip(_CLOSERS):
        return None
    if open_quote is not None and closers.startswith('"'):
        value = _with_last_leaf(value, open_string)
        if value is None:
            return None
    return value, closers


def _open_string_start(text: str) -> int | None:
    """Where the string still open at the end of a JSON prefix starts (its quote), if any."""
    pos = 0
    while (quote := text.find('"', pos)) >= 0:
        try:
            pos = scanstring(text, quote + 1)[1]
        except ValueError:
            return quote
    return None


def _decode_string_prefix(chars: str) -> str | None:
    """The characters of an open JSON string, without an escape cut off at its end."""
    for cut in range(min(6, len(chars) + 1)):  # an escape cut short is at most \uXXX
        try:
            return scanstring(chars[: len(chars) - cut] + '"', 0)[0]
        except ValueError:
            continue
    return None


def _with_last_leaf(value: Any, leaf: str) -> Any | None:
    """The value with its innermost last member, the open string (read as ""), set to
    ``leaf``; None if there is no such member."""
    if value == "":
        return leaf
    parent = value
    while isinstance(parent, (dict, list)) and parent:
        key = next(reversed(parent)) if isinstance(parent, dict) else len(parent) - 1
        if parent[key] == "":
            parent[key] = leaf
            return value
        parent = parent[key]
    return None


def member_closers(container: dict | list, member: Any, closers: str) -> str:
    """The closers that belong to one member of a partial container: only its last member
    (a dict key or a list index) can still be open, and the container's own closer is last."""
    last = next(reversed(container), None) if isinstance(container, dict) else len(container) - 1
    return closers[:-1] if member == last else ""


def stable_dumps(value: Any, closers: str) -> str:
    """The prefix of ``dumps_json(final value)`` that a partial value with these closers fixes."""
    text = dumps_json(value)
    if not closers:
        return text
    if not text.endswith(closers):
        return ""
    text = text[: -len(closers)]
    if text and "\ud800" <= text[-1] <= "\udbff":
        text = text[:-1]
    return text


def extension(sent: str, now: str) -> str:
    """What ``now`` adds to ``sent`` when it extends it; empty when it does not."""
    if len(now) > len(sent) and now.startswith(sent):
        return now[len(sent):]
    return ""
