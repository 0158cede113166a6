"""Randomized workloads under tight budgets and pools: the master test at the core level.

Whatever the chunking, caching, admission policy, preemption, aborts or asynchronous
scheduling, every request must end with exactly the tokens it would produce alone, the fake runner must read correct K/V
for every context position at every step, and the pool must be whole at the end.
"""

from __future__ import annotations

import os
import random

import pytest

from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.fake_runner import reference_outputs
from tests.core.helpers import AsyncStepper, Run, make_scheduler, runner_for, step

MAX_MODEL_LEN = 64
# Workloads per config; each of the first DEFAULT_SEEDS exercises its config's paths
# (preemption, swapping, cache hits). ``PAGEDLLM_SIMULATION_SEEDS=600`` runs the long soak.
DEFAULT_SEEDS = 8
NUM_SEEDS = int(os.environ.get("PAGEDLLM_SIMULATION_SEEDS", DEFAULT_SEEDS))

CONFIGS = {
    "chunked-cached-tight": dict(chunked=True, caching=True, num_blocks=12,
                                 max_num_batched_tokens=16),
    "chunked-uncached-tight": dict(chunked=True, caching=False, num_blocks=12,
                                   max_num_batched_tokens=16),
    "whole-prompt-cached-tight": dict(chunked=False, caching=True, num_blocks=14,
                                      max_num_batched_tokens=64),
    "whole-prompt-uncached": dict(chunked=False, caching=False, num_blocks=14,
                                  max_num_batched_tokens=64),
    "priority-cached-tight": dict(chunked=True, caching=True, num_blocks=12,
                                  max_num_batched_tokens=24, policy="priority"),
    "roomy": dict(chunked=True, caching=True, num_blocks=80, max_num_batched_tokens=2048),
    # Preemption swaps out while 6 host blocks last, else recomputes.
    "chunked-cached-swap-tight": dict(chunked=True, caching=True, num_blocks=12,
                                      max_num_batched_tokens=16, num_host_blocks=6),
    "whole-prompt-uncached-swap": dict(chunked=False, caching=False, num_blocks=12,
                                       max_num_batched_tokens=64, num_host_blocks=6),
}


def make_workload(rng: random.Random, num_requests: int = 24) -> list[Request]:
    system_prompts = [[], list(range(200, 208)), list(range(300, 316))]
    requests = []
    for i in range(num_requests):
        suffix = [rng.randrange(3, 90) for _ in range(rng.randint(1, 24))]
        prompt = rng.choice(system_prompts) + suffix
        params = dict(max_tokens=rng.randint(1, 12))
        if rng.random() < 0.2:
            params["stop_token_ids"] = [rng.randrange(3, 100)]
        if rng.random() < 0.15:
            params["prompt_logprobs"] = 1
        requests.append(Request(f"r{i}", prompt, SamplingParams(**params), MAX_MODEL_LEN,
                                arrival_time=float(i), priority=rng.randint(0, 2)))
    return requests


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_random_workload_produces_reference_tokens_and_leaves_the_pool_whole(
    config, seed, asynchronous
):
    rng = random.Random(seed)
    s = make_scheduler(max_model_len=MAX_MODEL_LEN, max_num_seqs=6, **CONFIGS[config])
    runner, run = runner_for(s), Run()
    stepper = AsyncStepper(s, runner, run) if asynchronous else None
    pending = make_workload(rng)
    expected = {
        r.request_id: reference_outputs(r.prompt_token_ids, r.sampling_params, MAX_MODEL_LEN)
        for r in pending
    }
    prompt_logprobs = {r.request_id: r.prompt_token_ids for r in pending
                       if r.sampling_params.prompt_logprobs is not None}
    aborted: set[str] = set()
    while pending or s.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):  # requests keep arriving while others run
            if pending:
                s.add_request(pending.pop(0))
        if rng.random() < 0.05 and s.requests:
            victim = rng.choice(sorted(s.requests))
            s.abort_requests([victim])
            aborted.add(victim)
        if stepper is not None:
            if s.has_unfinished_requests() or stepper.in_flight is not None:
                stepper.step()
            assert s.num_running <= 6
        elif s.has_unfinished_requests():
            assert not step(s, runner, run).is_empty
            assert s.num_running <= 6
        assert len(run.steps) < 3000

    for req_id, tokens in expected.items():
        got = run.outputs.get(req_id, [])
        if req_id in aborted:
            assert got == tokens[:len(got)]
        else:
            assert got == tokens, req_id
            assert run.finish_reasons[req_id] in ("stop", "length")
            if req_id in prompt_logprobs:  # every prompt position once, preempted or not
                prompt = prompt_logprobs[req_id]
                want = [None] + [([t], [-1.0], 1) for t in prompt[1:]]
                assert run.prompt_logprobs[req_id] == want, req_id
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.req_to_blocks == {}
    if kv.host_pool is not None:
        assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks
        # The runner learns of an abort at the next step; one after the last step leaves its
        # swapped-out K/V there, the host blocks free all the same.
        assert set(runner.host) == {block for req_id in aborted
                                    for block in runner.host_owner.get(req_id, ())}
    if seed < DEFAULT_SEEDS:  # the paths the config is there for were taken
        if config.endswith("tight"):
            assert s.num_preemptions_total > 0
            assert kv.host_pool is None or s.num_swapped_tokens_total > 0
        if CONFIGS[config]["caching"]:
            assert kv.prefix_cache_stats.hits > 0
