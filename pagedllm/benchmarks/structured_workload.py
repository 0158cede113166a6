"""The JSON schemas of ``--structured-output json``: extraction shapes that never end.

Each schema is an object holding an array of at least ``MIN_RECORDS`` records (people,
order lines, log events, products), so a constrained request writes records until its
output length, like an unconstrained one: the two runs generate the same number of
tokens, and the difference in throughput is what the constraint costs. Request ``i``
takes schema ``i % 4``.
"""

from __future__ import annotations

from pagedllm.structured import StructuredOutputsParams

# More records than any output length can hold: the constraint never completes early.
MIN_RECORDS = 1_000_000

_PERSON = {"type": "object", "additionalProperties": False,
           "required": ["name", "age", "email", "roles"],
           "properties": {"name": {"type": "string", "maxLength": 40},
                          "age": {"type": "integer", "minimum": 0, "maximum": 150},
                          "email": {"type": "string", "format": "email"},
                          "roles": {"type": "array", "maxItems": 4,
                                    "items": {"enum": ["admin", "editor", "viewer"]}}}}
_ORDER_LINE = {"type": "object", "additionalProperties": False,
               "required": ["sku", "quantity", "price", "currency"],
               "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                              "quantity": {"type": "integer", "minimum": 1},
                              "price": {"type": "number", "minimum": 0},
                              "currency": {"enum": ["USD", "EUR", "JPY"]},
                              "note": {"type": ["string", "null"], "maxLength": 80}}}
_LOG_EVENT = {"type": "object", "additionalProperties": False,
              "required": ["time", "level", "message"],
              "properties": {"time": {"type": "string", "format": "date-time"},
                             "level": {"enum": ["debug", "info", "warning", "error"]},
                             "message": {"type": "string", "maxLength": 200},
                             "fields": {"type": "object",
                                        "additionalProperties": {"type": ["string", "number"]}}}}
_PRODUCT = {"$defs": {"dimension": {"type": "object", "additionalProperties": False,
                                    "required": ["value", "unit"],
                                    "properties": {"value": {"type": "number"},
                                                   "unit": {"enum": ["cm", "in"]}}}},
            "type": "object", "additionalProperties": False,
            "required": ["title", "tags", "size"],
            "properties": {"title": {"type": "string"},
                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}},
                           "size": {"anyOf": [{"$ref": "#/$defs/dimension"}, {"type": "null"}]}}}


def _records(record: dict) -> dict:
    """An object with a ``records`` array of ``MIN_RECORDS`` or more; the record's ``$defs``
    at the root."""
    record = dict(record)
    defs = record.pop("$defs", None)
    schema = {"type": "object", "additionalProperties": False, "required": ["records"],
              "properties": {"records": {"type": "array", "items": record,
                                         "minItems": MIN_RECORDS}}}
    return {"$defs": defs, **schema} if defs else schema


SCHEMAS = {name: _records(record) for name, record in (
    ("people", _PERSON), ("order_lines", _ORDER_LINE), ("log_events", _LOG_EVENT),
    ("products", _PRODUCT))}


def constraint_for(index: int) -> StructuredOutputsParams:
    """The constraint of request ``index``."""
    schemas = list(SCHEMAS.values())
    return StructuredOutputsParams(json=schemas[index % len(schemas)])
