"""Greedy tokens equal HF transformers' for every architecture family beyond Llama, with
batching, chunked prefill, prefix-cache hits and preemption in one run."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.conftest import VOCAB_SIZE, hf_greedy, random_prompts
from tests.tokenizer_utils import make_tiny_tokenizer
from tests.utils import make_tiny_checkpoint

MAX_NEW = 10
# family -> config overrides exercising its quirks
FAMILIES = {
    "mixtral": ("mixtral", dict(sliding_window=12)),
    "phi3": ("phi3", dict(sliding_window=10)),
    "phi3_partial_rotary": ("phi3", dict(partial_rotary_factor=0.5)),
    "gemma2": ("gemma2", dict(num_hidden_layers=3, sliding_window=10,
                              attn_logit_softcapping=3.0, final_logit_softcapping=5.0)),
    "gemma3": ("gemma3", dict(num_hidden_layers=3, sliding_window=10,
                              layer_types=["sliding_attention", "full_attention",
                                           "sliding_attention"])),
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.5)),
    "opt": ("opt", dict()),
    "falcon_grouped_kv": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "falcon_multi_query": ("falcon", dict(multi_query=True)),
    "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1],
                                    norm_topk_prob=False)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    family, overrides = FAMILIES[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family,
                                vocab_size=VOCAB_SIZE, max_position_embeddings=256, **overrides)
    make_tiny_tokenizer(path, vocab_size=VOCAB_SIZE)
    from transformers import AutoModelForCausalLM

    # Eager attention: the one HF implementation that soft-caps scores (Gemma 2).
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    return path, hf


def test_shared_prefixes_tiny_budget_and_preemption_keep_hf_tokens(checkpoint) -> None:
    path, hf = checkpoint
    stems = random_prompts(2, 17, 24, seed=100)
    prompts = [stems[i % 2][: 9 + 2 * i] + random_prompts(1, 1, 6, seed=200 + i)[0]
               for i in range(6)]
    want = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), block_size=8, num_kv_blocks=8, max_model_len=48,
              max_num_batched_tokens=9)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.num_preemptions_total > 0
    assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 8
