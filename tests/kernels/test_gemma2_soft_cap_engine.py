"""Gemma 2 on the Triton attention backend (natively on CUDA, under the interpreter
elsewhere): with its scores soft-capped in the kernels, greedy tokens equal HF's through
chunked prefill, prefix hits and decodes."""

from __future__ import annotations

import torch

from pagedllm import LLM, SamplingParams
from tests.engine.conftest import hf_greedy
from tests.utils import make_tiny_checkpoint


def test_gemma2_greedy_tokens_equal_hf_on_the_kernel_backend(tmp_path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path, "gemma2", vocab_size=128, max_position_embeddings=128,
                                num_hidden_layers=2, sliding_window=6,
                                attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    shared = [(5 * j) % 120 + 4 for j in range(16)]
    prompts = [shared + [9, 10, 11], shared + [(7 * j) % 120 + 4 for j in range(5)],
               [(3 * j) % 120 + 4 for j in range(7)]]
    want = [hf_greedy(hf, p, 5) for p in prompts]
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    llm = LLM(str(path), block_size=8, max_model_len=64, max_num_batched_tokens=12,
              enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    got = [o.outputs[0].token_ids
           for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)]
    assert got == want
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
