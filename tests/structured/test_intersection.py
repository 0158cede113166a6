"""Keywords beside a composition are merged into the schemas it combines them with where
those reference themselves: each merge accepts exactly what "a and b" does (``jsonschema``
over values of every type and objects of many names), the merged schemas compile where
llguidance refused the originals, and a composition of schemas that lead to no cycle, or a
lone reference, is left for llguidance as it was."""

from __future__ import annotations

import copy
import functools
import itertools
import json

import jsonschema
import pytest

from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.intersection import compositions_merged, intersect, reaches_a_cycle
from pagedllm.structured.llguidance_backend import LLGuidanceBackend, _define, _ref_targets
from tests.structured.conftest import grammar_of

NAMES = ["a", "b", "kind"]
SCALARS = [None, True, 0, 2, 7, 2.5, "", "ab", "abcdef", [], [1], [1, 2, 3]]


def values():
    yield from SCALARS
    for size in range(3):
        for names in itertools.combinations(NAMES, size):
            for items in itertools.product([1, "x", None], repeat=size):
                yield dict(zip(names, items))


PAIRS = [
    ({"type": "integer"}, {"type": "number", "minimum": 1}),
    ({"type": ["string", "null"], "maxLength": 4}, {"type": "string", "minLength": 1}),
    ({"type": "string"}, {"type": "integer"}),
    ({"minimum": 0, "maximum": 5}, {"exclusiveMaximum": 3, "minimum": 1}),
    ({"type": "array", "items": {"type": "integer"}}, {"maxItems": 2, "items": {"minimum": 1}}),
    ({"required": ["a"], "properties": {"a": {"type": "integer"}}},
     {"required": ["kind"], "properties": {"kind": {"enum": ["x"]}},
      "additionalProperties": False}),
    ({"properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "integer"}},
     {"properties": {"b": {"type": "integer"}}, "additionalProperties": False}),
    ({"properties": {"a": {"title": "any"}}}, {"properties": {"a": {"type": "null"}}}),
    ({"enum": [1, "x"]}, {"enum": [1, "x"], "type": "integer"}),
    (True, {"type": "null"}),
    ({"type": "object", "x-order": 1, "properties": {"a": {"javaAbstract": True}}},
     {"properties": {"a": {"type": "integer"}}}),
    ({"type": "object"}, False),
]


@pytest.mark.parametrize("a,b", PAIRS, ids=lambda s: json.dumps(s)[:40])
def test_an_intersection_accepts_what_both_schemas_do(a, b):
    merged = intersect(a, b)
    assert merged is not None
    for value in values():
        both = jsonschema.Draft202012Validator(a).is_valid(value) \
            and jsonschema.Draft202012Validator(b).is_valid(value)
        assert jsonschema.Draft202012Validator(merged).is_valid(value) == both, (value, merged)


# GeoJSON in small (52north's Geometry schema): shared properties beside a choice of
# geometries, one of which holds geometries again; a keyword JSON Schema does not know
# (web-types' ``javaInterfaces``) is an annotation.
POINT = {"type": "object", "required": ["type", "coordinates"],
         "properties": {"type": {"enum": ["Point"]},
                        "coordinates": {"type": "array", "items": {"type": "integer"},
                                        "minItems": 2, "maxItems": 2}}}
COLLECTION = {"type": "object", "required": ["type", "geometries"],
              "properties": {"type": {"enum": ["GeometryCollection"]},
                             "geometries": {"type": "array", "maxItems": 2,
                                            "items": {"$ref": "#"}}}}
GEOMETRY = {"type": "object", "required": ["type"], "javaInterfaces": ["Geometry"],
            "properties": {"type": {"type": "string"}, "crs": {"type": "string", "maxLength": 3}},
            "oneOf": [{"$ref": "#/definitions/Point"}, {"$ref": "#/definitions/Collection"}],
            "definitions": {"Point": POINT, "Collection": COLLECTION}}
# A base extended with properties of its own (web-types' contributions, Hayson's grids),
# the base holding the extended schema again.
EXTENDED = {"$defs": {"base": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 3},
                "kids": {"type": "array", "maxItems": 1, "items": {"$ref": "#/$defs/node"}}}},
                      "node": {"required": ["name"], "properties": {"size": {"type": "integer"}},
                               "allOf": [{"$ref": "#/$defs/base"}]}},
            "$ref": "#/$defs/node"}
