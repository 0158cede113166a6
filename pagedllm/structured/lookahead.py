"""Lookaheads in a JSON schema's ``pattern`` as patterns llguidance reads.

ECMA-262 patterns may assert what follows without consuming it; llguidance's regexes
cannot. Two places of a lookahead say the same in patterns without one, since
``pattern`` is a search (it may match anywhere unless anchored):

- right after the leading ``^`` of a pattern of one alternative: ``^(?=A)R`` holds where
  ``^R`` and ``^(?:A)`` both do, and ``^(?!B)R`` where ``^R`` does and ``^(?:B)`` does
  not. The asserted patterns join the node's ``allOf`` (llguidance intersects them); a
  refused one takes the complement of ``^(?:B)`` (``negation.pattern_complement``), so
  this serves only a ``B`` whose complement is known;
- at the very end of the pattern: ``R(?=A)`` holds where ``R(?:A)`` does (the search may
  end anywhere).

A pattern with a lookahead anywhere else, or a lookbehind, is left as it is, for the
backend to refuse.
"""

from __future__ import annotations

from pagedllm.structured.negation import TYPES, pattern_complement

_LOOKAROUNDS = ("(?=", "(?!", "(?<=", "(?<!")


def lookaheads_as_patterns(node: dict) -> None:
    """Rewrite ``node["pattern"]``'s leading and trailing lookaheads (see the module
    docstring); the node is left alone unless every lookaround goes."""
    pattern = node.get("pattern")
    if not isinstance(pattern, str) or not any(a in pattern for a in _LOOKAROUNDS):
        return
    rest, holds, fails = _leading_lookaheads(pattern)
    rest = _trailing_lookahead_consumed(rest)
    parts: list[dict] = [{"pattern": _anchored(body)} for body in holds]
    for body in fails:
        complement = pattern_complement(_anchored(body))
        if complement is None:
            return
        parts.append({"pattern": complement} if complement is not False
                     else {"type": [t for t in TYPES if t != "string"]})
    patterns = [rest, *(part["pattern"] for part in parts if "pattern" in part)]
    if any(a in p for p in patterns for a in _LOOKAROUNDS):
        return
    if rest in ("", "^"):
        del node["pattern"]
    else:
        node["pattern"] = rest
    node.setdefault("allOf", []).extend(parts)


def _leading_lookaheads(pattern: str) -> tuple[str, list[str], list[str]]:
    """``(pattern without them, bodies asserted, bodies refused)`` of the lookaheads right
    after a leading ``^`` of a pattern of one alternative."""
    holds: list[str] = []
    fails: list[str] = []
    items = _top_level(pattern)
    if not pattern.startswith("^") or items is None \
            or any(pattern[a:b] == "|" for a, b in items):
        return pattern, holds, fails  # under "^x|y", a lookahead after ^ binds x alone
    at = 1
    while pattern.startswith(("(?=", "(?!"), at):
        end = _group_end(pattern, at)
        if end is None:
            break
        (holds if pattern[at + 2] == "=" else fails).append(pattern[at + 3:end - 1])
        at = end
    return "^" + pattern[at:], holds, fails


def _trailing_lookahead_consumed(pattern: str) -> str:
    """``R(?:A)`` for a pattern ``R(?=A)`` whose positive lookahead closes it, else the
    pattern as it is."""
    items = _top_level(pattern)
    if not items or not pattern.startswith("(?=", items[-1][0]):
        return pattern
    start = items[-1][0]
    return f"{pattern[:start]}(?:{pattern[start + 3:]}"


def _anchored(body: str) -> str:
    """A pattern that holds where ``body`` matches at the start of a string: ``^(?:body)``,
    with a final ``$`` of a body of one alternative taken out of the group (the form
    ``pattern_complement`` reads)."""
    items = _top_level(body) or []
    ends = bool(items) and items[-1] == (len(body) - 1, len(body)) and body.endswith("$")
    if ends and not any(body[a:b] == "|" for a, b in items):
        return f"^(?:{body[:-1]})$"
    return f"^(?:{body})"


def _top_level(pattern: str) -> list[tuple[int, int]] | None:
    """The spans ``(start, end)`` of ``pattern``'s items at its top level, in order: an
    escape, a bracket expression, a group or one character; None where a group does not
    close."""
    items = []
    at = 0
    while at < len(pattern):
        end = _group_end(pattern, at) if pattern[at] == "(" else _item_end(pattern, at)
        if end is None:
            return None
        items.append((at, end))
        at = end
    return items


def _item_end(pattern: str, start: int) -> int:
    """The index after the escape, bracket expression or character at ``pattern[start]``
    (a ``]`` right after ``[`` or ``[^`` is ECMA-262's empty or full class, so it closes)."""
    if pattern[start] == "\\":
        return start + 2
    if pattern[start] != "[":
        return start + 1
    at = start + 1
    while at < len(pattern):
        if pattern[at] == "\\":
            at += 2
            continue
        if pattern[at] == "]":
            return at + 1
        at += 1
    return len(pattern)


def _group_end(pattern: str, start: int) -> int | None:
    """The index after the ``)`` that closes the group opened at ``pattern[start]``, or
    None where none does."""
    depth = 0
    at = start
    while at < len(pattern):
        if pattern[at] == "(":
            depth += 1
        elif pattern[at] == ")":
            depth -= 1
            if depth == 0:
                return at + 1
        at = _item_end(pattern, at)
    return None
