"""Keywords beside ``allOf`` / ``anyOf`` / ``oneOf`` / ``$ref`` merged into the schemas they
combine with, where those reference themselves.

llguidance intersects a schema's own keywords with each schema it combines them with, and
refuses that where one of those references itself ("circular references with sibling
keys"): a base object extended with properties of its own (``{"properties": ...,
"allOf": [{"$ref": "#/definitions/base"}]}``), shared properties beside a choice of
variants (``{"properties": ..., "oneOf": [{"$ref": A}, {"$ref": B}]}``), where a variant or
the base holds the schema again (trees, expressions, GeoJSON's geometry collections).

Here the intersection is said as one schema, with copies of the plain schemas the
references name: P and M1 and ... and (B1 or B2) is (P and M and B1) or (P and M and B2),
each "and" of plain schemas (``intersect``) written keyword by keyword. Only where it is
exact: plain schemas (no composition of their own, no pattern or tuple keywords), and
keywords that two schemas both say only where one value holds both (bounds take the
tighter, ``required`` the union, a property both schemas name holds both). Property
schemas both sides give are left for llguidance as an ``allOf`` of the two.
"""

from __future__ import annotations

from typing import Any, Callable

from pagedllm.structured.implied_types import Follow, declared_types
from pagedllm.structured.json_schema import subschemas
from pagedllm.structured.negation import ANNOTATIONS

# What stays at a node whose keywords are merged into what it combines them with.
_KEPT = {"$schema", "$id", "id", "definitions", "$defs", "x-guidance"} | ANNOTATIONS
_COMPOSITIONS = ("allOf", "anyOf", "oneOf", "$ref")
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_EXCLUSIVE_BOUNDS = ("exclusiveMinimum", "exclusiveMaximum")
# Keywords each said by one schema alone, or by both alike.
_SAID_ALIKE = ("enum", "const", "pattern", "format", "multipleOf", "uniqueItems",
               "propertyNames")
PLAIN = {"type", "required", "properties", "additionalProperties", "items"} \
    | set(_LOWER_BOUNDS) | set(_UPPER_BOUNDS) | set(_SAID_ALIKE)
# The keywords that constrain values; any other key (``javaAbstract``, ``x-order``, ...) is
# an annotation, as JSON Schema reads a keyword it does not know.
CONSTRAINING = PLAIN | {"patternProperties", "prefixItems", "additionalItems", "contains",
                        "minContains", "maxContains", "dependencies", "dependentRequired",
                        "dependentSchemas", "allOf", "anyOf", "oneOf", "not", "if", "then",
                        "else", "$ref", "$dynamicRef", "$recursiveRef", "unevaluatedItems",
                        "unevaluatedProperties", "contentSchema"}
MAX_BRANCHES = 64
# References a lone ``$ref`` is followed through to the schema it ends at.
MAX_REFERENCE_HOPS = 8
# Levels of property and item schemas whose intersections a merge goes on merging.
MAX_DEPTH = 3


