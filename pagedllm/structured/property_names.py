"""Which names an object may use and how many, in the terms llguidance implements.

``propertyNames`` is said by ``properties`` and ``patternProperties`` that close the
object; ``minProperties`` / ``maxProperties`` by which of its listed names are present
(``property_counts_as_presence``), llguidance counting the others once every listed name
is required or absent.

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
from pagedllm.structured.pattern_properties import EVERY_NAME

# The most choices of names one bound of a property count becomes.
MAX_COUNT_CHOICES = 64


def property_names_as_properties(node: dict, follow: Callable[[Any], Any]) -> None:
    """Rewrite ``node``'s ``propertyNames`` where one of the forms above says it;
    ``follow`` resolves a lone ``$ref`` to its schema (None where it cannot)."""
    test = follow(node.get("propertyNames"))
    patterns = node.get("patternProperties")
    if isinstance(test, dict) and isinstance(patterns, dict) and len(patterns) == 1 \
            and next(iter(patterns)) in EVERY_NAME and "properties" not in node:
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
    if not isinstance(listed, dict) or required is None or set(listed) <= required \
            or ("minProperties" not in node and "maxProperties" not in node):
        return
    if node.get("additionalProperties") is not False or "patternProperties" in node:
        _open_object_counts(node, listed, required)
        return
    if not required <= set(listed):
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


def _open_object_counts(node: dict, listed: dict, required: set[str]) -> None:
    """``minProperties`` / ``maxProperties`` of an object that may hold names it does not
    list, as an ``anyOf`` of which optional listed names are present: where that choice
    alone meets the bounds, the names are required and nothing more is said; elsewhere
    the choice is exact (the other optional names ``false``), so that every listed name
    is required or absent and llguidance counts the rest under the bounds. Left as is
    past ``MAX_COUNT_CHOICES`` choices, or where the bounds cannot hold."""
    optional = sorted(n for n in set(listed) - required if listed[n] is not False)
    low, high = node.get("minProperties", 0), node.get("maxProperties")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)) \
            or (high is not None and high < max(low, len(required))):
        return
    need = max(0, low - len(required))  # names present beyond the required
    if high is None and need == 0:
        del node["minProperties"]  # the required names meet it
        return
    most = len(optional) if high is None else min(len(optional), high - len(required))
    exact = range(0, most + 1) if high is not None else range(0, min(need, len(optional) + 1))
    sizes = [(size, True) for size in exact]
    if high is None and need <= len(optional):
        sizes.append((need, False))
    if sum(math.comb(len(optional), size) for size, _ in sizes) > MAX_COUNT_CHOICES:
        return
    branches = []
    for size, is_exact in sizes:
        for present in itertools.combinations(optional, size):
            branch: dict = {"required": list(present)} if present else {}
            if is_exact:
                absent = [n for n in optional if n not in present]
                if absent:
                    branch["properties"] = {n: False for n in absent}
                if len(required) + size < low:
                    branch["minProperties"] = low
                if high is not None:
                    branch["maxProperties"] = high
            branches.append(branch)
    node.pop("minProperties", None)
    node.pop("maxProperties", None)
    node.setdefault("allOf", []).append({"anyOf": branches})
