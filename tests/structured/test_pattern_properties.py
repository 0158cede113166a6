"""``patternProperties`` that overlap (a pattern of literal names, a pattern every name
matches) are told apart in schemas that accept exactly what the originals do, as
``jsonschema`` judges it over objects of many names; the originals compile; overlaps of
other patterns stay refused."""

from __future__ import annotations

import copy
import itertools
import json

import jsonschema
import pytest

from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.llguidance_backend import LLGuidanceBackend
from pagedllm.structured.pattern_properties import overlapping_patterns_apart

NAMES = ["a", "MD5", "links", "x1", "_b", "", "run"]
VALUES = [1, "s", -2]
INTEGER, STRING = {"type": "integer"}, {"type": "string"}
POSITIVE = {"type": "number", "minimum": 0}

OVERLAPPING = [
    {"patternProperties": {"^[a-zA-Z0-9_]{1,}$": INTEGER, "^MD5$": POSITIVE}},
    {"patternProperties": {"^\\w[-\\w_]*$": INTEGER, "^(links|relationships)$": POSITIVE},
     "additionalProperties": False},
    {"patternProperties": {".*": POSITIVE, "^_execute_browser_action$": INTEGER},
     "properties": {"run": {"type": "number"}}},
    {"patternProperties": {".*": INTEGER, "^x": {"minimum": 0}, "^_": {"maximum": 0}},
     "additionalProperties": STRING},
    {"patternProperties": {"": INTEGER, "^.*": POSITIVE, "^a$": {"maximum": 0}},
     "additionalProperties": False},
    {"patternProperties": {"^MD5$": STRING, "^(MD5|a)$": {"minLength": 1}, "^x": INTEGER},
     "properties": {"a": {"maxLength": 1}}, "required": ["a"]},
    {"patternProperties": {".*": POSITIVE}, "properties": {"run": INTEGER, "a": True},
     "additionalProperties": STRING},
]


def objects():
    for size in range(3):
        for names in itertools.combinations(NAMES, size):
            for values in itertools.product(VALUES, repeat=size):
                yield dict(zip(names, values))


@pytest.mark.parametrize("schema", OVERLAPPING, ids=lambda s: json.dumps(s)[:60])
def test_overlapping_patterns_told_apart_accept_what_the_schema_accepts(schema):
    schema = {"type": "object", **schema}
    rewritten = copy.deepcopy(schema)
    overlapping_patterns_apart(rewritten, set())
    assert len(rewritten.get("patternProperties", {})) < len(schema["patternProperties"])
    for value in objects():
        original = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert jsonschema.Draft202012Validator(rewritten).is_valid(value) == original, value
    LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))


def test_other_overlaps_stay_refused():
    schema = {"type": "object", "patternProperties": {"github": INTEGER, "hipchat": STRING}}
    rewritten = copy.deepcopy(schema)
    overlapping_patterns_apart(rewritten, set())
    assert rewritten == schema
    with pytest.raises(ValueError, match="disjoint"):
        LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))


def test_a_pattern_a_reference_points_into_is_left_in_place():
    """``#/patternProperties/.*`` must name the pattern's own schema, so that overlap is
    not rewritten (and stays refused), where the same schema without the reference is."""
    patterns = {".*": INTEGER, "^a$": POSITIVE}
    LLGuidanceBackend.validate(StructuredOutputsParams(
        json={"type": "object", "patternProperties": patterns}))
    with pytest.raises(ValueError, match="disjoint"):
        LLGuidanceBackend.validate(StructuredOutputsParams(json={
            "type": "object", "patternProperties": patterns,
            "properties": {"copy": {"$ref": "#/patternProperties/.*"}}}))