def compositions_merged(node: dict, follow: Follow, recursive: Callable[[Any], bool],
                        pinned: set[tuple[int, str]] = frozenset(),
                        define: Callable[[dict], str] | None = None, depth: int = 0) -> None:
    """Merge ``node``'s own keywords into what its ``allOf`` members and ``$ref`` name, and
    those into each ``anyOf`` / ``oneOf`` branch (its own, or a member that is a choice
    alone), where one of them is ``recursive`` (a schema its references lead back to); then
    the same in the ``allOf`` s the merge wrote for what two schemas both say, to ``depth``
    ``MAX_DEPTH``. Left as is where a merge would not be exact, a reference names none or
    several schemas, or a key that would move is one a reference's pointer passes through.
    References are followed within one resource: the caller's (``follow``). Where what is
    merged holds ``node`` itself (a definition whose property is ``node``), the merge
    becomes a new definition (``define`` adds it and returns its reference) that ``node``
    references: a recursion through a reference, where the copy would have held itself."""
    if not any(key in node for key in _COMPOSITIONS):
        return
    own = {k: v for k, v in node.items() if k in CONSTRAINING and k not in _COMPOSITIONS}
    members = list(node["allOf"]) if isinstance(node.get("allOf"), list) else []
    if "$ref" in node:
        members.append({"$ref": node["$ref"]})
    choices = [(key, node[key]) for key in ("anyOf", "oneOf") if isinstance(node.get(key), list)]
    choices += [(key, m[key]) for m in members for key in ("anyOf", "oneOf")
                if _choice_alone(m, key)]
    members = [m for m in members if not any(_choice_alone(m, key) for key in ("anyOf", "oneOf"))]
    parts = len(members) + len(choices) + bool(own)
    if len(choices) > 1 or parts < 2 or depth > MAX_DEPTH \
            or any((id(node), k) in pinned for k in node if k not in _KEPT):
        return  # nothing to intersect, or more than one choice
    if _plain(own, follow) is None:
        return  # its own keywords say more than a merge reads
    plain_members = [_plain(member, follow) for member in members]
    kind, choice = choices[0] if choices else ("anyOf", [])
    branches = [_plain(branch, follow) for branch in choice]
    combined = members + choice
    holds_node = any(_holds(part, node) for part in plain_members + branches)
    if any(part is None for part in plain_members + branches) \
            or not any(map(recursive, combined + [own])) or len(branches) > MAX_BRANCHES \
            or holds_node and define is None:
        return
    merged: Any = dict(own)
    for member in plain_members:
        merged = intersect(merged, member)
        if merged is None:
            return
    if choices:
        merged_branches = [intersect(merged, branch) for branch in branches]
        if any(branch is None for branch in merged_branches):
            return
        result = {kind: merged_branches}
    elif merged is False:
        return  # no value holds it: left for llguidance to say so
    else:
        result = {} if merged is True else merged
    for key in [k for k in node if k not in _KEPT]:
        del node[key]
    node.update({"$ref": define(result)} if holds_node else result)
    for written in _written_intersections(result):
        compositions_merged(written, follow, recursive, pinned, define, depth + 1)


def _choice_alone(schema: Any, key: str) -> bool:
    """Whether ``schema`` is a ``key`` choice and nothing else (but annotations)."""
    return isinstance(schema, dict) and isinstance(schema.get(key), list) \
        and not set(schema) & CONSTRAINING - {key}


def _written_intersections(node: dict) -> list[dict]:
    """The ``allOf`` s of two that ``both`` wrote in a merged ``node``: its (or its
    branches') properties, ``additionalProperties`` and ``items``."""
    schemas = [node] + [b for key in ("anyOf", "oneOf") for b in node.get(key, [])]
    children = [child for schema in schemas if isinstance(schema, dict)
                for child in [*schema.get("properties", {}).values(),
                              schema.get("additionalProperties"), schema.get("items")]]
    return [child for child in children if isinstance(child, dict)
            and set(child) == {"allOf"} and len(child["allOf"]) == 2]


def reaches_a_cycle(follow: Follow) -> Callable[[Any], bool]:
    """A test of whether a schema's references lead (through the schemas they name, and
    theirs) to a schema whose references lead back to it: what llguidance will not
    intersect. Each named schema's references are read once."""
    successors: dict[int, list[dict]] = {}  # of the named schemas, which outlive the test

    def referenced(schema: Any) -> list[dict]:
        return [target for inner in subschemas(schema) for target in follow(inner.get("$ref"))
                if isinstance(target, dict)]

    def named(target: dict) -> list[dict]:
        if id(target) not in successors:
            successors[id(target)] = referenced(target)
        return successors[id(target)]

    on_cycle: dict[int, bool] = {}

    def cyclic(target: dict) -> bool:
        if id(target) not in on_cycle:
            seen, pending = set(), list(named(target))
            while pending and id(target) not in seen:
                schema = pending.pop()
                if id(schema) not in seen:
                    seen.add(id(schema))
                    pending += named(schema)
            on_cycle[id(target)] = id(target) in seen
        return on_cycle[id(target)]

    acyclic: set[int] = set()  # named schemas whose references reach no cycle

    def reaches(schema: Any) -> bool:
        seen, pending = set(), referenced(schema)
        while pending:
            target = pending.pop()
            if id(target) in seen or id(target) in acyclic:
                continue
            if cyclic(target):
                return True
            seen.add(id(target))
            pending += named(target)
        acyclic.update(seen)  # every schema they reach was walked, and none is on a cycle
        return False

    return reaches


def _holds(schema: Any, node: dict) -> bool:
    """Whether ``node`` is ``schema`` or inside it: merged into itself, it would hold itself."""
    return any(inner is node for inner in subschemas(schema))


