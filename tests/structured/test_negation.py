"""The positive forms of ``not`` and ``if`` / ``then`` / ``else`` accept exactly what the
original schemas do, as ``jsonschema`` judges them over a corpus of values; the rewritten
schemas use no keyword llguidance refuses, and they compile; the schemas references name
are walked once."""

from __future__ import annotations

import copy
import itertools
import json
import re

import jsonschema
import pytest

from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.llguidance_backend import LLGuidanceBackend, grammar_text
from pagedllm.structured.json_schema import subschemas
from pagedllm.structured.negation import (MAX_ABSENT_CASES, conditionals_as_any_of, negation,
                                          pattern_complement)

STRINGS = ["", "a", "ab", "abc", "abd", "b", "ba", "x", "a\n", "ab\n", "-", "a-b", "a.b", "ä",
           "$", "^", "[", "\\", "kind", "line\nbreak"]
SCALARS = [*STRINGS, 0, 1, 2, 1.5, -3, 2.0, 1e9, True, False, None]
VALUES = [*SCALARS, [], [1, "a"], {}, {"kind": "a"}, {"kind": "b", "n": 1}, {"kind": 3},
          {"kind": None}, {"n": 2}, {"kind": "c", "n": "x"}, {"kind": "ab", "s": "x", "n": 0}]

NEGATABLE = [
    {"const": "a"},
    {"enum": ["a", "ab", "abc", ""]},
    {"enum": ["a-b", "a.b", "$", "^", "[", "\\", "ä", "line\nbreak"]},
    {"type": "string", "enum": ["a", "ab", 1]},
    {"enum": [1, 2.0, -3]},
    {"type": "integer", "const": 2},
    {"enum": [True, None]},
    {"enum": [False, 0, "x"]},
    {"properties": {"kind": {"const": "a"}}},
    {"properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"]},
    {"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "string"}}},
    {"anyOf": [{"const": "a"}, {"type": "number"}]},
    {"allOf": [{"properties": {"n": {"enum": [1, 2]}}}, {"required": ["n"]}]},
    {"minLength": 2},
    {"type": "string", "maxLength": 1},
    {"maxItems": 0},
    {"type": ["array", "null"], "minItems": 1},
    {"type": "number", "minLength": 3},
    {"not": {"properties": {"kind": {"const": None}}}},
    {"properties": {"kind": {"oneOf": [{"pattern": "^ab$"}]}}},
    {"properties": {"kind": {"maxLength": 1}}, "required": ["kind"]},
]


def valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


@pytest.mark.parametrize("schema", NEGATABLE, ids=lambda s: json.dumps(s)[:60])
def test_a_negation_holds_exactly_where_its_schema_does_not(schema):
    positive = negation(schema)
    assert positive is not None and "\"not\"" not in json.dumps(positive)
    for value in VALUES:
        assert valid(positive, value) != valid(schema, value), value
    LLGuidanceBackend.validate(StructuredOutputsParams(json={"not": schema}))


ALPHABET = ["a", "z", "Q", "5", " ", "\t", "\n", "-", ".", "$", "\\", "ä", "_", "(", ","]
PATTERN_STRINGS = ["".join(chars) for size in range(4)
                   for chars in itertools.product(ALPHABET, repeat=size)]
PATTERN_STRINGS += ["aaaa", "aaaaa", "  a  ", "5555", "a5a5a", "aa.aa", "zzz-zzz", "\n\n\n\n"]
# Patterns of one character class repeated (complemented), and others (left to the backend).
COMPLEMENTED = [r"^\s*$", r"^[a-z]+$", r"^[\.\,\*\\\-\s\{\}\(\)]+$", r"[^a-zA-Z0-9.,()@&' -]",
                r"(\$)", r"^[a-z]{2,3}$", r"^\d{2}", r"a{2}$", r"[a-z]{3}", r"^.*$", r"^a?$",
                r"\.", r"(?:[0-9])+", r"^[^\n]{0,2}$", r"x*", r"^(\S+)$", r"^\w{1,}?$", r"^-",
                r"^a5a$", r"^(a|aa|\$\.|a\|z)$", r"^(?:Q|z\\)$", r"^(a|az|5\.)", r"^a\.",
                r"^(?:z)", r"^[a|Q][z\s]", r"^(?:\d.[^a])", r"^."]
