"""On a GPU: the KV cache is sized with the sampler's memory already in place."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.utils import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="KV sizing by profiling needs a GPU")


def test_first_penalised_request_allocates_nothing_the_sizing_left_out(tmp_path) -> None:
    """The penalties' token counts (max_num_seqs x vocab x 5 bytes) exist before the cache
    is sized, so a server whose memory the cache fills does not run short when the first
    request with a repetition or frequency penalty arrives."""
    vocab, max_num_seqs = 32000, 96
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=vocab, max_position_embeddings=256)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=max_num_seqs,
              device="cuda", enforce_eager=True)
    prompt = {"prompt_token_ids": list(range(10, 40))}
    llm.generate(prompt, SamplingParams(temperature=0.8, max_tokens=4), use_tqdm=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    penalised = SamplingParams(temperature=0.8, max_tokens=4, repetition_penalty=1.2,
                               frequency_penalty=0.5)
    llm.generate(prompt, penalised, use_tqdm=False)
    torch.cuda.synchronize()
    table_bytes = max_num_seqs * vocab * 5
    assert torch.cuda.memory_allocated() - before < table_bytes // 4
