"""Which names an object may use and how many, in the terms llguidance implements.

``propertyNames`` is said by ``properties`` and ``patternProperties`` that close the
object; ``minProperties`` / ``maxProperties`` of a closed object by which of its names
are present (``property_counts_as_presence``).

A map schema (``{"type": "object", "propertyNames": P, "additionalProperties": V}``, the
way configuration schemas key a map by a name format) becomes, exactly:

- ``P`` a string schema with nothing to check (``{}``, ``{"type": "string"}``): ``V`` as is;
- ``P`` a ``pattern``, or a length (``minLength`` / ``maxLength``): ``patternProperties
  {regex: V}`` and no other name;
- ``P`` names (``enum`` / ``const``, or an ``anyOf`` / ``oneOf`` of disjoint such):
  ``properties {name: V}`` and no other name;
- ``P`` the names to avoid (``{"not": {"enum": ...}}``): those names absent, ``V`` for
  the rest.

Names the schema lists itself in ``properties`` keep their schemas, and must be names
``P`` allows (otherwise they must be absent). A map whose one ``patternProperties``
pattern takes every name (``.*``, ``""``) and that lists no names reads it as ``V``. Any
other ``P``, or a schema with other ``patternProperties``, is left for the backend to
refuse, naming ``propertyNames``.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any, Callable

from pagedllm.structured.negation import ANNOTATIONS, names

# The most choices of names one bound of a property count becomes.
MAX_COUNT_CHOICES = 64
# Patterns every name matches (a search that matches the empty string at the start).
_EVERY_NAME = ("", ".*", "^.*")


def property_names_as_properties(node: dict, follow: Callable[[Any], Any]) -> None:
    """Rewrite ``node``'s ``propertyNames`` where one of the forms above says it;
    ``follow`` resolves a lone ``$ref`` to its schema (None where it cannot)."""
    test = follow(node.get("propertyNames"))
    patterns = node.get("patternProperties")
    if isinstance(test, dict) and isinstance(patterns, dict) and len(patterns) == 1 \
            and next(iter(patterns)) in _EVERY_NAME and "properties" not in node:
        # A map whose one pattern takes every name: its schema is every value's.
        node["additionalProperties"] = patterns.popitem()[1]
        del node["patternProperties"]
    if not isinstance(test, dict) or "patternProperties" in node:
        return
    if test.get("type", "string") != "string":
        return
    keys = set(test) - ANNOTATIONS - {"type"}
    listed = node.get("properties", {})
    if not isinstance(listed, dict):
        return
    rest = node.get("additionalProperties", True)
    if not keys:
        del node["propertyNames"]
        return
    allowed_names = _names_of(test, keys, follow)
    if allowed_names is not None:
        _replace(node, {n: listed.get(n, rest) for n in allowed_names}, {}, False)
        return
    if keys == {"not"}:
        avoided = _names_of(follow(test["not"]), None, follow)
        if avoided is None:
            return
        properties = {**listed, **{n: False for n in avoided}}
        _replace(node, properties, {}, rest)
        return
    regex = _regex_of(test, keys)
    if regex is None or (listed and rest not in (True, {}, False)):
        return  # a listed name the pattern takes would have to hold ``rest`` too
    try:
        allowed = re.compile(regex)
    except re.error:
        return
    properties = {n: (s if allowed.search(n) else False) for n, s in listed.items()}
    _replace(node, properties, {} if rest is False else {regex: rest}, False)


def _names_of(test: Any, keys: set[str] | None, follow: Callable[[Any], Any]
              ) -> list[str] | None:
    """The names a string schema of constants allows (``keys``: its keywords but
    ``type`` and annotations, when known), or None for any other schema."""
    if not isinstance(test, dict) or test.get("type", "string") != "string":
        return None
    keys = set(test) - ANNOTATIONS - {"type"} if keys is None else keys
    if keys == {"const"}:
        values = [test["const"]]
    elif keys == {"enum"} and isinstance(test["enum"], list):
        values = test["enum"]
    elif keys in ({"anyOf"}, {"oneOf"}):
        key = "anyOf" if "anyOf" in keys else "oneOf"
        branches = test[key]
        parts = [_names_of(follow(b), None, follow) for b in branches] \
            if isinstance(branches, list) else [None]
        if any(p is None for p in parts):
            return None
        values = [v for p in parts for v in p]
        if key == "oneOf" and len(set(values)) != len(values):
            return None  # a name in two branches fails "exactly one"
    else:
        return None
    return list(dict.fromkeys(v for v in values if isinstance(v, str)))


def _regex_of(test: dict, keys: set[str]) -> str | None:
    """The regex of a ``pattern`` or a length, or None for any other schema."""
    if keys == {"pattern"} and isinstance(test["pattern"], str):
        return test["pattern"]
    if keys and keys <= {"minLength", "maxLength"}:
        low, high = test.get("minLength", 0), test.get("maxLength", "")
        if isinstance(low, int) and (high == "" or isinstance(high, int)):
            return f"^[\\s\\S]{{{low},{high}}}$"
    return None


def _replace(node: dict, properties: dict, patterns: dict, rest: Any) -> None:
    del node["propertyNames"]
    node["properties"] = properties
    if patterns:
        node["patternProperties"] = patterns
    node["additionalProperties"] = rest


def property_counts_as_presence(node: dict) -> None:
    """``minProperties`` / ``maxProperties`` of a closed object (``additionalProperties:
    false``, no ``patternProperties``), which llguidance takes only where every listed
    name is required: the object holds only its listed names, so "at least ``k``" is "at
    least ``k`` minus the required of the optional names present", an ``anyOf`` of their
    ``required`` choices, and "at most ``m``" is "at least as many of them absent as the
    optional names exceed ``m`` minus the required", an ``anyOf`` of ``properties: {name:
    false}`` choices; a bound every object holds is dropped. Left as is past
    ``MAX_COUNT_CHOICES`` choices, or where a bound cannot hold."""
    listed = node.get("properties")
    required = names(node.get("required", []))
    if not isinstance(listed, dict) or required is None or not required <= set(listed) \
            or node.get("additionalProperties") is not False or "patternProperties" in node \
            or set(listed) <= required:
        return
    optional = sorted(set(listed) - required)
    low, high = node.get("minProperties", 0), node.get("maxProperties", len(listed))
    if not isinstance(low, int) or not isinstance(high, int) or high < len(required):
        return
    present = max(0, low - len(required))  # optional names that must be present
    absent = max(0, len(optional) - (high - len(required)))  # and that must be absent
    if present > len(optional) or present + absent > len(optional) \
            or math.comb(len(optional), present) > MAX_COUNT_CHOICES \
            or math.comb(len(optional), absent) > MAX_COUNT_CHOICES:
        return
    node.pop("minProperties", None)
    node.pop("maxProperties", None)
    if present:
        node.setdefault("allOf", []).append({"anyOf": [
            {"required": list(c)} for c in itertools.combinations(optional, present)]})
    if absent:
        node.setdefault("allOf", []).append({"anyOf": [
            {"properties": {n: False for n in c}}
            for c in itertools.combinations(optional, absent)]})
