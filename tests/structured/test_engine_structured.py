"""Structured outputs through the offline engine: what users rely on.

- Sampled outputs (temperature 1, many seeds) always parse and validate against their JSON
  schema (checked with ``jsonschema``), fully match their regex, or are one of the choices.
- Greedy constrained decoding equals a reference built from HF transformers' logits and the
  grammar's mask, whatever the batching, chunking, prefix caching, preemption or
  asynchronous scheduling; unconstrained requests beside constrained ones are unchanged.
- Bad constraints raise a ValueError that says what is wrong.
"""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.llguidance_backend import LLGuidanceBackend
from tests.engine.conftest import VOCAB_SIZE, hf_greedy, random_prompts
from tests.structured.schemas import SCHEMAS

PROMPTS = [[5, 9, 17, 33], [100, 101, 102, 103, 104, 105, 106], [250, 12]]
REGEX = r"(\+1 )?\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral ☺", 'a "quoted" one']


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    return LLM(str(model_dir), block_size=8, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return make_llm(tiny_model_dir)


def sample(llm, constraint: StructuredOutputsParams, num: int, **params):
    params = SamplingParams(**{"temperature": 1.0, "max_tokens": 160, **params},
                            structured_outputs=constraint)
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(num)]
    seeded = [params.clone(seed=i) for i in range(num)]
    return [o.outputs[0] for o in llm.generate(prompts, seeded, use_tqdm=False)]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_json_always_validates_against_its_schema(llm, name):
    schema = SCHEMAS[name]
    for completion in sample(llm, StructuredOutputsParams(json=schema), num=24):
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_formats_the_backend_does_not_know_are_annotations(llm):
    """OpenAPI's ``int32`` / ``double``, ``uri-reference`` or a made-up ``color`` do not
    refuse the schema (JSON Schema makes ``format`` an annotation): the values follow their
    types; a format the backend knows still constrains (``date``). Data that looks like a
    schema (a ``const`` object with a ``format`` key, a ``default`` holding a remote
    ``$ref``) is left as it is."""
    schema = {"type": "object", "additionalProperties": False,
              "required": ["count", "ratio", "link", "shade", "day", "kind"],
              "properties": {
                  "count": {"type": "integer", "format": "int32", "maximum": 99},
                  "ratio": {"type": "number", "format": "double", "minimum": 0, "maximum": 10,
                            "multipleOf": 0.5},
                  "link": {"type": "string", "format": "uri-reference", "maxLength": 12},
                  "shade": {"type": "string", "format": "color", "maxLength": 8},
                  "day": {"type": "string", "format": "date"},
                  "kind": {"const": {"format": "png", "$ref": "https://example.com/x"},
                           "default": {"$ref": "https://example.com/y"}}}}
    for completion in sample(llm, StructuredOutputsParams(json=schema), num=12, max_tokens=200):
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        jsonschema.validate(value, schema)
        assert value["kind"] == {"format": "png", "$ref": "https://example.com/x"}
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", value["day"]), value["day"]


# Parameters as real tool sets write them: a draft-07 schema with its own $id and
# definitions (and a keyword beside a $ref, which draft 7 ignores), a draft-04 one with "id",
# a definition name two tools define differently, a recursive reference to the schema's root.
DRAFT7 = {"$schema": "http://json-schema.org/draft-07/schema#", "$id": "https://example.com/a.json",
          "type": "object", "required": ["zone"], "additionalProperties": False,
          "properties": {"zone": {"$ref": "#/definitions/zone", "type": "integer"}},
          "definitions": {"zone": {"enum": ["UTC", "CET"]}}}
DRAFT4 = {"$schema": "http://json-schema.org/draft-04/schema#", "id": "https://example.com/b.json",
          "type": "object", "required": ["size"], "additionalProperties": False,
          "properties": {"size": {"$ref": "https://example.com/b.json#/definitions/size"}},
          "definitions": {"size": {"type": "integer", "minimum": 1, "maximum": 9}}}
OTHER_ZONE = {"definitions": {"zone": {"type": "integer", "maximum": 12}}, "type": "object",
              "required": ["zone"], "additionalProperties": False,
              "properties": {"zone": {"$ref": "#/definitions/zone"}}}
TREE = {"type": "object", "required": ["label"], "additionalProperties": False,
        "properties": {"label": {"enum": ["x", "y"]},
                       "child": {"$ref": "#"}}}
DRAFT_TOOLS = {"set_zone": DRAFT7, "set_size": DRAFT4, "offset": OTHER_ZONE, "tree": TREE}


def test_required_calls_keep_each_tools_references_apart(llm):
    """``required`` puts every tool's parameters in one schema; the references inside each
    (``#/definitions/...`` under its own ``$id``, a draft-4 ``id``, the same definition
    name meaning two things, ``#``) still resolve within that tool."""
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.tool_choice import plan_tools

    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "Go."}], tool_choice="required",
        parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": n, "parameters": p}}
               for n, p in DRAFT_TOOLS.items()])
    constraint = StructuredOutputsParams(**plan_tools(request, None).constraint)
    names = set()
    for completion in sample(llm, constraint, num=12, max_tokens=300):
        assert completion.finish_reason == "stop", completion.text
        for call in json.loads(completion.text):
            schema = DRAFT_TOOLS[call["name"]]
            jsonschema.validators.validator_for(schema)(schema).validate(call["arguments"])
            names.add(call["name"])
    assert len(names) > 1
    for name, parameters in DRAFT_TOOLS.items():  # each compiles alone (none dropped)
        alone = request.model_copy(update={"tools": [
            {"type": "function", "function": {"name": name, "parameters": parameters}}]})
        LLGuidanceBackend.validate(StructuredOutputsParams(**plan_tools(alone, None).constraint))


@pytest.mark.parametrize("draft", ["draft-07", "2020-12"])
def test_dependencies_between_properties_hold(llm, draft):
    """"If this property is present, those are too / this schema holds": draft 7's
    ``dependencies`` (both forms) and 2020-12's ``dependentRequired`` / ``dependentSchemas``."""
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"a": {"type": "string", "maxLength": 5},
                             "b": {"type": "integer", "maximum": 9}, "c": {"type": "boolean"},
                             "d": {"enum": ["x", "y"]}}}
    names, schemas = {"a": ["b"]}, {"c": {"required": ["d"], "properties": {"d": {"const": "y"}}}}
    if draft == "draft-07":
        schema.update({"$schema": "http://json-schema.org/draft-07/schema#",
                       "dependencies": {**names, **schemas}})
    else:
        schema.update({"$schema": "https://json-schema.org/draft/2020-12/schema",
                       "dependentRequired": names, "dependentSchemas": schemas})
    validator = jsonschema.validators.validator_for(schema)(schema)
    seen = []
    for completion in sample(llm, StructuredOutputsParams(json=schema), num=32, max_tokens=80):
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        validator.validate(value)
        seen.append(value)
    assert any("a" in v for v in seen) and any("c" in v for v in seen)


def sampled_values(llm, schema, num, max_tokens):
    """The parsed outputs of ``num`` seeds, every one complete and valid under ``schema``."""
    validator = jsonschema.validators.validator_for(schema)(schema)
    values = []
    for completion in sample(llm, StructuredOutputsParams(json=schema), num=num,
                             max_tokens=max_tokens):
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        validator.validate(value)
        values.append(value)
    return values


def test_one_of_branches_that_require_names_hold_exactly_one(llm):
    """"Give the radius, or the side, or the base and the height": a
    ``oneOf`` of ``required`` lists, as function-calling schemas write it, holds exactly, so
    no output gives two shapes' names at once."""
    shape = {name: {"type": "integer", "minimum": 1, "maximum": 99}
             for name in ("radius", "side", "base", "height")}
    schema = {"type": "object", "properties": shape, "additionalProperties": False,
              "oneOf": [{"required": ["radius"]}, {"required": ["side"]},
                        {"required": ["base", "height"], "description": "a triangle"}]}
    values = sampled_values(llm, schema, num=32, max_tokens=60)
    assert len({frozenset(v) & {"radius", "side", "base"} for v in values}) > 1


