"""The master test: greedy tokens equal HF transformers' whatever the engine does inside.

Batching, chunked prefill, preemption, prefix-cache hits, block size and asynchronous
scheduling (every test runs with the step loop synchronous and asynchronous) must never
change what a user gets back.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts

MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 3, 40, seed=1)


@pytest.fixture(scope="module")
def expected(hf_model, prompts):
    return [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    return request.param


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def scheduler_of(llm: LLM):
    return llm.llm_engine.engine_core.scheduler


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_batched_greedy_matches_hf_for_mixed_lengths(
    tiny_model_dir, prompts, expected, block_size, async_scheduling
):
    llm = LLM(str(tiny_model_dir), block_size=block_size, max_model_len=128,
              async_scheduling=async_scheduling)
    assert greedy(llm, prompts) == expected


def test_chunked_prefill_with_tiny_budget_matches_hf(
    tiny_model_dir, prompts, expected, async_scheduling
):
    llm = LLM(str(tiny_model_dir), max_num_batched_tokens=7, max_model_len=128,
              async_scheduling=async_scheduling)
    assert greedy(llm, prompts) == expected


def test_preemption_under_kv_pressure_keeps_tokens(
    tiny_model_dir, prompts, expected, async_scheduling
):
    # 8 blocks of 8 tokens cannot hold six sequences of up to 52 tokens at once.
    llm = LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=8, max_model_len=64,
              enable_prefix_caching=False, async_scheduling=async_scheduling)
    assert greedy(llm, prompts) == expected
    assert scheduler_of(llm).num_preemptions_total > 0


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["uncached", "cached"])
def test_preemption_by_swapping_keeps_tokens(
    tiny_model_dir, prompts, expected, async_scheduling, prefix_caching
):
    # As above, with host memory for the preempted requests' KV (--swap-space): they come
    # back with their computed tokens copied in, not computed again.
    llm = LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=8, max_model_len=64,
              enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling,
              swap_space=0.01)
    assert greedy(llm, prompts) == expected
    scheduler = scheduler_of(llm)
    assert scheduler.num_swapped_tokens_total > 0 and scheduler.num_preempted_tokens_total == 0
    host = scheduler.kv_cache_manager.host_pool
    assert host.num_free_blocks == host.num_blocks


def test_swapping_an_fp8_cache_keeps_its_tokens(tiny_model_dir, prompts, async_scheduling):
    # An FP8 cache's blocks (values slot-major) copied out and back byte for byte: the
    # tokens of a cache large enough never to preempt.
    def run(**cache):
        llm = LLM(str(tiny_model_dir), block_size=8, max_model_len=64, kv_cache_dtype="fp8",
                  async_scheduling=async_scheduling, **cache)
        return greedy(llm, prompts), scheduler_of(llm)

    roomy, _ = run(num_kv_blocks=64)
    swapped, scheduler = run(num_kv_blocks=8, swap_space=0.01)
    assert swapped == roomy and scheduler.num_swapped_tokens_total > 0


def test_prefix_cache_hits_keep_tokens(tiny_model_dir, hf_model, async_scheduling):
    shared = random_prompts(1, 40, 40, seed=7)[0]
    tails = random_prompts(4, 1, 9, seed=8)
    prompts = [shared + t for t in tails]
    want = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    llm = LLM(str(tiny_model_dir), block_size=8, max_model_len=128,
              async_scheduling=async_scheduling)
    assert greedy(llm, prompts[:1]) == want[:1]  # warm the cache
    assert greedy(llm, prompts[1:]) == want[1:]
    stats = scheduler_of(llm).kv_cache_manager.prefix_cache_stats
    assert stats.hits >= 3 * 40  # each later prompt reused the 40-token shared prefix


def test_block_pool_returns_to_full_after_all_requests_finish(
    tiny_model_dir, prompts, async_scheduling
):
    llm = LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=64, max_model_len=128,
              async_scheduling=async_scheduling)
    greedy(llm, prompts)
    scheduler = scheduler_of(llm)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 64


@pytest.mark.parametrize("seed", [0, 1])
def test_everything_at_once_still_matches_hf(tiny_model_dir, hf_model, seed, async_scheduling):
    """Shared prefixes, a tiny token budget and a KV cache small enough to preempt, together."""
    import random

    rng = random.Random(seed)
    stems = random_prompts(2, 17, 24, seed=100 + seed)
    prompts = [rng.choice(stems)[: rng.randint(9, 24)] + random_prompts(1, 1, 6, seed=200 + i)[0]
               for i in range(7)]
    want = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    llm = LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=8, max_model_len=48,
              max_num_batched_tokens=rng.choice([5, 9, 16]), async_scheduling=async_scheduling)
    assert greedy(llm, prompts) == want
    scheduler = scheduler_of(llm)
    assert scheduler.num_preemptions_total > 0
    assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 8


def test_repetition_penalty_matches_hf(tiny_model_dir, hf_model, prompts, async_scheduling):
    """HF's repetition penalty covers prompt and generated tokens, as ours does."""
    want = [hf_greedy(hf_model, p, MAX_NEW, repetition_penalty=1.8) for p in prompts]
    llm = LLM(str(tiny_model_dir), block_size=8, max_model_len=128,
              async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == want
    assert got != greedy(llm, prompts)  # the penalty changed something
