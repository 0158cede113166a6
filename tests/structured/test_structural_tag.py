"""vLLM's structural tags: free text, and JSON that follows its schema wherever a tag's
trigger starts it, then the tag's end; bad specs are refused with what is wrong."""

from __future__ import annotations

import json

import pytest

from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.llguidance_backend import LLGuidanceBackend
from tests.structured.conftest import grammar_of

TAG = {"triggers": ["<function="], "structures": [
    {"begin": "<function=f>", "end": "</function>",
     "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                "additionalProperties": False}},
    {"begin": "<function=g>", "end": "</function>", "schema": {"type": "object"}}]}


@pytest.mark.parametrize("spec", [TAG, json.dumps(TAG)])
def test_tagged_json_follows_its_schema_inside_free_text(manager, ids, spec):
    g = grammar_of(manager, StructuredOutputsParams(structural_tag=spec))
    free = "Sure, <b>f</b> then "
    call = '<function=f>{"a":12}</function>'
    assert g.num_allowed(ids(free + call + " and more text")) == len(free + call) + 14
    assert g.num_allowed(ids(free + '<function=f>{"a":"x"}')) == len(free) + 17  # not an int
    assert g.num_allowed(ids(free + "<function=h>")) == len(free) + 10  # no such structure
    assert g.num_allowed(ids('<function=f>{"a":1}x')) == 19  # the end tag must follow


@pytest.mark.parametrize("spec, message", [
    ({"structures": TAG["structures"]}, "triggers"),
    ({"triggers": ["<function="], "structures": []}, "structures"),
    ({"triggers": ["<tool>"], "structures": TAG["structures"]}, "none of the triggers"),
    ({"triggers": ["<function="], "structures": [{"begin": "<function=f>", "end": ""}]},
     "schema"),
    ("not json", "not valid JSON"),
])
def test_bad_structural_tags_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        LLGuidanceBackend.validate(StructuredOutputsParams(structural_tag=spec))