def test_one_of_object_branches_hold_objects_alone(llm):
    """Branches that only constrain objects (here through ``$ref``) each accept every other
    value, so a number or a string would hold under two of them: only objects are generated,
    each holding exactly one branch."""
    schema = {"$defs": {"Circle": {"properties": {"r": {"type": "integer", "maximum": 9}},
                                   "required": ["r"], "additionalProperties": False},
                        "Square": {"properties": {"side": {"type": "integer", "maximum": 9}},
                                   "required": ["side"], "additionalProperties": False}},
              "oneOf": [{"$ref": "#/$defs/Circle"}, {"$ref": "#/$defs/Square"}]}
    values = sampled_values(llm, schema, num=24, max_tokens=40)
    assert all(isinstance(v, dict) for v in values)
    assert {"r", "side"} == {key for v in values for key in v}


def test_one_of_closed_branches_that_both_hold_the_empty_object_never_give_it(llm):
    """A cursor is ``{"next": ...}`` or ``{"previous": ...}``, each branch closed and
    requiring nothing: ``{}`` holds both, so it is never generated."""
    cursor = {"type": "string", "maxLength": 8}
    schema = {"type": "object",
              "oneOf": [{"additionalProperties": False, "properties": {"next": cursor}},
                        {"additionalProperties": False, "properties": {"previous": cursor}}]}
    values = sampled_values(llm, schema, num=32, max_tokens=40)
    assert {"next", "previous"} == {key for v in values for key in v}


def test_one_of_whose_branches_may_overlap_is_taken_as_any_of(llm):
    """A ``oneOf`` the backend cannot make exact is accepted, as vLLM's default backend does,
    and each output holds at least one branch (it may hold more)."""
    branches = [{"type": "string", "maxLength": 6},
                {"type": "string", "pattern": "^a", "maxLength": 9}]
    for completion in sample(llm, StructuredOutputsParams(json={"oneOf": branches}), num=16,
                             max_tokens=40):
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        assert any(jsonschema.validators.Draft202012Validator(b).is_valid(value)
                   for b in branches), value


def test_not_of_types_names_and_nothing_holds(llm):
    """``not`` as real-world schemas write it: "not both ``a`` and ``b``", "never
    ``legacy``" (``{"not": {}}``), "neither ``c`` nor ``d``", "any value but a string or
    null"."""
    small = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"a": small, "b": small, "c": small, "d": small,
                             "legacy": {"not": {}},
                             "v": {"not": {"type": ["string", "null", "object", "array"]}}},
              "not": {"required": ["a", "b"]},
              "allOf": [{"not": {"anyOf": [{"required": ["c"]}, {"required": ["d"]}]}}]}
    values = sampled_values(llm, schema, num=32, max_tokens=60)
    assert all("legacy" not in v and not {"c", "d"} & set(v) for v in values)
    assert any("a" in v for v in values) and any("b" in v for v in values)
    assert any(isinstance(v.get("v"), (bool, int, float)) for v in values)


def test_not_of_a_pattern_generates_only_strings_it_does_not_match(llm):
    """"Not blank" and "no character outside a-z" as ``not`` of a pattern: every output
    validates, so no name is blank and every tag is lowercase letters."""
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "tag"],
              "properties": {"name": {"type": "string", "maxLength": 6,
                                      "not": {"pattern": "^\\s*$"}},
                             "tag": {"type": "string", "maxLength": 4,
                                     "not": {"pattern": "[^a-z]"}}}}
    values = sampled_values(llm, schema, num=16, max_tokens=60)
    assert all(v["name"].strip() and re.fullmatch("[a-z]*", v["tag"]) for v in values)
    assert any(v["tag"] for v in values)


def test_lookaheads_at_a_patterns_start_hold_in_every_output(llm):
    """A plugin's main class "not in org.bukkit" and a name "not starting with iobroker, in
    any case" (JSON Schema Store's bukkit and ioBroker schemas) are served, and every output
    validates, so no value takes a prefix its lookahead refuses."""
    schema = {"type": "object", "additionalProperties": False, "required": ["main", "name"],
              "properties": {"main": {"type": "string", "maxLength": 12,
                                      "pattern": "^(?!org\\.b)([a-z]+\\.)*[a-z]+$"},
                             "name": {"type": "string", "maxLength": 4,
                                      "pattern": "^(?=[a-z])(?![oO][rR])"}}}
    values = sampled_values(llm, schema, num=16, max_tokens=60)
    assert all(not v["main"].startswith("org.b") and v["name"][:2].lower() != "or"
               for v in values)


def test_if_then_else_as_real_world_schemas_switch_on_a_kind(llm):
    """``allOf`` of ``if`` / ``then`` on a discriminator (JSON Schema Store's configs switch
    so), and a node's own ``if`` / ``then`` / ``else``: every output validates, and more
    than one case is generated."""
    small = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {"type": "object", "additionalProperties": False, "required": ["kind"],
              "properties": {"kind": {"enum": ["disk", "net", "cpu"]}, "size": small,
                             "port": small, "cores": small},
              "allOf": [{"if": {"properties": {"kind": {"const": "disk"}}},
                         "then": {"required": ["size"]}},
                        {"if": {"properties": {"kind": {"const": "net"}}},
                         "then": {"required": ["port"], "properties": {"size": False}}}],
              "if": {"properties": {"kind": {"const": "cpu"}}},
              "then": {"required": ["cores"]}, "else": {"properties": {"cores": False}}}
    values = sampled_values(llm, schema, num=32, max_tokens=60)
    assert len({v["kind"] for v in values}) >= 2


def test_property_counts_of_objects_open_to_other_names_hold(llm):
    """CircleCI's "a step is one command, built in or your own" (one name, listed or
    matching a pattern) and "at least one setting", listed or of one's own: every output
    validates, so each step holds exactly one name and no map is empty."""
    small = {"type": "integer", "minimum": 0, "maximum": 9}
    step = {"type": "object", "minProperties": 1, "maxProperties": 1,
            "properties": {"run": small, "save": small}, "patternProperties": {"^[a-z]{1,3}$": small},
            "additionalProperties": False}
    schema = {"type": "object", "additionalProperties": False, "required": ["steps", "env"],
              "properties": {"steps": {"type": "array", "items": step, "minItems": 1, "maxItems": 3},
                             "env": {"type": "object", "minProperties": 1,
                                     "properties": {"home": small},
                                     "patternProperties": {"^[A-Z]{1,3}$": small},
                                     "additionalProperties": False}}}
    values = sampled_values(llm, schema, num=16, max_tokens=120)
    assert all(len(s) == 1 for v in values for s in v["steps"])


def test_a_name_that_two_patterns_match_holds_both(llm):
    """JSON:API's "member names, and ``links`` / ``relationships`` among them" (a pattern
    of names beside a pattern they match): every output validates, so ``ab`` and ``run``
    hold both patterns' schemas."""
    schema = {"type": "object", "minProperties": 1, "additionalProperties": False,
              "patternProperties": {"^[a-z]{1,3}$": {"type": "integer", "minimum": 0,
                                                     "maximum": 9},
                                    "^(ab|run)$": {"maximum": 2}}}
    values = sampled_values(llm, schema, num=16, max_tokens=60)
    assert all(v.get(name, 0) <= 2 for v in values for name in ("ab", "run"))


