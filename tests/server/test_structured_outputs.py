"""Output constraints over HTTP, through the official openai client: OpenAI's
``response_format`` and vLLM's ``guided_*`` / ``structured_outputs`` fields, on both
endpoints, and the 400s for constraints that cannot compile (the server keeps serving)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL_NAME
from tests.structured.schemas import SCHEMAS

MESSAGES = [{"role": "user", "content": "Describe a person."}]


def chat(client, **kw):
    kw.setdefault("max_tokens", 160)
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0,
                                          **kw)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_json_schema_validates(client, name):
    schema = SCHEMAS[name]
    response = chat(client, n=4, seed=3, response_format={
        "type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_response_format_json_object_streams_one_object(client):
    stream = chat(client, seed=5, max_tokens=300, stream=True,
                  response_format={"type": "json_object"})
    text, finish = "", None
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length" and text.startswith("{")


@pytest.mark.parametrize("body, check", [
    ({"guided_regex": r"[a-z]{2,5}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", t)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in {"red", "green", "blue"}),
    ({"guided_json": SCHEMAS["person"]},
     lambda t: jsonschema.validate(json.loads(t), SCHEMAS["person"]) is None),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in {"yes", "no"}),
    ({"structured_outputs": {"regex": r"(ab)+c"}}, lambda t: re.fullmatch(r"(ab)+c", t)),
    ({"structured_outputs": {"choice": ["x", "y"]}}, lambda t: t in {"x", "y"}),
])
def test_vllm_fields_constrain_completions_and_chat(client, body, check):
    completion = client.completions.create(model=MODEL_NAME, prompt="Answer: ", max_tokens=160,
                                           temperature=1.0, n=3, seed=1, extra_body=body)
    replies = chat(client, n=3, seed=2, extra_body=body)
    texts = [c.text for c in completion.choices] + [c.message.content for c in replies.choices]
    for text in texts:
        assert check(text), text


def test_whitespace_pattern_shapes_the_json_between_its_tokens(client):
    """vLLM's guided_whitespace_pattern / structured_outputs.whitespace_pattern: the
    whitespace the JSON may hold between its tokens ("[ ]": a single space, or none), where
    the default allows none. The schema holds no strings, so all whitespace is between
    tokens."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    compact = chat(client, n=4, seed=6, extra_body={"guided_json": schema})
    assert all(not re.search(r"\s", c.message.content) for c in compact.choices)
    for body in ({"guided_json": schema, "guided_whitespace_pattern": "[ ]"},
                 {"structured_outputs": {"json": schema, "whitespace_pattern": "[ ]"}}):
        texts = [c.message.content for c in chat(client, n=4, seed=6, extra_body=body).choices]
        for text in texts:
            assert json.loads(text).keys() == {"a", "b"}
            assert not re.search(r"[^\S ]| {2}", text), text  # single spaces only
        assert any(" " in text for text in texts), texts


def test_structural_tag_is_served_in_both_request_forms(client):
    """A structural tag over HTTP, as response_format (the form vLLM documents) and as
    structured_outputs.structural_tag (JSON text): free text the model writes until a
    trigger (the grammar itself is tested in tests/structured/test_structural_tag.py)."""
    tag = {"triggers": ["<function="], "structures": [
        {"begin": "<function=f>", "end": "</function>", "schema": SCHEMAS["person"]}]}
    for kw in ({"response_format": {"type": "structural_tag", **tag}},
               {"extra_body": {"structured_outputs": {"structural_tag": json.dumps(tag)}}}):
        [choice] = chat(client, seed=7, max_tokens=12, **kw).choices
        assert choice.finish_reason in ("length", "stop") and choice.message.content


def test_completions_take_response_format_too(client):
    completion = client.completions.create(
        model=MODEL_NAME, prompt="{", max_tokens=160, temperature=1.0, seed=4,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": SCHEMAS["nested_with_refs"]}}})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS["nested_with_refs"])


@pytest.mark.parametrize("body, param, message", [
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "wat"}}}}, "guided_json", "wat"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed"),
    ({"guided_grammar": "start: ("}, "guided_grammar", "grammar"),
    ({"guided_json": {"type": "string", "not": {"pattern": "a.*b"}}}, "guided_json", "not"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "one output constraint"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<t>"], "structures": [
        {"begin": "<f>", "schema": {}, "end": "</f>"}]}}, "response_format", "triggers"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend",
     "outlines"),
    ({"logits_processors": ["x"]}, "logits_processors", "logits_processors"),
    ({"use_beam_search": True}, "use_beam_search", "beam search"),
    ({"guided_whitespace_pattern": "[ ]"}, "guided_whitespace_pattern", "JSON constraint"),
    ({"guided_regex": "a+", "guided_whitespace_pattern": "[ ]"}, "guided_whitespace_pattern",
     "JSON constraint"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "(unclosed"},
     "guided_json", "unclosed"),
])
def test_bad_constraints_are_400s_and_the_server_keeps_serving(client, body, param, message):
    for call in (lambda: chat(client, max_tokens=4, extra_body=body),
                 lambda: client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4,
                                                   extra_body=body)):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        error = info.value.body
        assert error["param"] == param and message in error["message"]
    assert chat(client, max_tokens=2).choices[0].finish_reason == "length"


def test_safe_openai_fields_are_accepted(client):
    reply = chat(client, max_tokens=2, user="u1", metadata={"k": "v"}, store=False)
    assert reply.choices[0].message.content is not None
