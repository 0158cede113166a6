"""Speculative decoding in the scheduler: proposals scheduled with their request's last
token, rejected ones rolled back, draft slots allocated, outputs unchanged.

The fake runner verifies proposals against its deterministic model, so every request must
end with exactly the tokens it produces alone, whatever was proposed, batched, chunked,
cached or preempted.
"""

from __future__ import annotations

import random

import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.fake_runner import next_token, reference_outputs
from tests.core.helpers import Run, make_request, make_scheduler, runner_for, step

MAX_MODEL_LEN = 64


def spec_config(method: str, k: int, **kwargs) -> SpeculativeConfig:
    if method == "draft_model":
        # The scheduler reads only the method and the numbers: no model is loaded.
        return SpeculativeConfig(method=method, num_speculative_tokens=k, model="draft", **kwargs)
    return SpeculativeConfig(method=method, num_speculative_tokens=k, **kwargs)


def lookup_proposer(rng: random.Random, k: int):
    """An n-gram-like proposer: the request's true continuation, cut at a random point and
    with a wrong token after it, so some steps accept all, some a part, some nothing."""
    def propose(request: Request) -> list[int]:
        tokens = list(request.all_token_ids)
        proposal = []
        for _ in range(rng.randint(0, k)):
            proposal.append(next_token(tokens + proposal))
        if proposal and rng.random() < 0.5:
            proposal[rng.randrange(len(proposal))] += 1
        return proposal
    return propose


def drive(scheduler, requests, rng, propose=None) -> Run:
    runner, run = runner_for(scheduler), Run()
    pending = list(requests)
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        if not scheduler.has_unfinished_requests():
            continue
        so = step(scheduler, runner, run)
        for req_id, spec in so.spec_token_ids.items():
            assert so.num_scheduled_tokens[req_id] == len(spec) + 1
        if propose is not None:  # as the engine core does after each step
            for request in scheduler.running:
                if request.num_computed_tokens == request.num_tokens - 1:
                    request.spec_token_ids = propose(request)
        assert len(run.steps) < 2000
    return run


def workload(rng: random.Random, num_requests: int = 16) -> list[Request]:
    shared = list(range(200, 216))
    requests = []
    for i in range(num_requests):
        prompt = (shared if rng.random() < 0.4 else []) + [
            rng.randrange(3, 90) for _ in range(rng.randint(1, 20))]
        params = dict(max_tokens=rng.randint(1, 20))
        if rng.random() < 0.3:
            params["stop_token_ids"] = [rng.randrange(3, 100)]
        requests.append(Request(f"r{i}", prompt, SamplingParams(**params), MAX_MODEL_LEN,
                                arrival_time=float(i)))
    return requests


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_speculating_requests_produce_reference_tokens_and_leave_the_pool_whole(method, k, tight):
    rng = random.Random(k)
    pool = dict(num_blocks=12, max_num_batched_tokens=16) if tight else dict(num_blocks=80)
    s = make_scheduler(max_model_len=MAX_MODEL_LEN, max_num_seqs=6,
                       speculative_config=spec_config(method, k), **pool)
    requests = workload(rng)
    expected = {r.request_id: reference_outputs(r.prompt_token_ids, r.sampling_params,
                                                MAX_MODEL_LEN) for r in requests}
    run = drive(s, requests, rng, lookup_proposer(rng, k) if method == "ngram" else None)
    assert run.outputs == expected
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
    stats = s.spec_decoding_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert all(len(spec) <= k for so in run.steps for spec in so.spec_token_ids.values())
    if tight:
        assert s.num_preemptions_total > 0


def test_rejected_proposals_roll_num_computed_tokens_back():
    s = make_scheduler(speculative_config=spec_config("ngram", 4))
    request = make_request("a", 5, max_tokens=20, ignore_eos=True)
    s.add_request(request)
    runner, run = runner_for(s), Run()
    step(s, runner, run)  # the prompt, and a first token
    tokens = list(request.all_token_ids)
    right = next_token(tokens)
    request.spec_token_ids = [right, next_token(tokens + [right]) + 1, 7, 7]
    so = step(s, runner, run)
    assert so.num_scheduled_tokens["a"] == 5 and so.spec_token_ids["a"][2:] == [7, 7]
    # One proposal accepted, then the model's own token: positions 5 and 6 are computed.
    assert request.output_token_ids[1:] == [right, next_token(tokens + [right])]
    assert request.num_computed_tokens == 7 == request.num_tokens - 1
    stats = s.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 1)