def test_maps_keyed_by_property_names_use_only_the_names_allowed(llm):
    """``propertyNames`` of a map (a pattern here, a list of names beside it) holds."""
    schema = {"type": "object", "additionalProperties": False, "required": ["env", "ports"],
              "properties": {
                  "env": {"type": "object", "propertyNames": {"pattern": "^[A-C]{1,2}$"},
                          "additionalProperties": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}},
                  "ports": {"type": "object", "propertyNames": {"enum": ["http", "ssh"]},
                            "additionalProperties": {"type": "integer", "minimum": 1,
                                                     "maximum": 99}}}}
    values = sampled_values(llm, schema, num=16, max_tokens=80)
    assert any(v["env"] for v in values) and any(v["ports"] for v in values)


def test_draft_7_references_ignore_the_keywords_beside_them(llm):
    """Drafts 4-7 read ``{"$ref": ..., "type": ...}`` as the reference alone, so a
    self-referencing tree whose references carry other keywords is served (with an ``$id``
    beside the root's reference, through which its references still resolve), and a
    ``type`` beside a reference does not change what is generated; 2020-12 applies them,
    and refuses the schema: its required ``v`` would be an integer and a string."""
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    tree = {"type": "object", "additionalProperties": False, "required": ["v"],
            "properties": {"v": {"$ref": "#/definitions/digit", "type": "string"},
                           "kids": {"type": "array", "maxItems": 1,
                                    "items": {"$ref": "#/definitions/node", "type": "object"}}}}
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/node",
              "$id": "https://example.com/tree.json",
              "definitions": {"node": tree, "digit": digit, "key": {"enum": ["a", "b"]}}}
    tree["properties"]["tags"] = {"type": "object", "propertyNames": {"$ref": "#/definitions/key"},
                                  "additionalProperties": {"$ref": "#/definitions/digit"}}
    values = sampled_values(llm, schema, num=16, max_tokens=120)

    def digits(node):
        return [node["v"]] + [d for kid in node.get("kids", []) for d in digits(kid)]
    assert all(isinstance(d, int) for v in values for d in digits(v))
    assert any(v.get("kids") for v in values)
    later = {key: value for key, value in schema.items() if key != "$schema"}
    with pytest.raises(ValueError, match="required property 'v' is unsatisfiable"):
        LLGuidanceBackend.validate(StructuredOutputsParams(json=later))


def test_shared_properties_beside_a_choice_of_self_referencing_variants_are_served(llm):
    """GeoJSON's form (52north's Geometry schema): a ``type`` and a ``crs`` shared beside a
    ``oneOf`` of geometries, one of them a collection of geometries again. llguidance
    refuses to intersect the shared keywords with a variant that references itself; merged
    into copies of the variants, the schema is served, and every output validates."""
    point = {"type": "object", "required": ["type", "coordinates"], "additionalProperties": False,
             "properties": {"type": {"enum": ["Point"]}, "crs": {},
                            "coordinates": {"type": "array", "minItems": 2, "maxItems": 2,
                                            "items": {"type": "integer", "minimum": 0,
                                                      "maximum": 9}}}}
    collection = {"type": "object", "required": ["type", "geometries"],
                  "additionalProperties": False,
                  "properties": {"type": {"enum": ["GeometryCollection"]}, "crs": {},
                                 "geometries": {"type": "array", "maxItems": 1,
                                                "items": {"$ref": "#"}}}}
    schema = {"type": "object", "required": ["type"],
              "properties": {"type": {"type": "string"}, "crs": {"enum": ["EPSG", "WGS"]}},
              "oneOf": [{"$ref": "#/definitions/point"}, {"$ref": "#/definitions/collection"}],
              "definitions": {"point": point, "collection": collection}}
    values = sampled_values(llm, schema, num=16, max_tokens=160)
    assert {v["type"] for v in values} == {"Point", "GeometryCollection"}


def test_properties_their_patterns_repeat_are_served_when_self_referencing(llm):
    """A property that also matches a ``patternProperties`` pattern with the same schema
    (Washington Post's ANS credits: ``by`` beside ``^[a-zA-Z0-9_]*``; two keys here), in a
    schema that references itself, is served, and every output validates."""
    people = {"type": "array", "maxItems": 1, "items": {"$ref": "#/$defs/person"}}
    credits = {"type": "object", "additionalProperties": False,
               "properties": {"by": {**people, "title": "By"}},
               "patternProperties": {"^(by|for)$": people}}
    person = {"type": "object", "additionalProperties": False, "required": ["name"],
              "properties": {"name": {"type": "string", "maxLength": 4},
                             "credits": {"$ref": "#/$defs/credits"}}}
    schema = {"$ref": "#/$defs/credits", "$defs": {"credits": credits, "person": person}}
    values = sampled_values(llm, schema, num=16, max_tokens=120)
    assert any(v.get("by") for v in values)


def test_unique_items_where_every_array_holds_it_and_the_way_past_a_refusal(llm):
    """``uniqueItems`` that every array holds (``false``, or at most one item) is served
    exactly; one the backend cannot enforce is a ValueError that names the key and the
    schema's ``x-guidance`` setting that serves it unenforced, which then works."""
    schema = {"type": "object", "additionalProperties": False, "required": ["tags", "one"],
              "properties": {
                  "tags": {"type": "array", "uniqueItems": False, "maxItems": 3,
                           "items": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "one": {"type": "array", "uniqueItems": True, "maxItems": 1,
                          "items": {"enum": ["x", "y"]}}}}
    values = sampled_values(llm, schema, num=16, max_tokens=60)
    assert all(len(v["one"]) <= 1 for v in values)
    assert any(v["tags"] for v in values)
    unenforced = {"type": "array", "uniqueItems": True, "maxItems": 3,
                  "items": {"type": "integer", "minimum": 0, "maximum": 9}}
    with pytest.raises(ValueError, match=r'uniqueItems.*"x-guidance": \{"lenient": true\}'):
        LLGuidanceBackend.validate(StructuredOutputsParams(json=unenforced))
    lenient = {**unenforced, "x-guidance": {"lenient": True}}
    for completion in sample(llm, StructuredOutputsParams(json=lenient), num=8, max_tokens=40):
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        assert isinstance(value, list) and len(value) <= 3


def test_listed_properties_are_the_only_keys_unless_the_schema_allows_others(llm):
    """Pydantic's schemas (what langchain and instructor send) list ``properties`` and say
    nothing of other keys: no other key is generated (as vLLM's default backend does), where
    a grammar that allows them lets the model write keys without end."""
    listed = {"type": "object", "required": ["a"],
              "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}}}
    for completion in sample(llm, StructuredOutputsParams(json=listed), num=16, max_tokens=60):
        assert completion.finish_reason == "stop", completion.text
        assert set(json.loads(completion.text)) <= {"a", "b"}
    allowed = {**listed, "additionalProperties": True}
    completions = sample(llm, StructuredOutputsParams(json=allowed), num=16, max_tokens=60)
    # A key other than "b" after a comma (a value of "b" would escape its quotes).
    assert any(re.search(r',"(?!b":)', c.text) for c in completions)


def test_schemas_composed_of_parts_keep_the_keys_of_every_part(llm):
    """A schema made of parts (``allOf`` of a ``$ref`` and more properties, branches that add
    to their parent's properties) is not closed part by part: each part's keys stay allowed."""
    schema = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}},
                                 "required": ["id"]}},
              "type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"],
              "allOf": [{"$ref": "#/$defs/Base"},
                        {"properties": {"tag": {"const": "x"}}, "required": ["tag"]}],
              "anyOf": [{"properties": {"n": {"type": "integer"}}, "required": ["n"]},
                        {"properties": {"s": {"type": "string", "maxLength": 3}},
                         "required": ["s"]}]}
    values = [json.loads(c.text) for c in
              sample(llm, StructuredOutputsParams(json=schema), num=16, max_tokens=80)
              if c.finish_reason == "stop"]
    assert values
    for value in values:
        jsonschema.validate(value, schema)
        assert {"id", "kind", "tag"} <= set(value) and ({"n", "s"} & set(value))