GEOMETRY_VALUES = [{"type": "Point", "coordinates": [1, 2]},
                   {"type": "Point", "coordinates": [1, 2], "crs": "abcd"},
                   {"type": "GeometryCollection", "geometries": [{"type": "Point",
                                                                   "coordinates": [0, 0]}]},
                   {"type": "GeometryCollection", "geometries": [{"type": "Point"}]},
                   {"type": "Line"}, {"coordinates": [1, 2]}, "Point", 3, None]
EXTENDED_VALUES = [{"name": "a"}, {"name": "a", "size": 2, "kids": [{"name": "b"}]},
                   {"name": "abcd"}, {"name": "a", "kids": [{"size": 1}]},
                   {"name": "a", "size": "2"},
                   {"size": 1}, {}, "a", None]


def _rewritten(schema: dict) -> dict:
    root = copy.deepcopy(schema)
    follow = functools.partial(_ref_targets, {"": root})
    recursive = reaches_a_cycle(follow)
    for node in [root, *root.get("$defs", {}).values()]:
        compositions_merged(node, follow, recursive)
    return root


@pytest.mark.parametrize("schema,examples", [(GEOMETRY, GEOMETRY_VALUES),
                                             (EXTENDED, EXTENDED_VALUES)], ids=["oneOf", "allOf"])
def test_compositions_with_self_references_merge_exactly_and_compile(schema, examples):
    rewritten = _rewritten(schema)
    assert rewritten != schema
    validator = jsonschema.validators.validator_for(schema)
    for value in examples + list(values()):
        assert validator(rewritten).is_valid(value) == validator(schema).is_valid(value), value
    LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))


def test_a_geometry_collection_is_constrained_as_the_schema_says(manager, ids):
    valid = '{"type":"GeometryCollection","geometries":[{"type":"Point","coordinates":[1,2]}]}'
    jsonschema.validate(json.loads(valid), GEOMETRY)
    assert grammar_of(manager, StructuredOutputsParams(json=GEOMETRY)).num_allowed(ids(valid)) \
        == len(valid)
    invalid = '{"type":"GeometryCollection","crs":"abcd"'
    assert grammar_of(manager, StructuredOutputsParams(json=GEOMETRY)).num_allowed(ids(invalid)) \
        == len('{"type":"GeometryCollection","crs":"abc')


