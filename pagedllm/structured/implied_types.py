"""A ``type`` beside ``anyOf`` / ``oneOf`` / ``allOf`` / ``$ref`` that they already imply is
left out.

llguidance intersects a schema's own keywords with each branch of its composition, and
refuses that where a branch names a definition that references itself: Washington Post's
ANS schemas say ``{"type": "object", "anyOf": [{"$ref": "#/definitions/content_json"},
...]}``, and ``content_json`` is an object that holds content again. Where every value the
composition accepts already has one of the ``type``'s types, the keyword says nothing more:
without it the schema accepts exactly the same values.
"""

from __future__ import annotations

from typing import Any, Callable

from pagedllm.structured.negation import json_type

# The schemas a ``$ref`` may name (None for a pointer that names nothing).
Follow = Callable[[Any], list]
MAX_DEPTH = 8


def drop_implied_type(node: dict, follow: Follow,
                      pinned: set[tuple[int, str]] = frozenset()) -> None:
    """Leave out ``node``'s ``type`` where its other keywords allow values of those types
    alone (``types_of``). Not a ``type`` a reference's pointer passes through."""
    if "type" not in node or not any(key in node for key in ("anyOf", "oneOf", "allOf", "$ref")):
        return
    declared = declared_types(node["type"])
    if declared is None or (id(node), "type") in pinned:
        return
    others = types_of({key: value for key, value in node.items() if key != "type"}, follow)
    if others is not None and others <= declared:
        del node["type"]


def types_of(schema: Any, follow: Follow, depth: int = 0) -> frozenset[str] | None:
    """The types every value ``schema`` accepts has one of (``integer`` counted apart, and
    within ``number``); None where the schema does not bound them. An upper bound: it reads
    ``type``, ``const`` / ``enum``, ``$ref``, ``anyOf`` / ``oneOf`` (every branch) and
    ``allOf`` (every member that bounds them), through ``MAX_DEPTH`` references."""
    if schema is False:
        return frozenset()
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return None
    bounds = [declared_types(schema.get("type"))]
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        bounds.append(_with_integers({json_type(value) for value in values}))
    if "$ref" in schema:
        bounds.append(_union([types_of(target, follow, depth + 1)
                              for target in follow(schema["$ref"])]))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            bounds.append(_union([types_of(branch, follow, depth + 1) for branch in schema[key]]))
    if isinstance(schema.get("allOf"), list):
        bounds += [types_of(member, follow, depth + 1) for member in schema["allOf"]]
    known = [bound for bound in bounds if bound is not None]
    return frozenset.intersection(*known) if known else None


def declared_types(kind: Any) -> frozenset[str] | None:
    """A ``type`` keyword's types (``integer`` within ``number``), or None where it has none
    (or a malformed one)."""
    kinds = [kind] if isinstance(kind, str) else kind
    if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds):
        return None
    return _with_integers(set(kinds))


def _with_integers(kinds: set[str]) -> frozenset[str]:
    return frozenset(kinds | {"integer"} if "number" in kinds else kinds)


def _union(bounds: list[frozenset[str] | None]) -> frozenset[str] | None:
    """The types of any of ``bounds`` (None where one is unbounded or there are none)."""
    if not bounds or any(bound is None for bound in bounds):
        return None
    return frozenset().union(*bounds)