def test_json_object_is_one_json_object(llm):
    for completion in sample(llm, StructuredOutputsParams(json_object=True), num=12, max_tokens=200):
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:  # cut by max_tokens: a prefix of an object
            assert completion.finish_reason == "length" and completion.text.startswith("{")


def test_sampled_regex_outputs_fully_match(llm):
    for completion in sample(llm, StructuredOutputsParams(regex=REGEX), num=16):
        assert completion.finish_reason == "stop"
        assert re.fullmatch(REGEX, completion.text), completion.text


def test_sampled_choices_are_members(llm):
    texts = {c.text for c in sample(llm, StructuredOutputsParams(choice=CHOICES), num=24)}
    assert texts <= set(CHOICES)
    assert len(texts) > 1  # sampling, not a fixed answer


def test_lark_and_gbnf_grammars_constrain_the_output(llm):
    lark = 'start: item ("," item)*\nitem: /[a-c]{1,3}/'
    gbnf = 'root ::= "(" [0-9] ")" | "none"'
    for grammar, pattern in ((lark, r"[a-c]{1,3}(,[a-c]{1,3})*"), (gbnf, r"\([0-9]\)|none")):
        for completion in sample(llm, StructuredOutputsParams(grammar=grammar), num=8, max_tokens=40):
            prefix_ok = completion.finish_reason == "length" and re.fullmatch(
                r"[a-c,]*", completion.text)
            assert re.fullmatch(pattern, completion.text) or prefix_ok, completion.text


def test_n_seeds_logprobs_and_penalties_keep_the_constraint(llm):
    constraint = StructuredOutputsParams(json=SCHEMAS["person"])
    params = SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=160, logprobs=3,
                            repetition_penalty=1.3, presence_penalty=0.5, top_k=50,
                            structured_outputs=constraint)
    first, again = (llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
                    for _ in range(2))
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]  # seeded
    for completion in first.outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMAS["person"])
        for token, position in zip(completion.token_ids, completion.logprobs):
            assert np.isfinite(position[token].logprob)


def test_stop_strings_cut_the_constrained_output(llm):
    constraint = StructuredOutputsParams(json=SCHEMAS["person"])
    for completion in sample(llm, constraint, num=6, stop=['"age"']):
        assert completion.text.startswith('{"name":"') and '"age"' not in completion.text
        assert completion.finish_reason == "stop" and completion.stop_reason == '"age"'


# -- greedy equality with a reference --------------------------------------------------------
def reference_greedy(hf_model, tokenizer, prompt: list[int], constraint, max_tokens: int) -> list[int]:
    """HF transformers' logits, the grammar's mask, argmax; stops where the engine must."""
    backend = LLGuidanceBackend(tokenizer, VOCAB_SIZE)
    grammar = backend.new_grammar(backend.compile(constraint))
    ids = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
        mask = np.full((1, (backend.vocab_size + 31) // 32), -1, dtype=np.int32)
        backend.fill_bitmasks([(grammar, 0)], mask)
        allowed = (np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB_SIZE] == 1)
        token = int(torch.where(torch.from_numpy(allowed), logits, -torch.inf).argmax())
        out.append(token)
        ids.append(token)
        assert grammar.accept_tokens([token])
        if token in tokenizer.eos_token_ids or grammar.is_terminated():
            break
    return out


CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMAS["nested_with_refs"]),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
}


@pytest.fixture(scope="module")
def greedy_expected(hf_model, llm):
    tokenizer = llm.get_tokenizer()
    return {name: [reference_greedy(hf_model, tokenizer, p, c, 60) for p in PROMPTS]
            for name, c in CONSTRAINTS.items()}


def greedy_run(llm, names=tuple(CONSTRAINTS), free_prompts=()):
    requests, params = [], []
    for name in names:
        for p in PROMPTS:
            requests.append({"prompt_token_ids": p})
            params.append(SamplingParams(temperature=0.0, max_tokens=60,
                                         structured_outputs=CONSTRAINTS[name]))
    for p in free_prompts:
        requests.append({"prompt_token_ids": p})
        params.append(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    outputs = [o.outputs[0] for o in llm.generate(requests, params, use_tqdm=False)]
    constrained = {name: [c.token_ids for c in outputs[i * len(PROMPTS):(i + 1) * len(PROMPTS)]]
                   for i, name in enumerate(names)}
    return constrained, [c.token_ids for c in outputs[len(names) * len(PROMPTS):]]


ENGINE_SETUPS = {
    "default": {},
    "async": {"async_scheduling": True},
    "chunked": {"max_num_batched_tokens": 8, "enable_chunked_prefill": True},
    "preempting": {"num_kv_blocks": 12, "max_model_len": 96, "async_scheduling": True},
    "async_chunked": {"max_num_batched_tokens": 8, "enable_chunked_prefill": True,
                      "async_scheduling": True},
    "no_prefix_cache": {"enable_prefix_caching": False, "max_num_seqs": 2},
}


@pytest.mark.parametrize("setup", sorted(ENGINE_SETUPS))
def test_greedy_constrained_equals_reference_whatever_the_engine_does(
        tiny_model_dir, hf_model, greedy_expected, setup):
    llm = make_llm(tiny_model_dir, **ENGINE_SETUPS[setup])
    free = random_prompts(3, 3, 20, seed=3)
    constrained, free_outputs = greedy_run(llm, free_prompts=free)
    assert constrained == greedy_expected
    assert free_outputs == [hf_greedy(hf_model, p, 12) for p in free]
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    if setup == "preempting":
        assert scheduler.num_preemptions_total > 0


def test_prefix_cache_hit_leaves_the_constrained_output_unchanged(llm, greedy_expected):
    first, _ = greedy_run(llm, names=("json",))
    again, _ = greedy_run(llm, names=("json",))
    assert first["json"] == again["json"] == greedy_expected["json"]


# -- check-then-mask -------------------------------------------------------------------------
def test_the_mask_fill_threads_and_forms_come_from_the_engine_and_the_environment(
        tiny_model_dir, monkeypatch):
    """A constraint is compiled once per request a step may hold (``max_num_seqs``), so
    running requests of one schema do not wait for each other's masks; or as many times as
    PAGEDLLM_GRAMMAR_FORMS says. PAGEDLLM_GRAMMAR_FILL_THREADS sets the threads filling
    masks: outputs still validate with one; values out of range are refused by name."""
    from pagedllm.engine.tokenizer import Tokenizer

    compiled = []
    compile_one = LLGuidanceBackend.compile
    monkeypatch.setattr(LLGuidanceBackend, "compile", lambda self, params:
                        compiled.append(params.key) or compile_one(self, params))
    schema = SCHEMAS["person"]
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_FILL_THREADS", "1")
    for forms, max_num_seqs, compiles in ((None, 3, 3), ("2", 8, 2)):
        compiled.clear()
        monkeypatch.setenv("PAGEDLLM_GRAMMAR_FORMS", forms or "")
        llm = make_llm(tiny_model_dir, max_num_seqs=max_num_seqs)
        for completion in sample(llm, StructuredOutputsParams(json=schema), num=5):
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)
        assert len(compiled) == compiles
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_FILL_THREADS", "0")
    with pytest.raises(ValueError, match="PAGEDLLM_GRAMMAR_FILL_THREADS='0': give an integer"):
        LLGuidanceBackend(Tokenizer.from_pretrained(tiny_model_dir), VOCAB_SIZE)
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_FORMS", "0")
    with pytest.raises(ValueError, match="PAGEDLLM_GRAMMAR_FORMS='0': give an integer"):
        make_llm(tiny_model_dir)


