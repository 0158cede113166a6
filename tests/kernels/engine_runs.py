"""Greedy runs of a tiny Llama on the Triton backend, for tests that compare two settings of
the attention path end to end."""

from __future__ import annotations

from pathlib import Path

from tests.utils import make_tiny_checkpoint


def tiny_llama(tmp_path: Path) -> Path:
    """A two-layer Llama checkpoint with a 128-token vocabulary and context."""
    return make_tiny_checkpoint(tmp_path, "llama", vocab_size=128, max_position_embeddings=128,
                                num_hidden_layers=2)


def chunked_prefix_greedy_outputs(path: Path, **llm_kwargs) -> list:
    """Six greedy tokens (with their logprobs) for each of three prompts (two sharing a
    20-token prefix, so the second is served from the prefix cache) in 12-token steps
    beside decodes, pages of 8; the caller chooses the attention backend
    (``PAGEDLLM_ATTENTION_BACKEND``). Checks the prefix was hit. One completion each."""
    from pagedllm import LLM, SamplingParams

    shared = [(5 * j) % 120 + 4 for j in range(20)]
    prompts = [shared + [9, 10, 11], shared + [(7 * j) % 120 + 4 for j in range(9)],
               [(3 * j) % 120 + 4 for j in range(30)]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    llm = LLM(str(path), block_size=8, max_model_len=64, max_num_batched_tokens=12,
              enforce_eager=True, seed=0, **llm_kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    return [o.outputs[0] for o in outputs]


def chunked_prefix_greedy_tokens(path: Path, **llm_kwargs) -> list[list[int]]:
    """The token ids of ``chunked_prefix_greedy_outputs``."""
    return [o.token_ids for o in chunked_prefix_greedy_outputs(path, **llm_kwargs)]
