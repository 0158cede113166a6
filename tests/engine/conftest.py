"""Fixtures for engine tests: a tiny random Llama checkpoint with a real tokenizer, and HF references."""

from __future__ import annotations

import pytest
import torch

from tests.tokenizer_utils import make_tiny_tokenizer
from tests.utils import make_tiny_checkpoint

VOCAB_SIZE = 384


def make_tiny_model(root):
    """A tiny random Llama checkpoint under ``root`` with a real tokenizer of its vocabulary."""
    path = make_tiny_checkpoint(root, "llama", vocab_size=VOCAB_SIZE, max_position_embeddings=256)
    make_tiny_tokenizer(path, vocab_size=VOCAB_SIZE)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int, **generation) -> list[int]:
    """HF transformers ``generate`` greedy continuation, never stopping early at EOS."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, pad_token_id=0, **generation)
    # No EOS at all (rather than min_new_tokens masking it), like ignore_eos=True.
    config.eos_token_id = None
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_token_ids]), generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved
    generated = out[0, len(prompt_token_ids):].tolist()
    assert len(generated) == max_new_tokens
    return generated


def random_prompts(count: int, low: int, high: int, seed: int = 0, vocab: int = VOCAB_SIZE) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    # Avoid the tokenizer's special ids (the first few) so prompts look like text.
    return [torch.randint(8, vocab, (n,), generator=generator).tolist() for n in lengths]