def mask_counters(llm) -> tuple[int, int]:
    structured = llm.llm_engine.engine_core.structured
    return structured.num_checked_rows, structured.num_mask_rows


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_checked_rows_cost_a_mask_only_when_refused_and_keep_the_masked_tokens(
        tiny_model_dir, async_scheduling):
    """Constrained rows are sampled without their mask and their tokens checked; only a
    refused token costs a bitmask, and a token an asynchronous step samples past the end
    of a complete output is not checked. The greedy tokens are those of masking first
    (which requests asking for logprobs take)."""
    llm = make_llm(tiny_model_dir, async_scheduling=async_scheduling)

    def run(**extra):
        before = mask_counters(llm)
        requests, params = [], []
        for constraint in CONSTRAINTS.values():
            for prompt in PROMPTS:
                requests.append({"prompt_token_ids": prompt})
                params.append(SamplingParams(temperature=0.0, max_tokens=60,
                                             structured_outputs=constraint, **extra))
        tokens = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
        checked, masked = (after - b for after, b in zip(mask_counters(llm), before))
        return tokens, checked, masked, sum(map(len, tokens))

    tokens, checked, masked, num_tokens = run()
    assert checked == num_tokens and 0 < masked < checked
    masked_first, checked, masked, num_tokens = run(logprobs=0)
    assert checked == 0 and masked == num_tokens
    assert tokens == masked_first


@pytest.mark.parametrize("candidates", [0, 8])
def test_seeded_sampling_with_checks_reproduces_and_equals_masking_first(
        tiny_model_dir, llm, monkeypatch, candidates):
    """Seeded requests at temperature 1, with penalties and min_tokens: the same tokens run
    after run, with preemption and asynchronous scheduling or without, and the tokens of
    masking first (a refused row is drawn again with the noise of its first draw, or with
    PAGEDLLM_CHECK_CANDIDATES takes the best-ranked allowed token of its draw), forced text
    included (where llguidance's mask allows its canonical token alone)."""
    from pagedllm.worker import model_runner

    monkeypatch.setattr(model_runner, "CHECK_CANDIDATES", candidates)
    schema = SCHEMAS["person"]
    constraint = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=80, structured_outputs=constraint,
                             repetition_penalty=1.2 if i % 2 else 1.0,
                             presence_penalty=0.5 if i % 3 == 0 else 0.0, min_tokens=i)
              for i in range(8)]
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(8)]

    def run(engine, **extra):
        return [o.outputs[0] for o in engine.generate(
            prompts, [p.clone(**extra) for p in params], use_tqdm=False)]

    preempting = make_llm(tiny_model_dir, **ENGINE_SETUPS["preempting"])
    substituted = llm.llm_engine.engine_core.structured.num_substituted_rows
    checked = run(llm)
    tokens = [c.token_ids for c in checked]
    substituted = llm.llm_engine.engine_core.structured.num_substituted_rows - substituted
    assert (substituted > 0) == (candidates > 1)
    assert [c.token_ids for c in run(llm)] == tokens
    assert [c.token_ids for c in run(preempting)] == tokens
    assert preempting.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert [c.token_ids for c in run(llm, logprobs=0)] == tokens
    assert len(set(map(tuple, tokens))) == len(tokens)
    for completion in checked:
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize("setup", ["default", "async", "preempting", "async_chunked"])
def test_masks_filled_ahead_sample_the_masked_distribution(tiny_model_dir, hf_model,
                                                           greedy_expected, setup, monkeypatch):
    """PAGEDLLM_PREFETCH_MASKS=1: the next masks of a step's constrained rows are filled by
    a worker once its tokens are taken. With a step in flight (asynchronous scheduling)
    the rows are sampled under those masks, nothing checked; without one the masks feed
    the check, a refused row taking its mask from there. Either way seeded samples equal
    masking first (the reference's rows all ask logprobs, which masks them first), logprobs,
    penalties (which count the step in flight's tokens), ``n = 2`` and a stop string riding
    along, greedy outputs equal the reference, outputs keep their schema, and masks filled
    ahead are used."""
    monkeypatch.setenv("PAGEDLLM_PREFETCH_MASKS", "1")
    ahead = make_llm(tiny_model_dir, **ENGINE_SETUPS[setup])
    monkeypatch.setenv("PAGEDLLM_PREFETCH_MASKS", "0")
    masked_first = make_llm(tiny_model_dir, **ENGINE_SETUPS[setup])
    assert greedy_run(ahead)[0] == greedy_expected
    schema = SCHEMAS["person"]

    def params(reference: bool) -> list[SamplingParams]:
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=80,
                               structured_outputs=StructuredOutputsParams(json=schema),
                               logprobs=2 if i % 3 == 1 else (1 if reference else None),
                               presence_penalty=0.5 if i % 3 == 2 else 0.0,
                               n=2 if i % 4 == 3 else 1, stop=['"age"'] if i == 5 else None)
                for i in range(12)]

    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(12)]
    outputs = [[c for o in engine.generate(prompts, params(engine is masked_first),
                                           use_tqdm=False) for c in o.outputs]
               for engine in (ahead, masked_first)]
    assert len(outputs[0]) == 15
    assert any(o.stop_reason == '"age"' for o in outputs[0])  # the stop string cut one
    for output in outputs[0]:
        if output.finish_reason == "stop" and output.stop_reason is None:
            jsonschema.validate(json.loads(output.text), schema)
    deferred = ENGINE_SETUPS[setup].get("async_scheduling", False)
    structured = ahead.llm_engine.engine_core.structured
    assert (structured.num_checked_rows == 0) == deferred
    assert 0 < structured.prefetch.num_used <= structured.prefetch.num_filled
    assert masked_first.llm_engine.engine_core.structured.prefetch.num_filled == 0
    assert [o.token_ids for o in outputs[0]] == [o.token_ids for o in outputs[1]]
    assert sum(o.logprobs is not None for o in outputs[0]) == 5
    for first, second in zip(*outputs):
        for step_a, step_b in zip(first.logprobs or [], second.logprobs or []):
            assert step_a.keys() == step_b.keys()
            for token in step_a:
                assert step_a[token].logprob == pytest.approx(step_b[token].logprob, abs=1e-5)


def calls_of_a_schema_run(model_dir, monkeypatch, grammar_methods: list[str]) -> list[str]:
    """The forward passes (``_run_model``) and the named ``StepGrammars`` calls, in order, of
    six sampled requests of one JSON schema with asynchronous scheduling; every output
    validates against the schema."""
    from pagedllm.structured.manager import StepGrammars
    from pagedllm.worker.model_runner import ModelRunner

    events: list[str] = []
    for cls, name in [(ModelRunner, "_run_model"), *((StepGrammars, m) for m in grammar_methods)]:
        def recording(self, *args, __original=getattr(cls, name), __name=name, **kwargs):
            events.append(__name)
            return __original(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, recording)
    llm = make_llm(model_dir, async_scheduling=True)
    schema = SCHEMAS["person"]
    for completion in sample(llm, StructuredOutputsParams(json=schema), num=6):
        jsonschema.validate(json.loads(completion.text), schema)
    return events


def test_a_step_sampled_under_masks_ahead_may_be_launched_by_reading_its_output(
        tiny_model_dir, monkeypatch):
    """The last step of a run has no next launch to sample it: reading its output does,
    penalties (counted in place on the device) included."""
    monkeypatch.setenv("PAGEDLLM_PREFETCH_MASKS", "1")
    llm = make_llm(tiny_model_dir, async_scheduling=True)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=12, presence_penalty=0.5,
                            ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{1,40}"))
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and re.fullmatch("[a-z]*", out.text)


