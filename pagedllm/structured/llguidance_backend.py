"""The llguidance grammar backend: JSON schemas, regexes, choices and Lark / GBNF grammars.

llguidance compiles lazily (a constraint costs little until a token mask is asked for),
computes masks in Rust threads without the GIL, and can roll tokens back. Constraints map
to its grammar text as follows:

- ``json`` / ``json_object``: ``grammar_from_json_schema``; ``x-guidance`` keys in the
  schema override the defaults (``whitespace_pattern``, else ``whitespace_flexible`` from
  ``disable_any_whitespace``); a ``oneOf`` is made exact where it can be
  (``_one_of_exact``), else taken as ``anyOf`` (``coerce_one_of``); a ``not`` whose
  negation is known in positive terms becomes it, and so does ``if`` / ``then`` /
  ``else`` (``negation.py``); keywords llguidance does not implement (any other ``not`` or
  ``if``, ``uniqueItems``, ``contains``, a ``propertyNames`` that ``property_names.py``
  cannot say as properties) are refused at validation with its message (which names the
  schema's ``lenient`` setting), and so is a ``$ref`` outside the schema (nothing is
  ever fetched); a ``format`` it does not know
  is an annotation and left out (the standard's default); a lookahead at a pattern's
  start or end becomes patterns without one (``lookahead.py``); patterns of literal names
  and patterns every name matches are told apart from the others
  (``pattern_properties.py``); a ``type`` beside a composition that implies it is left
  out (``implied_types.py``), and keywords beside a composition of schemas that reference
  themselves are merged into them (``intersection.py``); dependencies between
  properties are rewritten as ``anyOf`` (``_dependencies_as_any_of``); an object schema
  that lists its ``properties`` and says nothing of other names allows none
  (``_close_object``);
- ``regex``: ``grammar_from_regex`` (the whole output matches);
- ``choice``: a Lark rule with one string literal per choice;
- ``grammar``: Lark as is, GBNF / EBNF (``::=``) converted to Lark first;
- ``structural_tag``: llguidance's ``StructTag`` grammar, one tag a structure, triggered by
  the first of ``triggers`` its ``begin`` starts with (vLLM's mapping).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np
from llguidance import LLMatcher

from pagedllm.engine.tokenizer import Tokenizer
from pagedllm.structured.backend import Grammar, GrammarBackend, fill_threads, fills_by_rows
from pagedllm.structured.implied_types import drop_implied_type
from pagedllm.structured.intersection import compositions_merged, reaches_a_cycle
from pagedllm.structured.json_schema import (pointer_walk, ref_siblings_ignored, resource_id,
                                             subschemas)
from pagedllm.structured.lookahead import lookaheads_as_patterns
from pagedllm.structured.negation import (ANNOTATIONS, conditionals_as_any_of, names,
                                          not_in_positive_terms)
from pagedllm.structured.params import StructuredOutputsParams
from pagedllm.structured.pattern_properties import overlapping_patterns_apart
from pagedllm.structured.property_names import (property_counts_as_presence,
                                                property_names_as_properties)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``params``; ValueError for a malformed constraint."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = json.loads(params.spec)
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema object.")
        nodes = list(subschemas(schema))
        if _drop_ref_siblings(nodes, schema):
            nodes = list(subschemas(schema))
        for node in nodes:
            if node is not schema:
                node.pop("$schema", None)  # beside an $id llguidance loses the pointers into it
        named, pinned = _named_by_refs(nodes, _resources(schema, nodes))
        nodes += named
        own_ids = {resource_id(node) for node in nodes} - {None}
        resources = _resources(schema, nodes)
        parts = _composed_parts(nodes, resources)
        # Each pass reads the schema objects as the one before left them all: closed
        # objects decide whether a oneOf can hold the empty object, and the oneOf pass
        # reads its branches before the last pass rewrites them.
        for node in nodes:
            _check_local_ref(node, own_ids)
            _drop_properties_their_patterns_repeat(node, pinned)
            _drop_unknown_format(node)
            _drop_unique_items_that_hold(node)
            lookaheads_as_patterns(node)
            if id(node) not in parts:
                _close_object(node)
        for node in nodes:
            _one_of_exact(node, resources)
        resolve = functools.partial(_referenced, resources=resources)
        follow = functools.partial(_ref_targets, resources)
        recursive = reaches_a_cycle(follow)
        for node in nodes:
            _dependencies_as_any_of(node)
            conditionals_as_any_of(node, pinned, resolve)
            overlapping_patterns_apart(node, pinned)
            property_names_as_properties(node, resolve)
            property_counts_as_presence(node)
            not_in_positive_terms(node, resolve)
            drop_implied_type(node, follow, pinned)
        if len({id(resource) for resource in resources.values()}) == 1:
            define = functools.partial(_define, schema)
            walked = {id(node) for node in nodes}  # and the schemas the passes wrote
            for node in nodes + [n for n in subschemas(schema) if id(n) not in walked]:
                compositions_merged(node, follow, recursive, pinned, define)
        options: dict[str, Any] = {"coerce_one_of": True}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        else:
            options["whitespace_flexible"] = not params.disable_any_whitespace
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", params.choice)
    if kind == "structural_tag":
        return _structural_tag_grammar(params.structural_tag)
    return llguidance.grammar_from("grammar", params.grammar)


def _define(root: Any, schema: dict) -> str:
    """Add ``schema`` to ``root``'s definitions (``$defs``, or ``definitions`` where the root
    keeps those) under a name no other takes; the reference to it."""
    if not isinstance(root, dict):
        raise ValueError("a definition needs a schema object at the root")
    key = "definitions" if "definitions" in root and "$defs" not in root else "$defs"
    definitions = root.setdefault(key, {})
    name = f"merged-{len(definitions)}"
    while name in definitions:
        name += "-"
    definitions[name] = schema
    return f"#/{key}/{name}"


def _structural_tag_grammar(spec: dict[str, Any]) -> str:
    """The grammar of a structural tag ``{"structures": [{"begin", "schema", "end"}, ...],
    "triggers": [...]}``; ValueError naming what is missing or wrong."""
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag.triggers must be a list of non-empty strings.")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list of "
                         '{"begin", "schema", "end"} objects.')
    tags = []
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict) or not isinstance(structure.get("begin"), str) \
                or not isinstance(structure.get("end"), str) \
                or not isinstance(structure.get("schema"), (dict, bool)):
            raise ValueError(f"structural_tag.structures[{i}] must have a string begin and end "
                             "and a JSON schema object as schema.")
        begin = structure["begin"]
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structural_tag.structures[{i}].begin {begin!r} starts with none "
                             f"of the triggers {triggers}.")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin,
                                         grammar=structure["schema"], end=structure["end"]))
    return llguidance.StructTag.to_grammar(tags)


def _check_local_ref(node: dict, own_ids: set[str]) -> None:
    """References must point inside the schema: ``#...``, or a URI one of its own schema
    objects names itself by (``own_ids``). Nothing is fetched."""
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#") and ref.split("#", 1)[0] not in own_ids:
        raise ValueError(f"$ref {ref!r} points outside the schema: only references "
                         "inside it (#/$defs/..., or its own $id) are followed, nothing "
                         "is fetched.")


# What stays beside a ``$ref`` whose siblings the draft ignores: the places other
# references may point into, the resource's name and draft (a tool's parameters are a
# resource of their own, whatever their draft), and annotations.
_KEPT_BESIDE_REF = {"$ref", "$schema", "$id", "id", "definitions", "$defs"} | ANNOTATIONS


def _drop_ref_siblings(nodes: list[dict], root: Any) -> bool:
    """In each resource (the root, or a schema object with ``$id``: a tool's parameters)
    whose ``$schema`` names drafts 3-7 (``ref_siblings_ignored``), the keywords beside each
    ``$ref`` (``type``, ``properties``, ...) are left out, as those drafts' validators
    ignore them (llguidance would intersect them with the reference, and refuses that on a
    circular one); but not those a reference's pointer passes through. Whether any was
    left out."""
    legacy = [node for node in nodes if (node is root or resource_id(node) is not None)
              and ref_siblings_ignored(node)]
    if not legacy:
        return False
    resources = _resources(root, nodes)
    _, pinned = _named_by_refs(nodes, resources)
    dropped = False
    for resource in legacy:
        inner = list(subschemas(resource))
        for node in inner + _named_by_refs(inner, resources)[0]:
            if isinstance(node.get("$ref"), str):
                for key in [key for key in node if key not in _KEPT_BESIDE_REF
                            and (id(node), key) not in pinned]:
                    del node[key]
                    dropped = True
    return dropped


def _drop_unknown_format(node: dict) -> None:
    """A ``format`` llguidance does not check (``int32``, ``uri-reference``, ``color``, ...)
    is left out: JSON Schema makes ``format`` an annotation that validators need not know,
    so the value is generated as its type allows."""
    name = node.get("format")
    if isinstance(name, str) and not _known_format(name):
        del node["format"]


def _drop_unique_items_that_hold(node: dict) -> None:
    """``uniqueItems`` is left out where every array holds it: ``false``, or at most one
    item (``maxItems`` 0 or 1). Elsewhere llguidance cannot enforce it and refuses it."""
    unique = node.get("uniqueItems")
    if unique is False or (unique is True and isinstance(node.get("maxItems"), int)
                           and node["maxItems"] <= 1):
        del node["uniqueItems"]


def _drop_properties_their_patterns_repeat(node: dict, pinned: set[tuple[int, str]]) -> None:
    """A property that also matches a ``patternProperties`` pattern must hold both schemas;
    where its own says nothing beyond that pattern's (equal but for annotations), its own is
    left with its annotations alone: llguidance intersects the two, and refuses that where
    they reference themselves (Washington Post's ANS schemas: ``by`` beside
    ``^[a-zA-Z0-9_]*``). Not a property a reference's pointer passes through, nor one the
    pattern may not match (a pattern Python's ``re`` cannot compile is left alone)."""
    properties, patterns = node.get("properties"), node.get("patternProperties")
    if not isinstance(properties, dict) or not isinstance(patterns, dict):
        return
    compiled = []
    for pattern, schema in patterns.items():
        try:
            compiled.append((re.compile(pattern), _without_annotations(schema)))
        except re.error:
            return
    for name, schema in properties.items():
        if not isinstance(schema, dict) or (id(properties), name) in pinned:
            continue
        own = _without_annotations(schema)
        if own and any(regex.search(name) and own == theirs for regex, theirs in compiled):
            properties[name] = {k: v for k, v in schema.items() if k in ANNOTATIONS}


def _without_annotations(schema: Any) -> Any:
    return {k: v for k, v in schema.items() if k not in ANNOTATIONS} \
        if isinstance(schema, dict) else schema


# Keywords that let an object have names beyond its ``properties``, or combine it with other
# schemas that may name them.
_OPEN_OBJECT_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties",
                         "allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas",
                         "dependencies")


def _close_object(node: dict) -> None:
    """An object schema that lists its ``properties`` and says nothing of other names allows
    none (``additionalProperties: false``), as vLLM's default backend (xgrammar's strict
    mode) and OpenAI's strict schemas do: Pydantic's schemas, which langchain and
    instructor send, say nothing of them, and a grammar that lets a model invent keys lets
    it write them without end. ``additionalProperties: true`` keeps them allowed. A schema
    combined with others (``_composed_parts``, or one combining others) is left as is:
    closing it could forbid names the others declare."""
    properties = node.get("properties")
    if not isinstance(properties, dict) or any(key in node for key in _OPEN_OBJECT_KEYWORDS):
        return
    required = node.get("required")
    if isinstance(required, list) and not set(required) <= set(properties):
        return  # names it requires beyond its properties must stay allowed
    if isinstance(node.get("minProperties"), int) and node["minProperties"] > len(properties):
        return
    node["additionalProperties"] = False


def _resources(root: Any, nodes: list[dict]) -> dict[str, Any]:
    """The schema's resources by URI: ``""`` for the root, and each schema object that names
    itself (``$id``)."""
    resources = {resource_id(node): node for node in nodes} | {"": root}
    resources.pop(None, None)
    return resources


def _composed_parts(nodes: list[dict], resources: dict[str, Any]) -> set[int]:
    """The ids of the schemas that are parts of another's composition: ``allOf`` members,
    dependent schemas, ``if`` / ``then`` / ``else`` / ``not``, the ``anyOf`` / ``oneOf``
    branches of a schema that names properties itself (a branch adds to them), and, from a
    part, its own branches and members and the schemas its ``$ref`` may name."""
    pending: list = []
    for node in nodes:
        keys = ["allOf"]
        if "properties" in node or "required" in node:
            keys += ["anyOf", "oneOf"]
        pending += [m for key in keys if isinstance(node.get(key), list) for m in node[key]]
        for key in ("dependentSchemas", "dependencies"):
            if isinstance(node.get(key), dict):
                pending.extend(node[key].values())
        pending.extend(node.get(key) for key in ("if", "then", "else", "not"))
    parts: set[int] = set()
    while pending:
        part = pending.pop()
        if not isinstance(part, dict) or id(part) in parts:
            continue
        parts.add(id(part))
        pending += [m for key in ("allOf", "anyOf", "oneOf") if isinstance(part.get(key), list)
                    for m in part[key]]
        pending += _ref_targets(resources, part.get("$ref"))
    return parts


def _named_by_refs(nodes: list[dict], resources: dict[str, Any]
                   ) -> tuple[list[dict], set[tuple[int, str]]]:
    """The schema objects that references name beyond ``nodes`` (inside a map of
    definitions that is not a schema itself, say), with their own subschemas; and the
    steps every reference's pointer takes (the container's id and the key): a rewrite
    must not move what a pointer passes through."""
    seen = {id(node) for node in nodes}
    named: list[dict] = []
    steps: set[tuple[int, str]] = set()
    pending = list(nodes)
    while pending:
        for walk in _ref_walks(resources, pending.pop().get("$ref")):
            if walk is None:
                continue
            steps.update((id(container), key) for container, key in walk[0])
            if id(walk[1]) in seen:
                continue  # walked already, and everything under it
            for node in subschemas(walk[1]):
                if id(node) not in seen:
                    seen.add(id(node))
                    named.append(node)
                    pending.append(node)
    return named, steps


def _ref_targets(resources: dict[str, Any], ref: Any) -> list:
    """The schemas a ``$ref`` may name (None for a pointer that names nothing)."""
    return [None if walk is None else walk[1] for walk in _ref_walks(resources, ref)]


def _ref_walks(resources: dict[str, Any], ref: Any) -> list:
    """``pointer_walk`` of a ``$ref``'s pointer in the resource its URI names, or, for a
    bare ``#...``, in every resource (the one enclosing the reference among them: naming
    more is harmless here). An anchor (``#name``) names none here."""
    if not isinstance(ref, str):
        return []
    base, _, pointer = ref.partition("#")
    # A resource may be named twice (the root by "" and by its own $id): walked once.
    roots = [resources.get(base)] if base else list({id(r): r for r in resources.values()}.values())
    return [pointer_walk(root, pointer) for root in roots]


def _dependencies_as_any_of(node: dict) -> None:
    """``dependencies`` (drafts 4-7), ``dependentRequired`` and ``dependentSchemas`` in terms
    the backend implements: "if ``p`` is present, these names are too (this schema holds)"
    is ``anyOf: [{"required": [p, ...names], ...schema}, {"properties": {p: false}}]``,
    one such ``anyOf`` per property, added to the node's ``allOf``."""
    rules = []
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        value = node.get(key)
        if isinstance(value, dict):
            del node[key]
            rules.extend(value.items())
    for name, dependency in rules:
        present: dict = {"required": [name]}
        if isinstance(dependency, list):
            present["required"] = [name, *dependency]
        else:
            present["allOf"] = [dependency]
        node.setdefault("allOf", []).append(
            {"anyOf": [present, {"properties": {name: False}}]})


# Keywords that constrain objects alone: a schema of them and annotations accepts every
# value that is not an object.
_OBJECT_KEYWORDS = {"properties", "required", "additionalProperties", "patternProperties",
                    "minProperties", "maxProperties", "propertyNames", "dependencies",
                    "dependentRequired", "dependentSchemas", "unevaluatedProperties"}
_MAX_PRESENCE_ALTERNATIVES = 64
_MAX_EMPTY_OBJECT_NAMES = 8


def _one_of_exact(node: dict, resources: dict[str, Any]) -> None:
    """What of a ``oneOf`` can be said exactly in terms the backend implements; where its
    branches may overlap beyond that, the backend takes it for ``anyOf`` (``coerce_one_of``,
    as vLLM's default backend does).

    - Two or more branches that constrain objects alone (through ``$ref`` too) both accept
      any other value, so no value but an object holds exactly one: the node's ``type``
      becomes ``object``.
    - Two or more branches that hold the empty object, where every branch that holds
      objects allows only the names it lists (``additionalProperties: false``): ``{}``
      holds two, and every other object names one of those names, so the node requires
      one of them (an ``anyOf`` of ``required``, which every other value passes).
    - Branches that each only require names ("exactly one of ``radius``, or ``base`` and
      ``height``"): ``_one_of_presence_as_any_of``."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or not branches:
        return
    if sum(_objects_alone(branch, resources) for branch in branches) >= 2:
        kind = node.get("type")
        if kind is None or (isinstance(kind, list) and "object" in kind):
            node["type"] = "object"
    _one_of_without_empty_object(node, [_referenced(b, resources) for b in branches])
    _one_of_presence_as_any_of(node, branches)


def _referenced(schema: Any, resources: dict[str, Any], depth: int = 0) -> Any:
    """The schema a lone ``$ref`` (annotations beside it) names, followed to the end;
    ``schema`` itself if it is no such reference; None where the target is not one."""
    if not isinstance(schema, dict) or "$ref" not in schema \
            or set(schema) - ANNOTATIONS != {"$ref"}:
        return schema
    targets = [t for t in _ref_targets(resources, schema["$ref"]) if t is not None]
    return _referenced(targets[0], resources, depth + 1) \
        if len(targets) == 1 and depth < 8 else None


def _one_of_without_empty_object(node: dict, branches: list) -> None:
    """The empty-object rule of ``_one_of_exact`` over ``branches``, references followed
    (not where the node bounds its number of names itself: llguidance then takes no
    ``required`` beside it)."""
    if "minProperties" in node or "maxProperties" in node:
        return
    holds_objects = [b for b in branches if _may_be_object(b)]
    if not all(isinstance(b, dict) and b.get("additionalProperties") is False
               and "patternProperties" not in b and isinstance(b.get("properties", {}), dict)
               for b in holds_objects):
        return
    if sum(_holds_empty_object(b) for b in holds_objects) < 2:
        return
    names = sorted({name for b in holds_objects for name in b.get("properties", {})})
    if len(names) > _MAX_EMPTY_OBJECT_NAMES:
        return  # llguidance expands each name's alternative: grammars past its limit
    node.setdefault("allOf", []).append({"anyOf": [{"required": [n]} for n in names] or [False]})


def _may_be_object(schema: Any) -> bool:
    """Whether ``schema`` may hold an object (False only where its ``type`` says not)."""
    if schema is False:
        return False
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind is None or kind == "object" or (isinstance(kind, list) and "object" in kind)


def _holds_empty_object(schema: dict) -> bool:
    """Whether ``schema`` (one that allows only its listed names) surely holds ``{}``: it
    says nothing but its type, its properties and annotations."""
    return set(schema) - ANNOTATIONS <= {"type", "properties", "additionalProperties"}


def _objects_alone(schema: Any, resources: dict[str, Any], depth: int = 0) -> bool:
    """Whether ``schema`` constrains objects alone, following local ``$ref`` s."""
    if not isinstance(schema, dict) or depth > 8:
        return False
    extra = set(schema) - ANNOTATIONS - _OBJECT_KEYWORDS - {"$ref"}
    if extra:
        return False
    targets = _ref_targets(resources, schema.get("$ref")) if "$ref" in schema else []
    return all(_objects_alone(t, resources, depth + 1) for t in targets)


def _one_of_presence_as_any_of(node: dict, branches: list) -> None:
    """A ``oneOf`` whose branches each only require names: branch ``i`` holds and every
    other branch ``j`` does not, which is ``i``'s names present and, for each ``j``, one of
    ``j``'s names that ``i`` does not require absent (``{"properties": {p: false}}``). The
    ``oneOf`` becomes an ``anyOf`` of those choices in the node's ``allOf`` (none if every
    branch requires all of another's names). Left as is where the choices of one branch
    would pass ``_MAX_PRESENCE_ALTERNATIVES``."""
    if not all(isinstance(b, dict) and set(b) <= ANNOTATIONS | {"required"}
               and names(b.get("required")) is not None for b in branches):
        return
    required = [names(b["required"]) for b in branches]
    alternatives: list[dict] = []
    for i, present in enumerate(required):
        absences = [frozenset()]
        for j, other in enumerate(required):
            if j != i:
                absences = list({a | {p} for a in absences for p in other - present})
            if len(absences) > _MAX_PRESENCE_ALTERNATIVES:
                return
        for absent in sorted(absences, key=sorted):
            if not any(a < absent for a in absences):  # a smaller one already allows it
                alternatives.append({"required": sorted(present),
                                     "properties": {p: False for p in sorted(absent)}})
    del node["oneOf"]
    node.setdefault("allOf", []).append({"anyOf": alternatives or [False]})


@functools.lru_cache(maxsize=256)
def _known_format(name: str) -> bool:
    """Whether llguidance constrains strings of ``format`` ``name``."""
    grammar = LLMatcher.grammar_from_json_schema({"type": "string", "format": name})
    return not LLMatcher.validate_grammar_with_warnings(grammar)[0]


_COMPILE_ERRORS: dict[tuple, str] = {}
_COMPILE_ERRORS_SIZE = 1024


# llguidance's error for schema keywords it cannot enforce, and what a user can do about it.
_UNIMPLEMENTED = "Unimplemented keys"
_LENIENT_HINT = ('. To have the schema served without enforcing them, add "x-guidance": '
                 '{"lenient": true} at its top level: outputs may then break those keywords.')


def _compile_error(params: StructuredOutputsParams) -> str:
    """The compiler's error for ``params`` ('' when it compiles), computed once per key."""
    key = params.key
    error = _COMPILE_ERRORS.get(key)
    if error is None:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar_text(params))
        error = messages[0] if is_error else ""
        if error.startswith(_UNIMPLEMENTED):
            error += _LENIENT_HINT
        if len(_COMPILE_ERRORS) >= _COMPILE_ERRORS_SIZE:
            _COMPILE_ERRORS.pop(next(iter(_COMPILE_ERRORS)))
        _COMPILE_ERRORS[key] = error
    return error


