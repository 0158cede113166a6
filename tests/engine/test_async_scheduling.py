"""Asynchronous scheduling changes when the host works, never what a user gets back.

The greedy-equals-HF tests run in both modes (test_greedy_matches_hf.py); these cover
what greedy decoding does not: seeded sampling, stop tokens, ``min_tokens``, penalties,
logprobs and aborts, each compared with the synchronous engine on the same requests.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from tests.engine.conftest import random_prompts


def make_llm(tiny_model_dir, async_scheduling: bool, **kwargs) -> LLM:
    return LLM(str(tiny_model_dir), block_size=8, max_model_len=64,
               async_scheduling=async_scheduling, **kwargs)


def generate(llm: LLM, prompts, params):
    """Per request, per completion: (token ids, finish reason, stop reason, logprobs as
    (token id, rank, logprob) triples per position, or None)."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason, None if c.logprobs is None else [
        sorted((t, lp.rank, lp.logprob) for t, lp in position.items()) for position in c.logprobs
    ]) for c in o.outputs] for o in outputs]


def assert_same_outputs(got, want) -> None:
    """Equal tokens and reasons; logprobs equal up to float rounding (batches differ)."""
    assert [[c[:3] for c in r] for r in got] == [[c[:3] for c in r] for r in want]
    for got_request, want_request in zip(got, want):
        for got_completion, want_completion in zip(got_request, want_request):
            got_logprobs, want_logprobs = got_completion[3], want_completion[3]
            assert (got_logprobs is None) == (want_logprobs is None)
            for g, w in zip(got_logprobs or [], want_logprobs or []):
                assert [t[:2] for t in g] == [t[:2] for t in w]
                assert [t[2] for t in g] == pytest.approx([t[2] for t in w], abs=1e-4)


def mixed_params(greedy_run: list[list[int]]) -> list[SamplingParams]:
    """Seeded sampling, stop tokens met early, min_tokens, penalties and logprobs."""
    return [
        SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[greedy_run[1][3]]),
        SamplingParams(temperature=0.8, seed=5, top_k=20, max_tokens=10, min_tokens=6,
                       stop_token_ids=[greedy_run[2][1]]),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, repetition_penalty=1.5,
                       frequency_penalty=0.3),
        SamplingParams(temperature=0.7, seed=3, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=8, n=2, max_tokens=7, ignore_eos=True),
    ]


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_async_outputs_equal_sync_outputs_for_every_sampling_feature(tiny_model_dir, tight):
    prompts = random_prompts(6, 3, 30, seed=4)
    kv = dict(num_kv_blocks=8, enable_prefix_caching=False) if tight else {}
    sync = make_llm(tiny_model_dir, False, **kv)
    greedy_run = [c[0][0] for c in generate(
        sync, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    params = mixed_params(greedy_run)
    want = generate(sync, prompts, params)
    asynchronous = make_llm(tiny_model_dir, True, **kv)
    assert_same_outputs(generate(asynchronous, prompts, params), want)
    # The stop tokens and min_tokens really ended requests early.
    assert want[1][0][1] == "stop" and len(want[1][0][0]) <= 4
    if tight:
        assert asynchronous.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    scheduler = asynchronous.llm_engine.engine_core.scheduler
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_async_computes_no_token_past_max_tokens(tiny_model_dir):
    """With EOS ignored, the step in flight never runs a request beyond its max_tokens: the
    engine computes exactly the tokens the synchronous one does."""
    prompts = random_prompts(5, 3, 30, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(5)]
    computed = {}
    for mode in (False, True):
        llm = make_llm(tiny_model_dir, mode)
        runner = llm.llm_engine.engine_core.model_runner
        launch = runner.execute_model_async
        total = [0]

        def counting(so, *args, launch=launch, total=total):
            total[0] += so.total_num_scheduled_tokens
            return launch(so, *args)

        runner.execute_model_async = counting
        generate(llm, prompts, params)
        computed[mode] = total[0]
    assert computed[True] == computed[False]


def test_abort_with_a_step_in_flight_leaves_the_others_exact(tiny_model_dir):
    prompts = random_prompts(3, 5, 20, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = [c[0][0] for c in generate(make_llm(tiny_model_dir, False), prompts, params)]

    engine = make_llm(tiny_model_dir, True).llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finished = {}
    for step in range(40):
        if step == 4:
            engine.abort_request(["1"])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert finished == {"0": want[0], "2": want[2]}
    scheduler = engine.engine_core.scheduler
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_async_scheduling_defaults_to_the_device(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA config on any host

    def resolved(**kwargs) -> bool:
        config = EngineArgs(model=str(tiny_model_dir), **kwargs).create_engine_config()
        return config.scheduler_config.async_scheduling

    assert resolved(device="cpu") is False
    assert resolved(device="cuda") is True
    assert resolved(device="cuda", async_scheduling=False) is False
    assert resolved(device="cpu", async_scheduling=True) is True


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_and_aborts_leave_every_other_request_exact(tiny_model_dir, seed):
    """Requests arrive while others run, some are aborted mid-flight, the KV cache is small
    enough to preempt: every request that finishes has exactly the synchronous engine's
    tokens (greedy ones and seeded samples alike), and the pool ends whole."""
    import random

    rng = random.Random(seed)
    prompts = random_prompts(10, 3, 28, seed=40 + seed)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 14), ignore_eos=True)
              if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randint(2, 14), ignore_eos=True)
              for i in range(len(prompts))]
    want = [c[0][0] for c in generate(make_llm(tiny_model_dir, False), prompts, params)]

    llm = make_llm(tiny_model_dir, True, num_kv_blocks=9, max_num_batched_tokens=12,
                   enable_prefix_caching=False)
    engine = llm.llm_engine
    pending = list(range(len(prompts)))
    aborted, finished = set(), {}
    for _ in range(500):
        for _ in range(rng.randint(0, 2)):
            if pending:
                i = pending.pop(0)
                engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params[i])
        if rng.random() < 0.08:
            running = [r for r in map(str, range(len(prompts)))
                       if r not in finished and r not in aborted and int(r) not in pending]
            if running:
                victim = rng.choice(running)
                engine.abort_request([victim])
                aborted.add(victim)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if not pending and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    for req_id, tokens in finished.items():
        assert tokens == want[int(req_id)], req_id
    assert set(finished) | aborted == {str(i) for i in range(len(prompts))}
    scheduler = engine.engine_core.scheduler
    assert scheduler.num_preemptions_total > 0
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