def test_rows_sampled_under_masks_ahead_launch_the_next_forward_pass_before_any_read(
        tiny_model_dir, monkeypatch):
    """With masks filled ahead and a step in flight, a step's constrained rows are sampled
    under their masks just before the next forward pass is launched, and its grammars take
    the tokens only after that launch (their next masks then fill while the device
    computes): no read of the ids stands between two forward passes. The outputs keep
    their schema."""
    monkeypatch.setenv("PAGEDLLM_PREFETCH_MASKS", "1")
    events = calls_of_a_schema_run(tiny_model_dir, monkeypatch,
                                   ["masks_ahead", "sampled", "check"])
    assert "check" not in events
    masks = [i for i, e in enumerate(events) if e == "masks_ahead"]
    taken = [i for i, e in enumerate(events) if e == "sampled"]
    assert len(masks) == len(taken) > 10
    for m, t in zip(masks, taken):
        assert m < t  # a step's tokens are taken after its sampling is launched
    # Each sampling is followed by the next forward pass before its tokens are read, but
    # for the last steps (nothing left to launch).
    followed = [events[m + 1] == "_run_model" and events[m + 2] == "sampled" for m in masks]
    assert sum(followed) >= len(masks) - 2, events


def test_a_check_lets_the_next_forward_pass_launch_before_its_redrawn_ids_are_read(
        tiny_model_dir, monkeypatch):
    """With asynchronous scheduling the forward pass after a check is launched as soon as
    the refused rows' draws under their masks are queued; their ids reach the host and the
    grammars (``redrawn``) after that launch, and the outputs still keep their schema."""
    events = calls_of_a_schema_run(tiny_model_dir, monkeypatch, ["check", "redrawn"])
    checks = [i for i, e in enumerate(events) if e == "check"]
    redraws = [i for i, e in enumerate(events) if e == "redrawn"]
    assert redraws, "random weights should have had tokens refused"
    for i in redraws:
        check = max(c for c in checks if c < i)
        launched = "_run_model" in events[check:i]
        assert launched or "_run_model" not in events[i:], events[check:i + 2]
    assert sum("_run_model" in events[max(c for c in checks if c < i):i] for i in redraws) > 1


def test_step_timer_counts_a_check_of_sampled_tokens_as_waiting(tiny_model_dir, monkeypatch) -> None:
    """With asynchronous scheduling a constrained step's tokens are read and checked before
    the next forward pass is launched (``AsyncStepOutput.settle``): the timer counts that
    as the step's wait, not as sampling, and puts the class back after."""
    from pagedllm.benchmarks.step_timing import StepTimer
    from pagedllm.structured.manager import StructuredOutputManager
    from pagedllm.worker.async_output import AsyncStepOutput

    check = StructuredOutputManager.check_tokens

    def slow_check(self, *args, **kwargs):
        time.sleep(0.02)
        return check(self, *args, **kwargs)

    monkeypatch.setattr(StructuredOutputManager, "check_tokens", slow_check)
    llm = make_llm(tiny_model_dir, async_scheduling=True)
    params = SamplingParams(max_tokens=6, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{1,40}"))
    methods = AsyncStepOutput.get, AsyncStepOutput.settle
    with StepTimer(llm) as timer:
        llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    decode = timer.summary()["decode"]
    assert decode["wait_ms"] >= 20 and decode["sample_ms"] < 20, decode
    assert (AsyncStepOutput.get, AsyncStepOutput.settle) == methods


def zeros(rows: int, words: int) -> np.ndarray:
    return np.zeros((rows, words), dtype=np.int32)


def prefetching_grammars(model_dir, regex: str, num: int):
    """(a manager filling masks ahead, ``num`` compiled grammars of ``regex`` it attached,
    token ids of "a", "b", "c" and "x")."""
    from pagedllm.engine.tokenizer import Tokenizer
    from pagedllm.structured.manager import StructuredOutputManager

    tokenizer = Tokenizer.from_pretrained(model_dir)
    manager = StructuredOutputManager(lambda: LLGuidanceBackend(tokenizer, VOCAB_SIZE),
                                      prefetch_masks=True)
    grammars = []
    for _ in range(num):
        request = SimpleNamespace(sampling_params=SamplingParams(
            structured_outputs=StructuredOutputsParams(regex=regex)))
        manager.attach(request)
        request.grammar.wait()
        assert request.grammar.ready
        grammars.append(request.grammar)
    letters = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "abcx")
    return manager, grammars, *letters


def prefetching_grammar(model_dir, regex: str):
    """``prefetching_grammars`` of one grammar."""
    manager, (grammar,), *letters = prefetching_grammars(model_dir, regex, 1)
    return manager, grammar, *letters


@pytest.mark.parametrize("budget_s, forms", [(60.0, 2), (0.0, 1)], ids=["cheap", "dear"])
def test_requests_of_one_constraint_take_its_independently_compiled_forms_in_turn(
        tiny_model_dir, monkeypatch, budget_s, forms):
    """A constraint is compiled at most ``forms_per_constraint`` times, on first need, and
    its requests take the forms in turn (grammars made from one llguidance matcher lex
    under one lock, so rows of one schema fill their masks in parallel only across forms);
    a constraint whose compile outlasts the budget gets fewer forms; each request's grammar
    is its own state."""
    from pagedllm.engine.tokenizer import Tokenizer
    from pagedllm.structured import manager as manager_module

    monkeypatch.setattr(manager_module, "COMPILE_BUDGET_S", budget_s)
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    compiled = []
    compile_one = LLGuidanceBackend.compile
    monkeypatch.setattr(LLGuidanceBackend, "compile", lambda self, params:
                        compiled.append(params.regex) or compile_one(self, params))
    manager = manager_module.StructuredOutputManager(
        lambda: LLGuidanceBackend(tokenizer, VOCAB_SIZE), forms_per_constraint=2)
    requests = [SimpleNamespace(sampling_params=SamplingParams(
        structured_outputs=StructuredOutputsParams(regex=regex)))
        for regex in ("[ab]+c", "[ab]+c", "x+", "[ab]+c", "[ab]+c")]
    for request in requests:
        manager.attach(request)
    for request in requests:
        request.grammar.wait()
    taken = [request.grammar._form() for request in requests]
    assert taken[0] is taken[3] and taken[1] is taken[4]
    assert (taken[0] is not taken[1]) == (forms == 2)
    assert sorted(compiled) == ["[ab]+c"] * forms + ["x+"]
    assert manager.num_forms == forms + 1
    a, b, c = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "abc")
    first, other, _, same_form, _ = (request.grammar for request in requests)
    first.accept_token(a)
    first.accept_token(c)
    assert first.is_terminated() and not same_form.is_terminated() and not other.is_terminated()
    assert same_form.allows(b) and not same_form.allows(c)
    manager.shutdown()


@pytest.mark.parametrize("cpu_max, env, threads", [
    ("max 100000", None, 32), ("400000 100000", None, 3), ("50000 100000", None, 1),
    (None, None, 32), ("400000 100000", "5", 5)])
