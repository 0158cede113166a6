"""``propertyNames``, and the property counts of closed objects and of objects open to
other names, said by which listed names are present, accept exactly what the original
schemas do, as ``jsonschema`` judges it over objects of many names; those left as they are
stay refused, naming the keyword; the rewritten schemas compile."""

from __future__ import annotations

import copy
import itertools
import json

import jsonschema
import pytest

from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.llguidance_backend import LLGuidanceBackend
from pagedllm.structured.property_names import (property_counts_as_presence,
                                                property_names_as_properties)

NAMES = ["a", "b", "ab", "id", "x-1", "X", "", "long_name_here", "concurrent"]
VALUES = [1, "s", None]

MAPS = [
    {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
     "additionalProperties": {"type": "integer"}},
    {"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "string"}},
    {"type": "object", "propertyNames": {"enum": ["a", "b", "id"]},
     "additionalProperties": {"type": "integer"}},
    {"propertyNames": {"anyOf": [{"const": "a"}, {"enum": ["ab", "X"]}]},
     "properties": {"a": {"type": "string"}, "zz": {"type": "integer"}}},
    {"type": "object", "propertyNames": {"not": {"enum": ["concurrent", "id"]}},
     "properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "propertyNames": {"$ref": "#/$defs/key"},
     "additionalProperties": {"type": "integer"},
     "$defs": {"key": {"type": "string", "pattern": "^x-"}}},
    {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
     "properties": {"id": {"type": "integer"}, "X": {"type": "integer"}}},
    {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": False,
     "properties": {"id": {"type": "integer"}, "X": {"type": "integer"}}},
    {"type": "object", "propertyNames": {"enum": ["a", "b", "id"]},
     "patternProperties": {".*": {"type": "integer"}}, "additionalProperties": False},
    {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
     "patternProperties": {"": {"type": "string"}}},
]


def objects() -> list[dict]:
    found = []
    for size in (0, 1, 2):
        for names in itertools.combinations(NAMES, size):
            for values in itertools.product(VALUES, repeat=size):
                found.append(dict(zip(names, values)))
    return found


def follow(schema, root):
    if isinstance(schema, dict) and set(schema) == {"$ref"}:
        return root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


@pytest.mark.parametrize("schema", MAPS, ids=lambda s: json.dumps(s["propertyNames"])[:50])
def test_property_names_as_properties_accept_what_the_schema_accepts(schema):
    rewritten = copy.deepcopy(schema)
    property_names_as_properties(rewritten, lambda s: follow(s, rewritten))
    assert "propertyNames" not in rewritten
    for value in objects():
        original = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert jsonschema.Draft202012Validator(rewritten).is_valid(value) == original, value
    LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("names", [{"format": "email"}, {"type": "integer"},
                                   {"pattern": "^a", "maxLength": 3}])
def test_other_property_names_are_refused_naming_the_keyword(names):
    with pytest.raises(ValueError, match="propertyNames"):
        LLGuidanceBackend.validate(StructuredOutputsParams(
            json={"type": "object", "propertyNames": names}))



COUNTED = [
    {"minProperties": 1},
    {"minProperties": 2, "maxProperties": 3},
    {"maxProperties": 2, "required": ["a"]},
    {"minProperties": 4, "required": ["b"]},
    {"maxProperties": 5},
]


@pytest.mark.parametrize("bounds", COUNTED, ids=lambda b: json.dumps(b))
def test_property_counts_of_a_closed_object_as_names_present(bounds):
    listed = {n: {"type": "integer"} for n in ("a", "b", "c", "d")}
    schema = {"type": "object", "properties": listed, "additionalProperties": False, **bounds}
    rewritten = copy.deepcopy(schema)
    property_counts_as_presence(rewritten)
    assert "minProperties" not in rewritten and "maxProperties" not in rewritten
    for size in range(5):
        for chosen in itertools.combinations([*listed, "e"], size):
            value = dict.fromkeys(chosen, 1)
            original = jsonschema.Draft202012Validator(schema).is_valid(value)
            assert jsonschema.Draft202012Validator(rewritten).is_valid(value) == original, value
    LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))


OPEN = [
    {"additionalProperties": {"type": "integer"}},
    {"patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
    {"patternProperties": {"^x": {"type": "integer"}}},
]


@pytest.mark.parametrize("bounds", [*COUNTED, {"minProperties": 1, "maxProperties": 1},
                                    {"minProperties": 6}, {"maxProperties": 1, "required": ["a"]},
                                    {"minProperties": 1, "required": ["a"]}],
                         ids=lambda b: json.dumps(b))
@pytest.mark.parametrize("others", OPEN, ids=lambda o: json.dumps(o)[:40])
def test_property_counts_of_an_object_open_to_other_names_as_names_present(bounds, others):
    """Configuration schemas bound the names of objects that also take other names ("at
    least one of these settings, or one of your own", "exactly one step")."""
    listed = {n: {"type": "integer"} for n in ("a", "b", "c")}
    schema = {"type": "object", "properties": listed, **others, **bounds}
    rewritten = copy.deepcopy(schema)
    property_counts_as_presence(rewritten)
    assert "minProperties" not in rewritten and "maxProperties" not in rewritten
    for size in range(6):
        for chosen in itertools.combinations([*listed, "e", "x1", "x2"], size):
            for value in (dict.fromkeys(chosen, 1), dict.fromkeys(chosen, "s")):
                original = jsonschema.Draft202012Validator(schema).is_valid(value)
                assert jsonschema.Draft202012Validator(rewritten).is_valid(value) == original, value
    LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))
