"""A request's output constraint, from whichever field the client used to send it.

The forms clients send, each mapped to one ``StructuredOutputsParams``:

| request field | constraint |
| --- | --- |
| ``response_format: {"type": "json_object"}`` | any JSON object |
| ``response_format: {"type": "structural_tag", "structures": [...], "triggers": [...]}`` (vLLM) | free text whose tagged parts follow their schemas |
| ``response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` | the schema (no schema: any JSON object) |
| ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (vLLM) | schema / regex / choice / grammar |
| ``structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}`` (vLLM) | the same, plus ``disable_any_whitespace`` and ``whitespace_pattern`` |

``guided_whitespace_pattern`` (vLLM) sets ``whitespace_pattern`` of whichever form carries a
JSON constraint.

At most one form per request; a constraint the grammar compiler refuses is a 400 naming
the field, with the compiler's message. ``response_format: {"type": "text"}`` is no
constraint. ``strict`` is accepted either way: a schema is always enforced.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import OpenAIError, SamplingFields
from pagedllm.structured import StructuredOutputsParams

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "choice", "grammar", "json_object",
                            "structural_tag", "disable_any_whitespace", "whitespace_pattern"}
# Backend names a request may give in guided_decoding_backend: all mean the one built in.
_BACKEND_NAMES = {None, "auto", "guidance", "llguidance"}


def requested_constraint(request: SamplingFields) -> tuple[str, dict[str, Any]] | None:
    """(the field that carries it, ``StructuredOutputsParams`` keywords), or None."""
    forms: list[tuple[str, dict[str, Any]]] = []
    if request.response_format is not None:
        form = _response_format(request.response_format)
        if form is not None:
            forms.append(("response_format", form))
    for name, kind in _GUIDED_FIELDS.items():
        if getattr(request, name) is not None:
            forms.append((name, {kind: getattr(request, name)}))
    if request.structured_outputs is not None:
        unknown = sorted(set(request.structured_outputs) - _STRUCTURED_OUTPUTS_KEYS)
        if unknown:
            raise OpenAIError(
                f"structured_outputs.{unknown[0]} is not supported by this server; it takes "
                f"{', '.join(sorted(_STRUCTURED_OUTPUTS_KEYS))}.", param="structured_outputs")
        forms.append(("structured_outputs", dict(request.structured_outputs)))
    if request.guided_decoding_backend not in _BACKEND_NAMES:
        raise OpenAIError(
            f"guided_decoding_backend {request.guided_decoding_backend!r} is not available: this "
            "server constrains outputs with llguidance; remove guided_decoding_backend.",
            param="guided_decoding_backend")
    if len(forms) > 1:
        names = " and ".join(name for name, _ in forms)
        raise OpenAIError(f"A request takes one output constraint, but {names} are both set: "
                          "keep one.", param=forms[1][0])
    if request.guided_whitespace_pattern is not None:
        if not forms or not ({"json", "json_object"} & set(forms[0][1])):
            raise OpenAIError("guided_whitespace_pattern shapes JSON output: send it with a "
                              "JSON constraint (guided_json, response_format, ...), or remove it.",
                              param="guided_whitespace_pattern")
        forms[0][1]["whitespace_pattern"] = request.guided_whitespace_pattern
    return forms[0] if forms else None


def constraint_params(field: str, kwargs: dict[str, Any]) -> StructuredOutputsParams:
    """The checked ``StructuredOutputsParams``; a 400 on ``field`` when it cannot compile."""
    from pagedllm.structured.llguidance_backend import LLGuidanceBackend

    try:
        params = StructuredOutputsParams(**kwargs)
        LLGuidanceBackend.validate(params)
    except (ValueError, TypeError) as exc:
        raise OpenAIError(f"Invalid {field}: {exc}", param=field) from None
    return params


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise OpenAIError("response_format of type json_schema needs a json_schema object "
                              '({"name": ..., "schema": {...}}).', param="response_format")
        schema = spec.get("schema")
        if schema is None:
            return {"json_object": True}
        if not isinstance(schema, dict):
            raise OpenAIError("response_format.json_schema.schema must be a JSON schema object.",
                              param="response_format")
        return {"json": schema}
    if kind == "structural_tag":
        return {"structural_tag": {key: fmt.get(key) for key in ("structures", "triggers")}}
    raise OpenAIError(
        f"response_format of type {kind!r} is not supported: use 'text', 'json_object', "
        "'json_schema' or 'structural_tag'.", param="response_format")
