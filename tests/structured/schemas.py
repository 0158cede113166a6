"""JSON schemas of the kinds real extraction and agent requests send, bounded so that random
models finish them well within the tests' ``max_tokens`` (lengths, item counts, ranges)."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}

NESTED_WITH_REFS = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                           "y": {"type": "integer", "minimum": -99, "maximum": 99}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "start": {"$ref": "#/$defs/point"},
        "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
        "closed": {"type": "boolean"},
    },
    "required": ["start", "path", "closed"],
    "additionalProperties": False,
}

ANY_OF = {
    "type": "object",
    "properties": {
        "result": {
            "anyOf": [
                {"type": "object", "properties": {"ok": {"const": True},
                                                  "value": {"type": "number", "minimum": 0, "maximum": 10}},
                 "required": ["ok", "value"], "additionalProperties": False},
                {"type": "object", "properties": {"ok": {"const": False},
                                                  "error": {"type": "string", "maxLength": 10}},
                 "required": ["ok", "error"], "additionalProperties": False},
            ],
        },
        "unit": {"type": ["string", "null"], "enum": ["cm", "in", None]},
    },
    "required": ["result", "unit"],
    "additionalProperties": False,
}

SCHEMAS = {"person": PERSON, "nested_with_refs": NESTED_WITH_REFS, "any_of": ANY_OF}