NOT_COMPLEMENTED = [r"ab", r"^a|b$", r"[a-z]+[0-9]", r"(a)(b)", r"^a{3,2}$", r"(a", r"\p{L}+"]


def searches(pattern: str, string: str) -> bool:
    """JSON Schema's (ECMA-262's) reading: a search, and ``$`` only at the very end (Python's
    also matches before a final newline)."""
    return re.search(re.sub(r"(?<!\\)\$$", r"\\Z", pattern), string) is not None


@pytest.mark.parametrize("pattern", COMPLEMENTED)
def test_a_pattern_complement_matches_exactly_the_strings_the_pattern_does_not(pattern):
    complement = pattern_complement(pattern)
    assert complement is not None
    for string in PATTERN_STRINGS:
        holds = complement is not False and re.fullmatch(complement, string) is not None
        assert holds != searches(pattern, string), (string, complement)
    if complement is not False:
        not_pattern = {"type": "string", "not": {"pattern": pattern}}
        LLGuidanceBackend.validate(StructuredOutputsParams(json=not_pattern))
    for schema in ({"pattern": pattern}, {"type": "string", "pattern": pattern}):
        positive = negation(schema)
        for value in [*STRINGS[:6], 1, None, ["a"], {"a": 1}]:
            assert valid(positive, value) != valid(schema, value), (schema, value)


@pytest.mark.parametrize("pattern", NOT_COMPLEMENTED)
def test_other_patterns_are_not_complemented(pattern):
    assert pattern_complement(pattern) is None


def test_a_lone_reference_negates_as_its_target():
    """``{"not": {"$ref": ...}}`` (Avro's "not a primitive type") and references inside a
    negated schema take their targets' negations."""
    defs = {"primitive": {"type": "string", "enum": ["a", "ab", "kind"]},
            "short": {"maxLength": 1, "description": "at most one"}}
    for negated in ({"$ref": "#/$defs/primitive"},
                    {"properties": {"kind": {"$ref": "#/$defs/short"}}}):
        root = {"$defs": defs, **negated}

        def resolve(schema):
            if isinstance(schema, dict) and "$ref" in schema:
                return defs[schema["$ref"].rsplit("/", 1)[1]]
            return schema
        positive = negation(negated, resolve=resolve)
        assert positive is not None and "$ref" not in json.dumps(positive)
        for value in VALUES:
            assert valid(positive, value) != valid(root, value), (negated, value)
        LLGuidanceBackend.validate(StructuredOutputsParams(json={"$defs": defs, "not": negated}))


def kinds(values):
    return [{"kind": v} for v in values]


