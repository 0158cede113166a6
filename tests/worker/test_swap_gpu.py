"""On a GPU: preemption by swapping (``swap_space``) copies a request's KV to page-locked
host memory and back, and greedy tokens equal those of a cache that never preempts, over
a bf16 and an FP8 cache, with CUDA graphs and asynchronous scheduling (the defaults)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.utils import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="swapping to pinned "
                                "host memory needs a GPU")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_swapped_requests_give_the_tokens_of_a_cache_that_never_preempts(tmp_path,
                                                                         kv_cache_dtype):
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=256)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 240 + 8 for j in range(20 + 5 * i)]}
               for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kwargs = dict(dtype="bfloat16", max_model_len=128, block_size=16, device="cuda",
                  kv_cache_dtype=kv_cache_dtype)

    def run(**cache):
        llm = LLM(str(path), **kwargs, **cache)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return outputs, llm.llm_engine.engine_core

    roomy, _ = run(num_kv_blocks=128)
    swapped, core = run(num_kv_blocks=12, swap_space=0.05)
    scheduler = core.scheduler
    assert swapped == roomy
    assert scheduler.num_swapped_tokens_total > 0 and scheduler.num_preempted_tokens_total == 0
    host = core.model_runner.host_kv_caches
    assert all(cache.is_pinned() for cache in host)
    assert sum(cache.numel() for cache in host) <= 0.05 * 2**30  # exactly what was asked
