"""Sampling with speculation: seeded requests reproduce their tokens whatever else runs
beside them, and logprobs come with every token an accepted run yields."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.engine.conftest import random_prompts
from tests.spec_decode.conftest import repetitive_prompts


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(3, seed=5)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_seeded_request_reproduces_its_tokens_alone_or_in_a_batch(target_dir, draft_dir,
                                                                    prompts, method):
    spec = (dict(speculative_method="ngram", num_speculative_tokens=4) if method == "ngram"
            else dict(speculative_model=str(draft_dir), num_speculative_tokens=4))
    llm = LLM(str(target_dir), block_size=8, max_model_len=128, max_num_seqs=8, **spec)
    # N-gram lookup finds proposals where the output repeats itself: a random model's
    # does at a low temperature without penalties.
    knobs = (dict(temperature=0.7, repetition_penalty=1.2) if method == "draft"
             else dict(temperature=0.1))
    seeded = SamplingParams(top_k=40, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True,
                            **knobs)
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)

    def run(batch: bool) -> list[int]:
        requests = [{"prompt_token_ids": p} for p in (prompts if batch else prompts[:1])]
        params = [seeded] + [others] * (len(requests) - 1)
        return llm.generate(requests, params, use_tqdm=False)[0].outputs[0].token_ids

    alone = run(batch=False)
    assert len(alone) == 24
    assert run(batch=True) == alone
    assert run(batch=False) == alone
    assert llm.llm_engine.engine_core.scheduler.spec_decoding_stats.num_drafts > 0


def test_logprobs_of_accepted_runs_equal_those_without_speculation(target_dir, draft_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 4, 20, seed=9)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    want = LLM(str(target_dir), block_size=8, max_model_len=128, max_num_seqs=8).generate(
        prompts, params, use_tqdm=False)
    llm = LLM(str(target_dir), block_size=8, max_model_len=128, max_num_seqs=8,
              speculative_model=str(draft_dir), num_speculative_tokens=4)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.spec_decoding_stats.num_accepted_tokens > 0
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == 16
        for g_position, w_position in zip(g.logprobs, w.logprobs):
            assert set(g_position) == set(w_position)
            for token, entry in w_position.items():
                assert g_position[token].rank == entry.rank
                assert g_position[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)


def test_n_seeded_choices_speculate_as_separate_requests(target_dir, draft_dir, prompts):
    """``n = 3`` with a seed: each choice is the request its own seed (seed + index) gives
    alone, speculation or not."""
    engine = dict(block_size=8, max_model_len=128, max_num_seqs=8)
    llm = LLM(str(target_dir), speculative_model=str(draft_dir), num_speculative_tokens=3,
              **engine)
    request = [{"prompt_token_ids": prompts[0]}]
    together = llm.generate(request, SamplingParams(n=3, seed=5, temperature=0.8, max_tokens=16,
                                                    ignore_eos=True), use_tqdm=False)[0]
    for choice in together.outputs:
        alone = llm.generate(request, SamplingParams(seed=5 + choice.index, temperature=0.8,
                                                     max_tokens=16, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
        assert choice.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1
