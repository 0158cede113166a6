"""A ``type`` beside a composition that already implies it is left out, so that schemas whose
branches reference a recursive definition compile; the rewritten schema accepts exactly
what the original does (``jsonschema`` over values of every type); a ``type`` the
composition does not imply stays. References' pointers are read as URI fragments."""

from __future__ import annotations

import copy
import functools
import json

import jsonschema
import pytest

from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.implied_types import drop_implied_type, types_of
from pagedllm.structured.json_schema import resolve_pointer
from pagedllm.structured.llguidance_backend import LLGuidanceBackend, _ref_targets
from tests.structured.conftest import grammar_of

# Definitions that hold each other through a ``type`` beside a choice (Github's image
# transform specs): what llguidance refuses to intersect.
TREE = {"type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {"name": {"type": "string"},
                       "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
LEAF = {"type": "object", "additionalProperties": False, "required": ["leaf"],
        "properties": {"leaf": {"type": "integer"}}}
TREE_REF, LEAF_REF = {"$ref": "#/$defs/tree"}, {"$ref": "#/$defs/leaf"}
DEFS = {"tree": TREE, "leaf": LEAF, "node": {"type": "object", "anyOf": [TREE_REF, LEAF_REF]}}

VALUES = [None, True, 0, 3, 1.5, "s", "admin", [], [1], {}, {"name": "a"},
          {"name": "a", "kids": [{"name": "b"}]}, {"leaf": 1}, {"leaf": "x"}, {"x": 1}]

IMPLIED = [
    {"type": "object", "anyOf": [TREE_REF, LEAF_REF]},
    {"type": "object", "oneOf": [TREE_REF, LEAF_REF]},
    {"type": ["object", "null"], "anyOf": [TREE_REF, {"type": "null"}]},
    {"type": "object", "allOf": [TREE_REF, {"required": ["name"]}]},
    {"type": "object", "$ref": "#/$defs/tree"},
    {"type": "string", "anyOf": [{"enum": ["admin", "editor"]}, {"const": "s"}]},
    {"type": "number", "oneOf": [{"type": "integer"}, {"enum": [1.5]}]},
    {"type": "array", "anyOf": [{"type": "array", "maxItems": 0}, False]},
]
NOT_IMPLIED = [
    {"type": "object", "anyOf": [TREE_REF, {"required": ["leaf"]}]},  # the second: any non-object
    {"type": "integer", "anyOf": [{"type": "number"}, {"enum": [3]}]},  # 1.5 is a number
    {"type": "string", "anyOf": [{"enum": ["admin", 3]}]},
    {"type": "object", "anyOf": [{"$ref": "#/$defs/missing"}]},
]


def _rewritten(schema: dict) -> dict:
    root = copy.deepcopy({**schema, "$defs": DEFS})
    drop_implied_type(root, functools.partial(_ref_targets, {"": root}))
    return root


@pytest.mark.parametrize("schema", IMPLIED, ids=lambda s: json.dumps(s)[:60])
def test_an_implied_type_is_left_out_and_the_schema_accepts_the_same_values(schema):
    original, rewritten = {**schema, "$defs": DEFS}, _rewritten(schema)
    assert "type" not in rewritten
    for value in VALUES:
        assert jsonschema.Draft202012Validator(rewritten).is_valid(value) \
            == jsonschema.Draft202012Validator(original).is_valid(value), value
    LLGuidanceBackend.validate(StructuredOutputsParams(json=original))


@pytest.mark.parametrize("schema", NOT_IMPLIED, ids=lambda s: json.dumps(s)[:60])
def test_a_type_the_composition_does_not_imply_stays(schema):
    assert _rewritten(schema)["type"] == schema["type"]


def test_types_of_reads_references_branches_and_members():
    follow = functools.partial(_ref_targets, {"": {"$defs": DEFS}})
    assert types_of({"anyOf": [TREE_REF, {"type": "null"}]}, follow) == {"object", "null"}
    assert types_of({"allOf": [{"type": ["string", "null"]}, {"enum": ["a"]}]}, follow) \
        == {"string"}
    assert types_of({"type": "number"}, follow) == {"number", "integer"}
    assert types_of({"anyOf": [TREE_REF, {"minimum": 0}]}, follow) is None
    assert types_of(False, follow) == frozenset()


def test_a_choice_of_recursive_definitions_behind_a_type_constrains_as_the_schema_says(
        manager, ids):
    """Github's image transform specs in small: a list of nodes, each one of two
    definitions, one of them holding nodes again, with ``type`` beside the choice."""
    schema = {"type": "object", "additionalProperties": False, "required": ["items"],
              "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
              "$defs": DEFS}
    valid = '{"items":[{"name":"a","kids":[{"name":"b"}]},{"leaf":7}]}'
    jsonschema.validate(json.loads(valid), schema)
    assert grammar_of(manager, StructuredOutputsParams(json=schema)).num_allowed(ids(valid)) \
        == len(valid)
    for invalid, allowed in (('{"items":[{"leaf":"x"}]}', len('{"items":[{"leaf":')),
                             ('{"items":[7]}', len('{"items":['))):
        assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(invalid))
        grammar = grammar_of(manager, StructuredOutputsParams(json=schema))
        assert grammar.num_allowed(ids(invalid)) == allowed


def test_pointers_are_read_as_uri_fragments():
    root = {"$defs": {"[a-z]+": {"type": "string"}, "50%": {"type": "integer"}}}
    assert resolve_pointer(root, "/$defs/%5Ba-z%5D%2B") == {"type": "string"}
    assert resolve_pointer(root, "/$defs/50%25") == {"type": "integer"}
    schema = {"type": "object", "properties": {"name": {"$ref": "#/$defs/%5Ba-z%5D%2B"}},
              "$defs": root["$defs"]}
    LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))