def test_compositions_that_lead_to_no_cycle_and_lone_references_stay():
    plain = {"$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}}}},
             "properties": {"b": {"type": "string"}}, "allOf": [{"$ref": "#/$defs/base"}],
             "anyOf": [{"$ref": "#/$defs/base"}]}
    assert _rewritten(plain) == plain
    lone = {"$defs": {"node": {"properties": {"kids": {"items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    assert _rewritten(lone) == lone


def test_a_schema_inside_what_it_merges_becomes_a_reference_to_the_merge():
    """``node`` extends the definition that holds it: a copy of that definition's
    properties in ``node`` would hold ``node`` itself, so the merge becomes a definition of
    its own that ``node`` references (without a way to add one, ``node`` stays)."""
    node = {"required": ["name"], "allOf": [{"$ref": "#/$defs/holder"}]}
    holder = {"type": "object", "properties": {"name": {"type": "string"}, "child": node}}
    schema = {"$defs": {"holder": holder}, "$ref": "#/$defs/holder"}
    original = copy.deepcopy(schema)
    follow = functools.partial(_ref_targets, {"": schema})
    compositions_merged(node, follow, reaches_a_cycle(follow))
    assert node == {"required": ["name"], "allOf": [{"$ref": "#/$defs/holder"}]}
    compositions_merged(node, follow, reaches_a_cycle(follow),
                        define=functools.partial(_define, schema))
    assert set(node) == {"$ref"}
    json.dumps(schema)  # no schema object holds itself
    examples = [{"name": "a"}, {"name": "a", "child": {"name": "b"}}, {"name": "a", "child": {}},
                {"child": {"name": "b"}}, {"name": 1}, "a"]
    for value in examples:
        assert jsonschema.Draft202012Validator(schema).is_valid(value) \
            == jsonschema.Draft202012Validator(original).is_valid(value), value


def test_a_choice_inside_the_definition_it_chooses_compiles():
    """Windows' .resjson schema: a resource's values are strings or resources, each value
    with at least one property, inside the resource definition itself."""
    value = {"minProperties": 1, "anyOf": [{"type": "string"}, {"$ref": "#/definitions/resource"}]}
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "additionalProperties": value,
              "definitions": {"resource": {"type": "object", "additionalProperties": value}}}
    LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))


# Washington Post's ANS related content in small: a catch-all pattern of lists of content
# or references beside a listed ``redirect``, and content that holds related content again.
CONTENT = {"type": "object", "additionalProperties": False, "required": ["type"],
           "properties": {"type": {"enum": ["story", "redirect"]},
                          "related": {"$ref": "#/definitions/related"}}}
REFERENCE = {"type": "object", "additionalProperties": False, "required": ["type", "id"],
             "properties": {"type": {"enum": ["reference"]}, "id": {"type": "string"}}}
REDIRECT = {"type": "object", "required": ["type"],
            "properties": {"type": {"enum": ["redirect"]}, "url": {"type": "string"}}}
RELATED = {"type": "object",
           "patternProperties": {".*": {"type": "array", "items": {"anyOf": [
               {"$ref": "#/definitions/content"}, {"$ref": "#/definitions/reference"}]}}},
           "properties": {"redirect": {"type": "array", "maxItems": 1,
                                       "items": {"$ref": "#/definitions/redirect"}}}}
ANS = {"$ref": "#/definitions/content",
       "definitions": {"content": CONTENT, "reference": REFERENCE, "redirect": REDIRECT,
                       "related": RELATED}}
ANS_VALUES = [{"type": "story"},
              {"type": "story", "related": {"redirect": [{"type": "redirect"}]}},
              {"type": "story", "related": {"redirect": [{"type": "redirect", "url": "x"}]}},
              {"type": "story", "related": {"redirect": [{"type": "reference", "id": "1"}]}},
              {"type": "story", "related": {"basic": [{"type": "reference", "id": "1"},
                                                      {"type": "story"}]}},
              {"type": "story", "related": {"basic": [{"type": "redirect", "url": "x"}]}},
              {"type": "story", "related": {"redirect": [{"type": "story"}]}}]


def test_a_listed_property_beside_a_catch_all_pattern_of_self_references_compiles_exactly(
        monkeypatch):
    from llguidance import LLMatcher
    sent = []
    compile_schema = LLMatcher.grammar_from_json_schema
    monkeypatch.setattr(LLMatcher, "grammar_from_json_schema", staticmethod(
        lambda schema, defaults=None: sent.append(copy.deepcopy(schema))
        or compile_schema(schema, defaults=defaults)))
    LLGuidanceBackend.validate(StructuredOutputsParams(json=ANS))
    validator = jsonschema.Draft202012Validator
    for value in ANS_VALUES:
        assert validator(sent[0]).is_valid(value) == validator(ANS).is_valid(value), value
    # A redirect must be content or a reference too: one without a URL, typed "redirect".
    assert [validator(ANS).is_valid(v) for v in ANS_VALUES] \
        == [True, True, False, False, True, False, False]