def test_proposals_never_take_a_request_past_max_tokens():
    s = make_scheduler(speculative_config=spec_config("ngram", 8))
    request = make_request("a", 5, max_tokens=4, ignore_eos=True)
    s.add_request(request)
    runner, run = runner_for(s), Run()
    step(s, runner, run)
    tokens = list(request.all_token_ids)
    perfect = []
    for _ in range(8):
        perfect.append(next_token(tokens + perfect))
    request.spec_token_ids = perfect
    so = step(s, runner, run)
    # Three tokens remain: two proposals plus the model's own token.
    assert so.spec_token_ids["a"] == perfect[:2]
    assert run.outputs["a"] == reference_outputs(request.prompt_token_ids, request.sampling_params, 128)
    assert len(run.outputs["a"]) == 4 and run.finish_reasons["a"] == "length"


def test_a_stop_token_inside_the_accepted_run_ends_the_output_there():
    probe = make_request("p", 5, max_tokens=10, ignore_eos=True)
    stop = reference_outputs(probe.prompt_token_ids, probe.sampling_params, 128)[3]
    s = make_scheduler(speculative_config=spec_config("ngram", 6))
    request = make_request("p", 5, max_tokens=10, ignore_eos=True, stop_token_ids=[stop])
    s.add_request(request)
    runner, run = runner_for(s), Run()
    step(s, runner, run)
    tokens, perfect = list(request.all_token_ids), []
    for _ in range(6):
        perfect.append(next_token(tokens + perfect))
    request.spec_token_ids = perfect
    step(s, runner, run)
    assert run.outputs["p"] == reference_outputs(request.prompt_token_ids,
                                                 request.sampling_params, 128)
    assert run.outputs["p"][-1] == stop and run.finish_reasons["p"] == "stop"
    assert not s.has_unfinished_requests()


def test_draft_model_slots_are_allocated_with_the_step_that_samples():
    s = make_scheduler(speculative_config=spec_config("draft_model", 5))
    request = make_request("a", 8, max_tokens=40, ignore_eos=True)
    s.add_request(request)
    so = s.schedule()
    assert so.num_lookahead_tokens == 5
    # 8 prompt tokens, the first sampled token at position 8, drafts written at 8..12.
    assert len(s.kv_cache_manager.get_block_ids("a")) * 8 >= 8 + 5


def test_no_draft_slots_past_the_last_token_a_request_can_keep():
    s = make_scheduler(speculative_config=spec_config("draft_model", 8), max_model_len=32)
    request = make_request("a", 15, max_tokens=2, ignore_eos=True, max_model_len=32)
    s.add_request(request)
    s.schedule()
    # 15 prompt tokens plus 2 outputs: the last output never needs a slot: 16 slots.
    assert len(s.kv_cache_manager.get_block_ids("a")) == 2


def test_a_batch_above_the_disable_size_does_not_speculate():
    s = make_scheduler(speculative_config=spec_config("draft_model", 3, disable_by_batch_size=2))
    runner, run = runner_for(s), Run()
    for i in range(3):
        s.add_request(make_request(f"r{i}", 6, max_tokens=12, ignore_eos=True))
    step(s, runner, run)  # planned with nobody running: it drafts
    so = step(s, runner, run)  # three running: nobody verifies or drafts
    assert so.num_lookahead_tokens == 0 and not so.spec_token_ids
    assert all(so.num_scheduled_tokens[f"r{i}"] == 1 for i in range(3))
    s.abort_requests(["r2"])
    step(s, runner, run)  # two running: drafts again
    so = step(s, runner, run)
    assert so.num_lookahead_tokens == 3 and set(so.spec_token_ids) == {"r0", "r1"}
