"""Lookaheads at a pattern's start or end become patterns llguidance compiles, which hold
for exactly the strings the original pattern matches (as ECMA-262 reads it); any other
lookaround is left for the backend to refuse."""

from __future__ import annotations

import copy
import itertools
import re

import pytest

from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.llguidance_backend import LLGuidanceBackend
from pagedllm.structured.lookahead import lookaheads_as_patterns

ALPHABET = ["a", "b", "A", "B", "=", ".", " ", "\n", "5", "/", "@", "-"]
STRINGS = ["".join(chars) for size in range(4)
           for chars in itertools.product(ALPHABET, repeat=size)]
STRINGS += ["@@a", "interactive", "names", "nam", "na", "x.yaml", "a/b.json", "a/b.jso", "a.b.c",
            "a.bc", "abab", "ab=", "   \n", "mode", "a--b"]

REWRITTEN = [
    r"^(?!@@)[@a-z0-9_-]+$",
    r"^(?!interactive|name|style).+$",
    r"^(?!a\.b)([a-z]+\.)*[a-z]+$",
    r"^(?![aA][bB])",
    r"^(?=[^=]+$)(?!\s+$)(.|\n)+$",
    r"^(?=.{1,3}$)[a-z5]*",
    r"((?:[^/]*/)*)(?=\.(ya?ml|json))",
    r"a(?=b)",
    r"=|a(?=b)",
    r"^(?!a)(b|a)",
    r"^(?!.)",
]
LEFT_ALONE = [r"^a(?!b)", r"^(?!a)b|a", r"(?<=a)b", r"^((?!mode).)*$", r"^(?!.*--)[a-z-]+$", r"(?=a)b$",
              r"^(?!(a)\1)", r"^(?![aA][bB]|x)", r"^(?!)a"]


def ecma(pattern: str) -> str:
    """Python's reading of an ECMA-262 pattern: ``$`` only at the very end (Python's also
    matches before a final newline)."""
    return re.sub(r"(?<!\\)\$", r"\\Z", pattern)


def holds(schema: dict, string: str) -> bool:
    """Whether ``string`` holds ``schema``'s patterns and types, ``allOf`` included."""
    for part in [schema, *schema.get("allOf", [])]:
        if "type" in part and "string" not in part["type"]:
            return False
        if "pattern" in part and re.search(ecma(part["pattern"]), string) is None:
            return False
    return True


@pytest.mark.parametrize("pattern", REWRITTEN)
def test_lookaheads_become_patterns_that_hold_where_the_original_does(pattern):
    schema = {"type": "string", "pattern": pattern}
    rewritten = copy.deepcopy(schema)
    lookaheads_as_patterns(rewritten)
    patterns = [part["pattern"] for part in [rewritten, *rewritten.get("allOf", [])]
                if "pattern" in part]
    assert not any("(?=" in p or "(?!" in p for p in patterns), rewritten
    for string in STRINGS:
        assert holds(rewritten, string) == holds(schema, string), (string, rewritten)
    LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("pattern", LEFT_ALONE)
def test_other_lookarounds_are_left_for_the_backend_to_refuse(pattern):
    schema = {"type": "string", "pattern": pattern}
    rewritten = copy.deepcopy(schema)
    lookaheads_as_patterns(rewritten)
    assert rewritten == schema
    with pytest.raises(ValueError, match="look"):
        LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))


def test_a_lookahead_sign_inside_a_class_or_escaped_is_no_lookahead():
    for pattern in (r"^[(?=]+$", r"^\(\?!x\)$"):
        schema = {"type": "string", "pattern": pattern}
        rewritten = copy.deepcopy(schema)
        lookaheads_as_patterns(rewritten)
        assert rewritten == schema
        LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))
