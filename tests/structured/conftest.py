"""Shared fixtures: the tiny model (from the engine tests) and grammars over its tokenizer."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from pagedllm.engine.tokenizer import Tokenizer
from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.llguidance_backend import LLGuidanceBackend
from pagedllm.structured.manager import RequestGrammar, StructuredOutputManager
from tests.engine.conftest import VOCAB_SIZE, hf_model, tiny_model_dir  # noqa: F401 - shared fixtures


@pytest.fixture(scope="module")
def manager(tiny_model_dir):
    """A structured-output manager over the tiny model's tokenizer."""
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    return StructuredOutputManager(lambda: LLGuidanceBackend(tokenizer, VOCAB_SIZE))


@pytest.fixture(scope="module")
def ids(tiny_model_dir):
    """Text to token ids, one token per character."""
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)

    def encode(text: str) -> list[int]:
        tokens = [tokenizer.encode(c, add_special_tokens=False) for c in text]
        assert all(len(t) == 1 for t in tokens)
        return [t[0] for t in tokens]

    return encode


def grammar_of(manager, params: StructuredOutputsParams,
               reasoning_end: list[int] | None = None) -> RequestGrammar:
    """A request's grammar for ``params``, compiled and ready."""
    compiled = Future()
    compiled.set_result(manager.backend().compile(params))
    request_grammar = RequestGrammar(lambda: compiled, manager.backend, reasoning_end)
    assert request_grammar.ready
    return request_grammar
