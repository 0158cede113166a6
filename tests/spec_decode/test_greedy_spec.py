"""Greedy decoding with speculation equals greedy decoding without it, and HF transformers,
token for token, whatever the proposer, K, batching, chunking, caching or preemption."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts
from tests.spec_decode.conftest import repetitive_prompts

MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(4, seed=1) + random_prompts(2, 3, 30, seed=2)


@pytest.fixture(scope="module")
def expected(hf_model, prompts):
    return [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]


def proposer(method: str, draft_dir, k: int) -> dict:
    if method == "ngram":
        return dict(speculative_method="ngram", num_speculative_tokens=k)
    return dict(speculative_model=str(draft_dir), num_speculative_tokens=k)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def stats_of(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.spec_decoding_stats


def assert_pool_whole(llm: LLM) -> None:
    scheduler = llm.llm_engine.engine_core.scheduler
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_speculative_greedy_matches_hf(target_dir, draft_dir, prompts, expected, method, k):
    llm = LLM(str(target_dir), block_size=8, max_model_len=128, max_num_seqs=8,
              **proposer(method, draft_dir, k))
    assert greedy(llm, prompts) == expected
    stats = stats_of(llm)
    # Proposals were made, some kept and some rejected: both paths ran.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_pool_whole(llm)


@pytest.mark.parametrize("swap_space", [0.0, 0.01], ids=["recompute", "swap"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_chunked_prefill_preemption_and_prefix_hits_keep_tokens(
    target_dir, draft_dir, hf_model, prompts, expected, method, swap_space
):
    shared = random_prompts(1, 24, 24, seed=7)[0]
    cached = [shared + p for p in prompts[:3]]
    want = [hf_greedy(hf_model, p, MAX_NEW) for p in cached]
    # A budget of 7 tokens chunks every prompt; 10 blocks of 8 tokens force preemption.
    # With swap_space, preempted requests' KV (the draft's with the target's) goes to host
    # memory and back.
    llm = LLM(str(target_dir), block_size=8, max_model_len=80, num_kv_blocks=10, max_num_seqs=8,
              max_num_batched_tokens=7, swap_space=swap_space, **proposer(method, draft_dir, 4))
    assert greedy(llm, prompts[:4]) == expected[:4]
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert (llm.llm_engine.engine_core.scheduler.num_swapped_tokens_total > 0) == bool(swap_space)
    assert greedy(llm, cached[:1]) == want[:1]  # the shared prefix enters the cache
    assert greedy(llm, cached[1:]) == want[1:]
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_stats.hits >= 2 * 24
    assert stats_of(llm).num_accepted_tokens > 0
    assert_pool_whole(llm)


def test_a_batch_mixing_speculating_and_plain_requests(target_dir, draft_dir, prompts, expected):
    """Requests that cannot speculate this step (random sampling beside greedy ones, a
    batch above --speculative-disable-by-batch-size, max_tokens of 1) run beside
    speculating ones; the greedy requests keep HF's tokens."""
    llm = LLM(str(target_dir), block_size=8, max_model_len=128, max_num_seqs=8,
              speculative_disable_by_batch_size=4, **proposer("draft", draft_dir, 3))
    greedy_params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    early = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    single = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # Six running: no speculation until three have finished.
    params = [greedy_params, sampled, greedy_params, single, greedy_params, early]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    for i in (0, 2, 4):
        assert tokens[i] == expected[i]
    assert tokens[3] == expected[3][:1] and tokens[5] == expected[5][:6]
    assert len(tokens[1]) == 8
    assert stats_of(llm).num_drafts > 0
    assert_pool_whole(llm)