def test_mask_fill_threads_keep_within_the_containers_cpu_limit(tmp_path, monkeypatch,
                                                                 cpu_max, env, threads):
    """The threads filling masks (and so the forms a constraint is compiled in) are 80% of
    the CPUs the process may use, up to 32, within a cgroup CPU quota (a container's
    limit), unless ``PAGEDLLM_GRAMMAR_FILL_THREADS`` says how many."""
    from pagedllm.structured import backend

    monkeypatch.setattr(backend.os, "sched_getaffinity", lambda pid: set(range(40)))
    limit = tmp_path / "cpu.max"
    if cpu_max is not None:
        limit.write_text(cpu_max + "\n")
    monkeypatch.setattr(backend, "CGROUP_CPU_MAX", limit)
    if env is None:
        monkeypatch.delenv(backend.FILL_THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(backend.FILL_THREADS_ENV, env)
    assert backend.fill_threads() == threads


def test_the_compile_cache_holds_a_bounded_number_of_forms(tiny_model_dir, monkeypatch):
    """The cache keeps ``COMPILE_CACHE_SIZE`` compiled forms in all, or two constraints'
    forms if that is more: the least recently used constraints go first, and come back
    compiled anew."""
    from pagedllm.engine.tokenizer import Tokenizer
    from pagedllm.structured import manager as manager_module

    monkeypatch.setattr(manager_module, "COMPILE_CACHE_SIZE", 3)
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    compiled = []
    compile_one = LLGuidanceBackend.compile
    monkeypatch.setattr(LLGuidanceBackend, "compile", lambda self, params:
                        compiled.append(params.regex) or compile_one(self, params))
    manager = manager_module.StructuredOutputManager(
        lambda: LLGuidanceBackend(tokenizer, VOCAB_SIZE), forms_per_constraint=2)

    def attach(regex: str) -> None:
        request = SimpleNamespace(sampling_params=SamplingParams(
            structured_outputs=StructuredOutputsParams(regex=regex)))
        manager.attach(request)
        request.grammar.wait()

    for regex in ("a+", "a+", "b+", "b+", "a+"):  # two constraints' forms are kept
        attach(regex)
    assert compiled == ["a+", "a+", "b+", "b+"]
    attach("c+")  # five forms: b+, the least recently used, goes
    attach("a+")
    assert compiled == ["a+", "a+", "b+", "b+", "c+"]
    attach("b+")
    assert compiled[-1] == "b+" and len(compiled) == 6
    manager.shutdown()


def test_the_rows_a_check_passes_take_their_tokens_in_one_call(tiny_model_dir, monkeypatch):
    """Once the step after a check is launched, every checked row's grammar takes its
    token (the sampled one it allowed, the redrawn one it refused) in one backend call;
    the scheduler's accepting the same tokens then changes nothing, and the states are
    those taking them one by one gives."""
    manager, grammars, a, b, c, x = prefetching_grammars(tiny_model_dir, "[ab]+c", 3)
    backend = manager.backend()
    calls = []
    accept_each = type(backend).accept_each
    monkeypatch.setattr(type(backend), "accept_each",
                        lambda self, pairs: calls.append(len(pairs)) or accept_each(self, pairs))
    refused, _, _ = manager.check_tokens(grammars, [a, x, b], zeros)  # "x" refused
    assert refused == [1]
    manager.note_redrawn([b])
    manager.take_checked()
    assert calls == [3]
    versions = [g.version for g in grammars]
    for grammar, token in zip(grammars, [a, b, b]):
        grammar.accept_token(token)  # the scheduler's turn: taken already
    assert [g.version for g in grammars] == versions and calls == [3]
    refused, _, _ = manager.check_tokens(grammars, [c, c, x], zeros)
    assert refused == [2]
    manager.note_redrawn([c])
    manager.take_checked()
    for grammar, token in zip(grammars, [c, c, c]):
        grammar.accept_token(token)
    assert all(g.is_terminated() and g.error is None for g in grammars)
    manager.shutdown()


def test_a_mask_filled_ahead_is_not_used_once_its_grammar_has_moved(tiny_model_dir):
    """A row filled ahead serves only its grammar in the state it was filled in."""
    manager, grammar, a, _, c, x = prefetching_grammar(tiny_model_dir, "[ab]+c")
    refused, mask, _ = manager.check_tokens([grammar], [c], zeros)  # "c" first: refused
    assert refused == [0]
    manager.take_checked()
    grammar.accept_token(a)  # the state moves on: the row filled ahead is stale
    refused, moved, _ = manager.check_tokens([grammar], [x], zeros)
    assert refused == [0]
    assert manager.prefetch.num_filled == 1 and manager.prefetch.num_used == 0
    fresh = np.zeros_like(moved)
    manager.fill_bitmask([grammar], fresh)
    assert np.array_equal(moved, fresh) and not np.array_equal(moved, mask)
    manager.shutdown()


def test_a_check_leaves_forced_text_to_the_mask(tiny_model_dir):
    """Where the grammar forces text, the mask allows only the first token of its canonical
    tokenization; the check refuses any other token that would fit (a shorter piece of
    the text), so the row is drawn again under its mask, as masking first would draw it."""
    manager, grammar, a, _, _, _ = prefetching_grammar(tiny_model_dir, "age[0-9]")
    refused, mask, _ = manager.check_tokens([grammar], [a], zeros)
    assert refused == [0]
    allowed = [t for t in range(VOCAB_SIZE) if (int(mask[0][t >> 5]) >> (t & 31)) & 1]
    assert len(allowed) == 1 and allowed != [a]
    assert grammar.grammar.num_allowed([a]) == 1  # a token that fits the text
    manager.shutdown()


def test_every_checked_row_has_its_next_mask_filled_ahead(tiny_model_dir):
    """Once the step after a check is launched, every row the check saw (allowed or
    refused) has its next mask filled ahead; at the next check rows are tested against
    those masks, and a row refused there takes its mask without a fill on the step loop:
    the mask its grammar gives."""
    manager, grammars, a, b, c, x = prefetching_grammars(tiny_model_dir, "[ab]+c", 3)
    refused, _, _ = manager.check_tokens(grammars, [a, x, b], zeros)  # "x" refused
    assert refused == [1]
    manager.note_redrawn([a])
    manager.take_checked()
    assert manager.prefetch.num_filled == 3
    filled_on_the_loop = manager.num_mask_rows
    refused, mask, _ = manager.check_tokens(grammars, [x, c, b], zeros)  # row 0 refused
    assert refused == [0] and manager.prefetch.num_used == 1
    assert manager.num_mask_rows == filled_on_the_loop
    fresh = zeros(*mask.shape)
    manager.fill_bitmask([grammars[0]], fresh)
    assert np.array_equal(mask, fresh)
    manager.shutdown()


@pytest.mark.parametrize("given", ["a", "b"])
def test_a_redrawn_token_taken_early_is_taken_once(tiny_model_dir, given):
    """Once the step after a check is launched, a refused row's grammar takes its redrawn
    token and its next mask is filled ahead; the scheduler's accepting the same token
    then changes nothing (another token replaces it, with an error logged)."""
    manager, grammar, a, b, c, _ = prefetching_grammar(tiny_model_dir, "[ab]c")
    refused, _, _ = manager.check_tokens([grammar], [c], zeros)
    assert refused == [0]
    manager.note_redrawn([a])
    manager.take_checked()  # "a" taken now, the next mask filled in the background
    assert manager.prefetch.num_filled == 1
    grammar.accept_token(a if given == "a" else b)  # the scheduler's turn
    assert grammar.error is None and not grammar.is_terminated()
    refused, _, _ = manager.check_tokens([grammar], [c], zeros)  # one letter taken, then "c"
    assert refused == [] and manager.prefetch.num_used == 0
    grammar.accept_token(c)
    assert grammar.is_terminated() and grammar.error is None
    manager.take_checked()  # nothing left: a no-op
    assert manager.prefetch.num_filled == 1
    manager.shutdown()


def test_a_constraint_failing_mid_output_aborts_its_request_alone(llm, monkeypatch):
    """A grammar that fails mid-output (a backend limit, as llguidance's lexer running out
    of room) ends its request as aborted with the error as its stop reason, never as a
    complete ``stop``; the other requests of the batch go on."""
    from pagedllm.structured.llguidance_backend import LLGuidanceGrammar

    taken = []
    accept = LLGuidanceGrammar.accept_tokens

    def failing(self, token_ids):
        taken.append(token_ids)
        if len(taken) == 5:
            return False  # as the backend answers once it has failed
        return accept(self, token_ids)

    monkeypatch.setattr(LLGuidanceGrammar, "accept_tokens", failing)
    params = [SamplingParams(temperature=1.0, max_tokens=40, seed=1,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS["person"])),
              SamplingParams(temperature=1.0, max_tokens=40, seed=2, ignore_eos=True)]
    prompts = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}]
    constrained, free = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert constrained.finish_reason == "abort" and len(constrained.token_ids) == 5
    assert constrained.stop_reason.startswith("The output constraint failed")
    assert free.finish_reason == "length" and len(free.token_ids) == 40


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "wat"}}}), "wat"),
    (dict(json={"type": "string", "not": {"pattern": "x.*y"}}), "not"),
    (dict(json={"$ref": "#/$defs/missing"}), "missing"),
    # Both names required, and exactly one of them present: nothing holds.
    (dict(json={"type": "object", "required": ["a", "b"],
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}), "nsatisfiable"),
    (dict(json={"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}],
                "x-guidance": {"coerce_one_of": False}}), "oneOf"),
    (dict(regex="(unclosed"), "unclosed"),
    (dict(grammar="start: ("), "grammar"),
])
def test_an_invalid_constraint_is_a_value_error_naming_the_problem(llm, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)),
                     use_tqdm=False)
    # The engine keeps serving.
    assert llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_two_constraints_in_one_request_are_refused():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs={})


