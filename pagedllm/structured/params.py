"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list
of strings, or a grammar. Pure Python (the core imports it through ``SamplingParams``).

Exactly one constraint per request. The constraint is compiled by the engine's grammar
backend (``pagedllm.structured.backend``); ``key`` identifies equal constraints, so their
compiled grammar is shared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The constraint kinds, in the order a request's fields are checked.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's ``StructuredOutputsParams`` fields).

    - ``json``: a JSON schema (a dict or its JSON text); the output is one JSON value that
      validates against it.
    - ``json_object``: the output is one JSON object, any keys.
    - ``regex``: the output fully matches this regular expression (Rust ``regex`` syntax,
      which is Python's for everything but look-around and back-references).
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: a context-free grammar, in Lark syntax (``start: ...``) or GBNF / EBNF
      (``root ::= ...``).
    - ``structural_tag`` (vLLM's, a dict or its JSON text): free text in which each of
      ``structures`` (``{"begin", "schema", "end"}``) that the text starts, by one of
      ``triggers`` (a prefix of its ``begin``), continues with JSON valid against its
      schema and then its ``end``: tool calls inside running text.
    - ``disable_any_whitespace`` (JSON kinds): True (the default) generates JSON without
      free whitespace between tokens (``{"a":1}``); False lets the model place whitespace
      and newlines freely, which small models can fill without end.
    - ``whitespace_pattern`` (JSON kinds): a regex the whitespace between a JSON value's
      tokens must match instead (``"[ ]"``: one space; ``"\\n *"``: a newline and an indent);
      it overrides ``disable_any_whitespace``.
    - ``reasoning_end_token_ids`` (set by the server, not a user field): the constraint
      starts after the output has produced this token sequence (the end of a reasoning
      block such as ``</think>``); before it, the output is free.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = True
    whitespace_pattern: str | None = None
    reasoning_end_token_ids: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its "
                             f"JSON text), got {type(self.json).__name__}.")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if isinstance(self.structural_tag, str):
            try:
                self.structural_tag = json.loads(self.structural_tag)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {exc}") from None
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise ValueError("structured_outputs.structural_tag must be an object with "
                             "structures and triggers (or its JSON text).")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string.")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings.")
            self.choice = list(self.choice)
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a regex string.")
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar and structural_tag; got {', '.join(kinds) if kinds else 'none'}."
            )

    @property
    def kinds(self) -> list[str]:
        """The constraint fields that are set."""
        return [kind for kind in KINDS
                if (getattr(self, kind) is not None and getattr(self, kind) is not False)]

    @property
    def kind(self) -> str:
        return self.kinds[0]

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's JSON, the regex, the choices' JSON list."""
        value = getattr(self, self.kind)
        if self.kind == "json_object":
            return '{"type": "object"}'
        if isinstance(value, (dict, list)):
            return json.dumps(value, ensure_ascii=False)  # key order is output order
        return value

    @property
    def key(self) -> tuple:
        """Equal keys compile to the same grammar."""
        return (self.kind, self.spec, self.disable_any_whitespace, self.whitespace_pattern)