def in_flight_after_each_step(llm: LLM) -> list[bool]:
    """Records, after every engine step, whether a step was left in flight."""
    core = llm.llm_engine.engine_core
    record: list[bool] = []
    step = core.step

    def recording_step():
        outputs = step()
        record.append(core._in_flight is not None)
        return outputs

    core.step = recording_step
    return record


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_asynchronous_scheduling_beside_speculation(target_dir, draft_dir, prompts, expected,
                                                    method):
    """Above --speculative-disable-by-batch-size the steps stay in flight; once few enough
    requests run, the steps speculate synchronously. Greedy tokens stay HF's across the
    switches, under chunked prefill and preemption."""
    llm = LLM(str(target_dir), block_size=8, max_model_len=64, max_num_seqs=8,
              num_kv_blocks=16, max_num_batched_tokens=16, async_scheduling=True,
              speculative_disable_by_batch_size=3, **proposer(method, draft_dir, 3))
    in_flight = in_flight_after_each_step(llm)
    lengths = [6, 10, 14, MAX_NEW, MAX_NEW, MAX_NEW]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [
        want[:n] for want, n in zip(expected, lengths)]
    assert any(in_flight) and not all(in_flight)
    assert stats_of(llm).num_drafts > 0
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert_pool_whole(llm)


def test_the_draft_keeps_up_through_steps_without_speculation(target_dir, prompts):
    """A draft that is the target itself proposes the target's own tokens, so all of them
    are accepted, as long as the steps without speculation (in flight, above the batch
    limit) keep the draft's KV cache current."""
    llm = LLM(str(target_dir), block_size=8, max_model_len=128, max_num_seqs=8,
              async_scheduling=True, speculative_disable_by_batch_size=2,
              speculative_model=str(target_dir), num_speculative_tokens=3)
    in_flight = in_flight_after_each_step(llm)
    lengths = [4, 8, 12, 16, 20, MAX_NEW]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = stats_of(llm)
    assert any(in_flight) and stats.num_drafts >= 3
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_the_draft_must_share_the_target_vocabulary(target_dir, tiny_checkpoint):
    other = tiny_checkpoint("llama", vocab_size=200)
    with pytest.raises(ValueError, match=r"vocabulary of 200 tokens but the target model .* has 384"):
        LLM(str(target_dir), speculative_model=str(other), num_speculative_tokens=2)


def test_penalties_and_min_tokens_see_the_proposals_as_output(target_dir, prompts):
    """Each verified row is sampled as if the proposals before it were output already:
    penalised greedy decoding, and stop tokens held back by min_tokens, give the plain
    engine's tokens. The target drafts for itself, so proposals reach every row."""
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, repetition_penalty=2.0,
                             frequency_penalty=0.5, presence_penalty=0.5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=12,
                             stop_token_ids=list(range(8, 384, 3)))]
    requests = [{"prompt_token_ids": p} for p in prompts[:2]]
    engine = dict(block_size=8, max_model_len=128, max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in LLM(str(target_dir), **engine).generate(
        requests, params, use_tqdm=False)]
    llm = LLM(str(target_dir), **engine, speculative_model=str(target_dir),
              num_speculative_tokens=4)
    got = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    assert got == want
    assert len(want[1]) >= 12  # min_tokens held the stop tokens back that long
    stats = stats_of(llm)
    assert stats.num_accepted_tokens > 2 * stats.num_drafts  # long accepted runs


def test_a_request_at_the_end_of_its_context_drafts_beside_one_drafting_more(
    target_dir, draft_dir, hf_model
):
    """A request near max_model_len proposes fewer tokens than one with room, in the same
    draft loop; both keep HF's tokens up to the context's end."""
    long_prompt = random_prompts(1, 50, 50, seed=11)[0]
    short_prompt = random_prompts(1, 5, 5, seed=12)[0]
    llm = LLM(str(target_dir), block_size=8, max_model_len=64, max_num_seqs=8,
              **proposer("draft", draft_dir, 8))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in (long_prompt, short_prompt)],
                           params, use_tqdm=False)
    long_out, short_out = (o.outputs[0] for o in outputs)
    assert len(long_out.token_ids) == 64 - 50 and long_out.finish_reason == "length"
    assert long_out.token_ids == hf_greedy(hf_model, long_prompt, 64 - 50)
    assert short_out.token_ids == hf_greedy(hf_model, short_prompt, 40)
    assert_pool_whole(llm)