SWITCH = {
    "type": "object", "required": ["kind"],
    "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}, "s": {"type": "string"}},
    "allOf": [
        {"if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]}},
        {"if": {"properties": {"kind": {"enum": ["b", "ab"]}}, "required": ["kind"]},
         "then": {"required": ["s"]}, "else": {"properties": {"s": {"maxLength": 0}}}},
        {"if": {"properties": {"kind": {"const": "c"}}},
         "then": {"properties": {"n": {"type": "string"}}}},
    ],
}
SWITCH_NOT_REQUIRED = {**copy.deepcopy(SWITCH), "required": []}
NODE_CONDITIONAL = {
    "type": "object",
    "properties": {"kind": {"enum": ["a", "b", 3]}, "n": {"type": "integer"}},
    "if": {"properties": {"kind": {"const": 3}}, "required": ["kind"]},
    "then": {"required": ["n"]}, "else": {"properties": {"n": {"maximum": 0}}},
}
LONE_CONDITIONALS = {
    "allOf": [{"if": {"required": ["s"]}, "then": {"required": ["n"]}},
              {"if": {"type": "string"}, "then": {"enum": ["a", "b", "ba"]},
               "else": {"not": {"type": "boolean"}}},
              # Prometheus' "if basic_auth is set (not null), bearer_token is not".
              {"if": {"not": {"properties": {"kind": {"const": None}}}},
               "then": {"properties": {"n": False}}}],
}
# Ansible's galaxy schema: an ``else`` without an ``if`` beside its switch (no effect).
ORPHAN_ELSE = {**copy.deepcopy(SWITCH), "else": {"required": ["s"]}}
CONDITIONALS = [SWITCH, SWITCH_NOT_REQUIRED, NODE_CONDITIONAL, LONE_CONDITIONALS, ORPHAN_ELSE]


def instances() -> list:
    """Objects of every combination of the corpus' ``kind``, ``n`` and ``s`` (absent too),
    and the scalars."""
    options = {"kind": ["a", "b", "ab", "c", "x", 3, None], "n": [0, 5, "t"], "s": ["", "x"]}
    objects = []
    for chosen in itertools.product(*[[None, *range(len(v))] for v in options.values()]):
        objects.append({name: options[name][i] for name, i in zip(options, chosen)
                        if i is not None})
    return [*objects, *SCALARS]


@pytest.mark.parametrize("schema", CONDITIONALS, ids=["switch", "switch-not-required",
                                                      "node", "lone", "orphan-else"])
def test_conditionals_in_positive_terms_accept_what_the_schema_accepts(schema):
    rewritten = copy.deepcopy(schema)
    nodes = [rewritten] + [m for m in rewritten.get("allOf", []) if isinstance(m, dict)]
    for node in nodes:
        conditionals_as_any_of(node)
    text = json.dumps(rewritten)
    assert '"if"' not in text and '"then"' not in text and '"else"' not in text
    for value in instances():
        assert valid(rewritten, value) == valid(schema, value), value
    LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))


def test_a_long_switch_on_a_property_not_required_generates_no_object_without_it():
    """Past ``MAX_ABSENT_CASES`` cases, an object without the switch's property would have
    to hold every ``then`` at once: the rewrite leaves it out, so what it accepts is a
    subset of what the schema accepts, which differs only there."""
    cases = [{"if": {"properties": {"kind": {"const": f"k{i}"}}},
              "then": {"properties": {"n": {"minimum": i}}}} for i in range(MAX_ABSENT_CASES + 1)]
    schema = {"type": "object", "properties": {"kind": {"type": "string"},
                                               "n": {"type": "integer"}}, "allOf": cases}
    rewritten = copy.deepcopy(schema)
    conditionals_as_any_of(rewritten)
    for value in [{"kind": f"k{i}", "n": n} for i in range(6) for n in (0, 3, 9)] + [{"n": 9}]:
        assert valid(rewritten, value) == (valid(schema, value) and "kind" in value), value


def test_conditionals_that_a_reference_passes_through_are_left_as_they_are():
    """A ``$ref`` into a ``then`` must still find it, so that schema is refused, naming
    ``if``, rather than served with a pointer that names nothing."""
    schema = {"type": "object", "properties": {"kind": {"type": "string"},
                                               "copy": {"$ref": "#/allOf/0/then"}},
              "allOf": [{"if": {"properties": {"kind": {"const": "a"}}},
                         "then": {"required": ["copy"]}}]}
    assert '"if"' in grammar_text(StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match='"if"'):
        LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))


def test_references_are_followed_once_however_many_name_a_schema(monkeypatch):
    """Schemas named by many references (each of 300 definitions names the root) are
    walked once, not once a reference: a schema's compile stays linear in its size."""
    from pagedllm.structured import llguidance_backend

    walked = []

    def counting(schema):
        for node in subschemas(schema):
            walked.append(node)
            yield node

    monkeypatch.setattr(llguidance_backend, "subschemas", counting)
    defs = {f"d{i}": {"type": "object", "properties": {
        "next": {"$ref": f"#/$defs/d{(i + 1) % 300}"}, "up": {"$ref": "#"}}} for i in range(300)}
    schema = {"$defs": defs, "type": "object", "properties": {"root": {"$ref": "#/$defs/d0"}}}
    grammar_text(StructuredOutputsParams(json=schema))
    assert len(walked) < 3 * len(list(subschemas(schema)))
