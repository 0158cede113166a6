"""The structure of a JSON schema (2020-12, and drafts 4-7), as the constraint code reads
it: where its subschemas are, and the URI a schema object names itself by."""

from __future__ import annotations

import re
from typing import Any, Iterator
from urllib.parse import unquote

# Where a schema holds subschemas: one schema, a list of them, or a map of names to them.
# Every other keyword's value is data (``const``, ``enum``, ``default``, ``examples``, ...)
# and is never looked into.
_SCHEMA_KEYWORDS = ("additionalProperties", "additionalItems", "items", "contains", "not",
                    "if", "then", "else", "propertyNames", "unevaluatedItems",
                    "unevaluatedProperties", "contentSchema")
_SCHEMA_LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions",
                        "dependentSchemas", "dependencies")


def subschemas(schema: Any) -> Iterator[dict]:
    """Every schema object in ``schema`` (itself included), through the subschema
    keywords only; boolean schemas are skipped."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        for key in _SCHEMA_KEYWORDS:
            if isinstance(node.get(key), dict):
                stack.append(node[key])
        for key in _SCHEMA_LIST_KEYWORDS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _SCHEMA_MAP_KEYWORDS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())  # a dependency may be a list of names


def resource_id(node: dict) -> str | None:
    """The URI ``node`` names itself by as a resource (``$id``, or draft 4's ``id``),
    without an empty fragment; None if it names none (an anchor such as ``#foo`` names
    no resource)."""
    for key in ("$id", "id"):
        value = node.get(key)
        if isinstance(value, str):
            value = value.removesuffix("#")
            return value if value and "#" not in value else None
    return None


def resolve_pointer(root: Any, pointer: str) -> Any:
    """The value a JSON pointer in a URI fragment (RFC 6901: ``""`` the whole,
    ``/$defs/Point``, ``~1`` for ``/`` and ``~0`` for ``~`` in a key, percent-escapes as
    in any fragment: ``%5B`` for ``[``) names in ``root``; None when it names none."""
    walk = pointer_walk(root, pointer)
    return None if walk is None else walk[1]


def pointer_walk(root: Any, pointer: str) -> tuple[list[tuple[Any, str]], Any] | None:
    """The steps a URI fragment's JSON pointer (``resolve_pointer``) takes through ``root``
    (each container and the key it takes there) and the value it names; None when it names
    none."""
    if pointer and not pointer.startswith("/"):
        return None
    steps = []
    target = root
    for key in unquote(pointer).split("/")[1:]:
        key = key.replace("~1", "/").replace("~0", "~")
        steps.append((target, key))
        if isinstance(target, dict) and key in target:
            target = target[key]
        elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
            target = target[int(key)]
        else:
            return None
    return steps, target


# Drafts 3-7 read a schema object with ``$ref`` as the reference alone: every keyword beside
# it is ignored (2019-09 and later apply them too).
_REF_ALONE_DRAFTS = re.compile(r"json-schema\.org/draft-0[3-7]/schema")


def ref_siblings_ignored(root: Any) -> bool:
    """Whether ``root`` names (``$schema``) a draft that ignores the keywords beside a
    ``$ref``; a schema that names none is read as 2020-12, which applies them."""
    return isinstance(root, dict) and isinstance(root.get("$schema"), str) \
        and _REF_ALONE_DRAFTS.search(root["$schema"]) is not None
