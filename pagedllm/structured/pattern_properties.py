"""``patternProperties`` whose patterns may match one name together, in the terms
llguidance implements.

A name must hold the schema of every pattern it matches, and a listed property those of
the patterns that match it too. llguidance intersects a listed property with its patterns,
but refuses two patterns that are not disjoint. Two common overlaps are said without one,
exactly:

- a pattern of literal names (``^MD5$``, ``^(links|relationships)$``) becomes those
  names' ``properties`` (their own schema, if listed, and the pattern's, together);
- a pattern that every name matches (``.*``, ``""``, ``^.*``) becomes
  ``additionalProperties`` and joins every other pattern's schema and listed
  property's; the old ``additionalProperties`` held for no name, so it goes.
"""

from __future__ import annotations

import functools

from pagedllm.structured.negation import pattern_literals

# Patterns every name matches (a search that matches the empty string at the start).
EVERY_NAME = ("", ".*", "^.*")


def overlapping_patterns_apart(node: dict, pinned: set[tuple[int, str]]) -> None:
    """Rewrite ``node``'s ``patternProperties`` of two or more patterns as the module
    docstring says; a node that a reference's pointer passes through (``pinned``) is left
    as it is."""
    patterns, listed = node.get("patternProperties"), node.get("properties", {})
    if not isinstance(patterns, dict) or len(patterns) < 2 or not isinstance(listed, dict):
        return
    steps = [(id(node), key) for key in ("patternProperties", "properties",
                                         "additionalProperties")]
    steps += [(id(patterns), key) for key in patterns] + [(id(listed), key) for key in listed]
    if any(step in pinned for step in steps):
        return
    listed = dict(listed)
    for pattern, schema in list(patterns.items()):
        literals = pattern_literals(pattern)
        if literals is not None and literals[1]:
            del patterns[pattern]
            for name in literals[0]:
                listed[name] = _both(listed[name], schema) if name in listed else schema
    every = [patterns.pop(pattern) for pattern in list(patterns) if pattern in EVERY_NAME]
    if every:
        schema = functools.reduce(_both, every)
        for key in patterns:
            patterns[key] = _both(patterns[key], schema)
        for name in listed:
            listed[name] = _both(listed[name], schema)
        node["additionalProperties"] = schema
    if listed:
        node["properties"] = listed
    if not patterns:
        del node["patternProperties"]
        node.setdefault("additionalProperties", True)


def _both(first, second):
    """A schema that holds where both do."""
    if first is True or first == {}:
        return second
    if second is True or second == {}:
        return first
    return {"allOf": [first, second]}
