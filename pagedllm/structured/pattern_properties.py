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
  property's; the old ``additionalProperties`` held for no name, so it goes. So it does
  where it is the only pattern beside listed properties: each listed property's ``allOf``
  with it is then one that ``intersection.py`` can merge where they reference themselves
  (Washington Post's ANS: ``redirect`` beside ``.*`` in related content).
"""

from __future__ import annotations

import functools

from pagedllm.structured.intersection import both
from pagedllm.structured.negation import pattern_literals

# Patterns every name matches (a search that matches the empty string at the start).
EVERY_NAME = ("", ".*", "^.*")


def overlapping_patterns_apart(node: dict, pinned: set[tuple[int, str]]) -> None:
    """Rewrite ``node``'s ``patternProperties`` of two or more patterns, or a lone pattern
    every name matches beside listed properties, as the module docstring says; a node that
    a reference's pointer passes through (``pinned``) is left as it is."""
    patterns, listed = node.get("patternProperties"), node.get("properties", {})
    if not isinstance(patterns, dict) or not isinstance(listed, dict) \
            or len(patterns) < 2 and not (listed and patterns.keys() & set(EVERY_NAME)):
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
                listed[name] = both(listed[name], schema) if name in listed else schema
    every = [patterns.pop(pattern) for pattern in list(patterns) if pattern in EVERY_NAME]
    if every:
        schema = functools.reduce(both, every)
        for key in patterns:
            patterns[key] = both(patterns[key], schema)
        for name in listed:
            listed[name] = both(listed[name], schema)
        node["additionalProperties"] = schema
    if listed:
        node["properties"] = listed
    if not patterns:
        del node["patternProperties"]
        node.setdefault("additionalProperties", True)
