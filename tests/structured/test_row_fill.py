"""Masks filled a row at a time from one queue (``PAGEDLLM_GRAMMAR_FILL=rows``): the same
bits as llguidance's parallel call writes, in each row's own place, whatever order the
rows are taken in; and the engine's constrained outputs still validate."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from pagedllm.engine.tokenizer import Tokenizer
from pagedllm.structured import StructuredOutputsParams
from pagedllm.structured.llguidance_backend import LLGuidanceBackend
from tests.engine.conftest import VOCAB_SIZE
from tests.structured.schemas import SCHEMAS
from tests.structured.test_engine_structured import make_llm, sample

CONSTRAINTS = [StructuredOutputsParams(json=schema) for schema in SCHEMAS.values()] + [
    StructuredOutputsParams(regex=r"[a-c]{2,9}x"), StructuredOutputsParams(choice=["ab", "abc"]),
]


def backend(tokenizer, monkeypatch, mode: str) -> LLGuidanceBackend:
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_FILL", mode)
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_FILL_THREADS", "3")
    return LLGuidanceBackend(tokenizer, VOCAB_SIZE)


def test_rows_filled_one_at_a_time_hold_the_parallel_calls_masks(tiny_model_dir, monkeypatch):
    """Twelve grammars of five constraints walk random allowed tokens; at every step each
    one's mask, filled into a row other than its index, is the parallel call's."""
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    by_rows, parallel = (backend(tokenizer, monkeypatch, mode) for mode in ("rows", "par"))
    assert by_rows.row_fill is not None and parallel.row_fill is None
    constraints = [CONSTRAINTS[i % len(CONSTRAINTS)] for i in range(12)]
    pairs = [(by_rows.new_grammar(by_rows.compile(c)), parallel.new_grammar(parallel.compile(c)))
             for c in constraints]
    words = (VOCAB_SIZE + 31) // 32
    rng = np.random.default_rng(0)
    steps = 0
    while steps < 60:
        live = [i for i, (g, _) in enumerate(pairs) if not g.is_terminated()]
        if not live:
            break
        rows = {i: len(live) - 1 - k for k, i in enumerate(live)}  # reversed: not the index
        got = np.zeros((len(live), words), np.int32)
        want = np.zeros((len(live), words), np.int32)
        by_rows.fill_bitmasks([(pairs[i][0], rows[i]) for i in live], got)
        parallel.fill_bitmasks([(pairs[i][1], rows[i]) for i in live], want)
        assert np.array_equal(got, want), f"step {steps}"
        for i in live:
            allowed = np.flatnonzero(np.unpackbits(got[rows[i]].view(np.uint8),
                                                   bitorder="little")[:VOCAB_SIZE])
            token = int(rng.choice(allowed))
            assert pairs[i][0].accept_tokens([token]) and pairs[i][1].accept_tokens([token])
        steps += 1
    assert steps >= 5


def test_a_row_outside_the_bitmask_or_a_strided_bitmask_is_refused(tiny_model_dir, monkeypatch):
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    by_rows = backend(tokenizer, monkeypatch, "rows")
    grammars = [by_rows.new_grammar(by_rows.compile(CONSTRAINTS[-1])) for _ in range(2)]
    words = (VOCAB_SIZE + 31) // 32
    with pytest.raises(ValueError, match="outside the bitmask's 2 rows"):
        by_rows.fill_bitmasks([(grammars[0], 0), (grammars[1], 2)], np.zeros((2, words), np.int32))
    with pytest.raises(ValueError, match="C-contiguous 2-D int32"):
        by_rows.fill_bitmasks([(grammars[0], 0), (grammars[1], 1)],
                              np.zeros((2, 2 * words), np.int32)[:, ::2])


def test_the_engine_filling_rows_one_at_a_time_gives_valid_outputs(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_FILL", "rows")
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_FILL_THREADS", "2")
    schema = SCHEMAS["nested_with_refs"]
    llm = make_llm(tiny_model_dir)
    assert llm.llm_engine.engine_core.structured.backend().row_fill is not None
    for completion in sample(llm, StructuredOutputsParams(json=schema), num=8):
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