def test_token_id_mode_refuses_structured_outputs(tiny_model_dir):
    llm = make_llm(tiny_model_dir, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([{"prompt_token_ids": [5, 6]}],
                     SamplingParams(structured_outputs={"regex": "a+"}), use_tqdm=False)


def test_a_slow_compile_stalls_only_its_own_request(tiny_model_dir):
    import threading

    llm = make_llm(tiny_model_dir)
    engine = llm.llm_engine
    core = engine.engine_core
    release = threading.Event()
    backend = core.structured.backend()
    compile_now = backend.compile

    def slow_compile(params):
        assert release.wait(30)
        return compile_now(params)

    backend.compile = slow_compile
    constraint = StructuredOutputsParams(regex="[a-c]{3}")
    engine.add_request("slow", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=constraint))
    engine.add_request("free", {"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    finished = {}
    while "free" not in finished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        assert core.get_stats().num_waiting_for_grammar == 1
    assert len(finished["free"].outputs[0].token_ids) == 5
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert re.fullmatch("[a-c]{3}", finished["slow"].outputs[0].text)
    assert core.get_stats().num_waiting_for_grammar == 0


def test_the_constraint_starts_after_the_reasoning_end_tokens(llm):
    free = llm.generate([{"prompt_token_ids": PROMPTS[1]}],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    end = free[1:3]  # stands for "</think>": the two tokens the model writes second and third
    constraint = StructuredOutputsParams(regex="[a-c]{2}", reasoning_end_token_ids=end)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}],
                       SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=constraint),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:3] == free[:3]  # free until the end of the "reasoning"
    tokenizer = llm.get_tokenizer()
    assert re.fullmatch("[a-c]{2}", tokenizer.decode(out.token_ids[3:]))
    assert out.finish_reason == "stop"


def test_a_refused_row_takes_its_draws_first_allowed_candidate(tiny_model_dir):
    """A row whose sampled token is refused takes the first later candidate of its draw
    that its grammar allows (-1 ends the ranking), reads the candidates once and only when
    some row without a mask filled ahead is refused, is not refused, gets no mask, and its
    grammar takes that token early; a row whose candidates are all refused is masked."""
    manager, grammars, a, b, c, x = prefetching_grammars(tiny_model_dir, "[ab]+c", 3)
    reads = []

    def candidates(ranked):
        return lambda: reads.append(1) or ranked

    refused, mask, taken = manager.check_tokens(grammars, [a, b, a], zeros,
                                                candidates([[a, x], [b, c], [a, c]]))
    assert (refused, mask, taken, reads) == ([], None, [], [])  # nothing refused, nothing read
    for grammar, token in zip(grammars, [a, b, a]):
        grammar.accept_token(token)  # the scheduler's turn, before any launch: no mask ahead
    refused, mask, taken = manager.check_tokens(
        grammars, [x, x, x], zeros, candidates([[x, b, a], [x, a], [x, -1, a]]))
    assert reads == [1] and taken == [(0, b), (1, a)] and refused == [2]
    assert mask is not None and len(mask) == 1
    assert manager.num_substituted_rows == 2 and manager.num_refused_rows == 1
    manager.note_redrawn([b])
    manager.take_checked()  # rows 0 and 1 take b and a; row 2 its redrawn b
    assert manager.prefetch.num_filled == 3  # every row's next mask
    versions = [g.version for g in grammars]
    for grammar, token in zip(grammars, [b, a, b]):
        grammar.accept_token(token)  # the scheduler's turn: taken already
        assert grammar.error is None
    assert [g.version for g in grammars] == versions
    manager.shutdown()


def test_masks_ahead_hand_over_the_fills_own_rows_when_the_step_keeps_their_order(
        tiny_model_dir):
    """``masks_ahead`` of a step whose rows are the fill's, in its order, returns the
    array the fill wrote (into ``take_sampled``'s ``allocate``), nothing allocated; rows in
    another order, or a row the fill did not cover, get a new array. Either way each row
    is its grammar's mask in its present state."""
    manager, grammars, a, b, c, x = prefetching_grammars(tiny_model_dir, "[ab]+c", 3)
    asked = []

    def allocate(rows: int, words: int) -> np.ndarray:
        asked.append(rows)
        return zeros(rows, words)

    def allowed(row: np.ndarray) -> set[int]:
        return {t for t in (a, b, c, x) if (int(row[t >> 5]) >> (t & 31)) & 1}

    manager.take_sampled(grammars, [a, b, a], allocate)
    assert asked == [3]
    filled = manager.prefetch._buffer
    block = manager.masks_ahead(grammars, allocate)
    assert np.shares_memory(block, filled) and asked == [3]
    assert [allowed(row) for row in block] == [{a, b, c}] * 3
    for grammar, token in zip(grammars, [a, b, a]):
        grammar.accept_token(token)  # the scheduler's turn: taken already
    manager.take_sampled(grammars, [c, a, b], allocate)
    late = grammars[1:]  # the first took "c": complete, its row not filled
    assert not grammars[0].active
    copied = manager.masks_ahead(late[::-1], allocate)
    assert asked == [3, 2, 2] and not np.shares_memory(copied, manager.prefetch._buffer)
    assert [allowed(row) for row in copied] == [{a, b, c}] * 2
    manager.shutdown()


def test_masks_filled_ahead_count_the_fill_its_start_and_the_wait_for_it():
    """``MaskPrefetch``'s counters: a fill's own time, the time until its worker took it up,
    and the time the step loop waited in ``settle`` for a fill still running (none for one
    already done)."""
    from pagedllm.structured.manager import MaskPrefetch

    prefetch = MaskPrefetch()
    grammar = SimpleNamespace(active=True, version=0, grammar=object())
    prefetch.start([grammar], lambda rows, out: time.sleep(0.05), 4)
    prefetch.settle()
    assert prefetch.seconds >= 0.05 and prefetch.wait_seconds >= 0.04
    assert 0 <= prefetch.start_delay < prefetch.wait_seconds
    waited, filled = prefetch.wait_seconds, prefetch.seconds
    prefetch.start([grammar], lambda rows, out: None, 4)
    time.sleep(0.05)  # the fill ends before the step loop asks for its rows
    prefetch.settle()
    assert prefetch.wait_seconds - waited < 0.02 and prefetch.seconds - filled < 0.02
    assert prefetch.num_filled == 2
    (slow, rows, slow_wait), (quick, _, quick_wait) = prefetch.fills  # one by one
    assert rows == 1 and slow >= 0.05 and slow_wait >= 0.04
    assert quick < 0.02 and quick_wait < 0.02
    prefetch.shutdown()

