"""Fixtures: the tiny test tokenizer on disk, loaded by pagedllm and by transformers."""

from __future__ import annotations

import pytest

from pagedllm.engine.tokenizer import Tokenizer
from tests.tokenizer_utils import make_tiny_tokenizer

VOCAB_SIZE = 384


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"), vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="session")
def tokenizer(tiny_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