def _plain(schema: Any, follow: Follow, depth: int = 0) -> Any:
    """``schema``, or the one schema its lone ``$ref`` names (followed to the end), where
    it is plain (of the ``CONSTRAINING`` keywords, ``PLAIN`` ones alone; or a boolean);
    None elsewhere."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict) or depth > MAX_REFERENCE_HOPS:
        return None
    kinds = schema.get("type", [])
    if isinstance(schema.get("items"), list) or not isinstance(schema.get("required", []), list) \
            or any(isinstance(schema.get(k), bool) for k in _EXCLUSIVE_BOUNDS) \
            or not all(isinstance(k, str) for k in ([kinds] if isinstance(kinds, str) else kinds)):
        return None  # tuples, draft 4's exclusive flags, malformed lists
    if "$ref" in schema:
        if set(schema) & CONSTRAINING != {"$ref"}:
            return None
        targets = follow(schema["$ref"])
        return _plain(targets[0], follow, depth + 1) if len(targets) == 1 else None
    return schema if set(schema) & CONSTRAINING <= PLAIN else None


def intersect(a: Any, b: Any) -> Any:
    """One schema for "``a`` and ``b``", two plain schemas (``False`` where none holds
    both); None where it cannot be said exactly here."""
    if a is False or b is False:
        return False
    if a is True:
        return b
    if b is True:
        return a
    a = {k: v for k, v in a.items() if k in PLAIN}
    b = {k: v for k, v in b.items() if k in PLAIN}
    merged = {k: v for k, v in (a | b).items()
              if k not in ("properties", "additionalProperties")}
    for key in set(a) & set(b) - {"properties", "additionalProperties"}:
        if key == "type":
            kinds_a, kinds_b = declared_types(a["type"]), declared_types(b["type"])
            if kinds_a is None or kinds_b is None:
                return None
            kinds = kinds_a & kinds_b
            if not kinds:
                return False
            merged["type"] = sorted(kinds - {"integer"} if "number" in kinds else kinds)
        elif key == "required":
            merged["required"] = list(dict.fromkeys(a["required"] + b["required"]))
        elif key == "items":
            merged["items"] = both(a["items"], b["items"])
        elif key in _LOWER_BOUNDS or key in _UPPER_BOUNDS:
            pick = max if key in _LOWER_BOUNDS else min
            if not all(isinstance(s[key], (int, float)) and not isinstance(s[key], bool)
                       for s in (a, b)):
                return None
            merged[key] = pick(a[key], b[key])
        elif a[key] != b[key]:
            return None
    if "type" in merged and isinstance(merged["type"], list) and len(merged["type"]) == 1:
        merged["type"] = merged["type"][0]
    if any(k in a or k in b for k in ("properties", "additionalProperties")):
        properties = _merged_properties(a, b)
        if properties is None:
            return None
        merged.update(properties)
    return merged


def _merged_properties(a: dict, b: dict) -> dict | None:
    """``properties`` and ``additionalProperties`` of "``a`` and ``b``": a name either lists
    holds what each side says of it (its property schema, else its
    ``additionalProperties``), another name both sides' ``additionalProperties``."""
    listed_a, listed_b = a.get("properties", {}), b.get("properties", {})
    if not isinstance(listed_a, dict) or not isinstance(listed_b, dict):
        return None
    rest_a, rest_b = a.get("additionalProperties", True), b.get("additionalProperties", True)
    properties = {name: both(listed_a.get(name, rest_a), listed_b.get(name, rest_b))
                  for name in list(dict.fromkeys([*listed_a, *listed_b]))}
    merged: dict = {"properties": properties} if properties else {}
    rest = both(rest_a, rest_b)
    if rest is not True:
        merged["additionalProperties"] = rest
    return merged


def both(a: Any, b: Any) -> Any:
    """A schema for "``a`` and ``b``", any two schemas: one of them where the other says
    nothing (or they are equal), else an ``allOf`` of the two for llguidance."""
    if a is False or b is False:
        return False
    if _says_nothing(a) or a == b:
        return b
    if _says_nothing(b):
        return a
    return {"allOf": [a, b]}


def _says_nothing(schema: Any) -> bool:
    return schema is True or isinstance(schema, dict) and not set(schema) & CONSTRAINING