class LLGuidanceGrammar(Grammar):
    __slots__ = ("matcher", "fill_seconds")

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher
        self.fill_seconds = math.inf  # its last mask's time (``RowFill``); none yet

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return self.matcher.consume_tokens(token_ids)

    def is_allowed(self, token_id: int) -> bool:
        # Where the grammar forces text, llguidance's mask allows the first token of its
        # canonical tokenization alone; validate_tokens would let any piece of it through.
        forced = self.matcher.compute_ff_tokens()
        if forced:
            return token_id == forced[0]
        return self.matcher.validate_tokens([token_id]) == 1

    def num_allowed(self, token_ids: list[int]) -> int:
        return self.matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() or None


class LLGuidanceBackend(GrammarBackend):
    """Grammars over ``tokenizer``'s vocabulary, with masks ``vocab_size`` tokens wide (the
    model's logits; ids the tokenizer lacks are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=self.vocab_size,
            eos_token=sorted(tokenizer.eos_token_ids),
        )
        # The token-trie slices that speed up masks inside JSON strings, for JSON kinds.
        self.json_tokenizer = self.tokenizer.with_slices(llguidance.LLTokenizer.json_slices())
        self.executor = llguidance.LLExecutor(num_threads=fill_threads())
        self.row_fill = RowFill(fill_threads()) if fills_by_rows() else None

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        error = _compile_error(params)
        if error:
            raise ValueError(f"The {params.kind} constraint cannot be compiled: {error}")

    def compile(self, params: StructuredOutputsParams) -> LLMatcher:
        tokenizer = self.json_tokenizer if params.kind in ("json", "json_object") else self.tokenizer
        matcher = LLMatcher(tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"The {params.kind} constraint cannot be compiled: "
                             f"{matcher.get_error()}")
        return matcher

    def new_grammar(self, compiled: Any) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(compiled.deep_copy())

    def accept_each(self, grammars: list[tuple[Grammar, int]]) -> list[bool]:
        if not grammars:
            return []  # the executor refuses an empty list
        return self.executor.consume_token_par([(g.matcher, token) for g, token in grammars])

    def fill_bitmasks(self, grammars: list[tuple[Grammar, int]], bitmask: np.ndarray) -> None:
        if self.row_fill is not None and len(grammars) > 1:
            self.row_fill.fill(grammars, bitmask)
            return
        llguidance.numpy.fill_next_token_bitmask_par(
            self.executor, [(g.matcher, row) for g, row in grammars], bitmask)


class RowFill:
    """A step's masks filled one row at a time by ``threads`` threads (the caller one of
    them), each taking the next row of one queue, the rows dearest at their last fill
    first (``PAGEDLLM_GRAMMAR_FILL=rows``).

    A row's mask costs from microseconds to milliseconds (near a bounded string's end, the
    dearest), and llguidance's parallel call hands its threads runs of rows that each fills
    in order, so a run holding a dear row ends late while other threads idle. Here a
    thread is never behind another's row: a step's fill lasts about its dearest row or the
    rows' sum over the threads, whichever is longer. Each row's call releases the
    interpreter's lock while it computes; taking a row and timing it hold the lock for a
    few microseconds."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = (ThreadPoolExecutor(threads - 1, thread_name_prefix="pagedllm-mask-rows")
                      if threads > 1 else None)

    def fill(self, grammars: list[tuple[LLGuidanceGrammar, int]], bitmask: np.ndarray) -> None:
        """Row ``row`` of ``bitmask`` (C-contiguous int32, one row a mask) becomes the mask
        of each ``(grammar, row)``, as ``fill_next_token_bitmask_par`` writes it."""
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags.c_contiguous:
            raise ValueError("The bitmask must be a C-contiguous 2-D int32 array.")
        if any(not 0 <= row < bitmask.shape[0] for _, row in grammars):
            raise ValueError(f"A row is outside the bitmask's {bitmask.shape[0]} rows.")
        base, row_bytes = bitmask.ctypes.data, bitmask.shape[1] * 4
        queue = sorted(grammars, key=lambda item: -item[0].fill_seconds)
        taken = itertools.count()  # one next() at a time: the interpreter's lock

        def work() -> None:
            while (i := next(taken)) < len(queue):
                grammar, row = queue[i]
                start = time.perf_counter()
                grammar.matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
                grammar.fill_seconds = time.perf_counter() - start

        helpers = min(self.threads, len(queue)) - 1
        futures = [self._pool.submit(work) for _ in range(helpers)]
        try:
            work()
        finally:
            for future in futures:
                future.result()
