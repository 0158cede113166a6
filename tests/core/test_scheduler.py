"""Scheduler: token budget, chunked prefill, preemption, admission order, outputs.

Block size 8 (the smallest CacheConfig allows); a fake runner stands in for the model and
checks every step (see fake_runner.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.request import RequestStatus
from tests.core.fake_runner import reference_outputs
from tests.core.helpers import (
    Run,
    make_request,
    make_scheduler,
    run_to_completion,
    runner_for,
    step,
)


def expected(request, max_model_len: int = 128) -> list[int]:
    return reference_outputs(request.prompt_token_ids, request.sampling_params, max_model_len)


def new_req_ids(so) -> list[str]:
    return [n.request_id for n in so.scheduled_new_reqs]


# -- token budget and chunked prefill ---------------------------------------------------
def test_long_prompt_is_chunked_by_the_token_budget():
    s = make_scheduler(max_num_batched_tokens=32)
    s.add_request(make_request("long", 100, max_tokens=2))
    runner, run = runner_for(s), Run()
    chunks = [step(s, runner, run).num_scheduled_tokens["long"] for _ in range(4)]
    assert chunks == [32, 32, 32, 4]
    assert run.core_outputs[:3] == [[], [], []]  # nothing to report before the last chunk
    assert run.outputs["long"] == expected(make_request("long", 100, max_tokens=2))[:1]


def test_decodes_keep_running_while_a_long_prompt_is_chunked():
    s = make_scheduler(max_num_batched_tokens=32)
    s.add_request(make_request("short", 4, max_tokens=10))
    runner, run = runner_for(s), Run()
    step(s, runner, run)
    s.add_request(make_request("long", 100, max_tokens=1))
    plan = [step(s, runner, run).num_scheduled_tokens for _ in range(4)]
    assert plan == [{"short": 1, "long": 31}] * 3 + [{"short": 1, "long": 7}]
    assert len(run.outputs["short"]) == 5


def test_decodes_are_not_starved_by_a_stream_of_long_prompts():
    s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=16)
    decoder = make_request("decoder", 4, max_tokens=12)
    s.add_request(decoder)
    runner, run = runner_for(s), Run()
    for i in range(12):
        so = step(s, runner, run)
        if i > 0:
            assert so.num_scheduled_tokens["decoder"] == 1
        s.add_request(make_request(f"p{i}", 40, max_tokens=1))
    assert run.outputs["decoder"] == expected(decoder)
    assert run.finish_reasons["decoder"] == "length"


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_and_nobody_skips_it():
    s = make_scheduler(max_model_len=64, max_num_batched_tokens=64, chunked=False)
    s.add_request(make_request("a", 4, max_tokens=2, max_model_len=64))
    runner, run = runner_for(s), Run()
    first = step(s, runner, run)
    s.add_request(make_request("big", 64, max_model_len=64))  # 64 > 63 left after a's decode
    s.add_request(make_request("small", 4, max_tokens=1, max_model_len=64))
    plans = [first.num_scheduled_tokens] + [step(s, runner, run).num_scheduled_tokens
                                            for _ in range(3)]
    assert plans == [{"a": 4}, {"a": 1}, {"big": 64}, {"small": 4}]


def test_max_num_seqs_caps_the_running_requests():
    s = make_scheduler(max_num_seqs=2)
    requests = [make_request(f"r{i}", 8 + i, max_tokens=3) for i in range(5)]
    for r in requests:
        s.add_request(r)
    runner, run = runner_for(s), Run()
    while s.has_unfinished_requests():
        so = step(s, runner, run)
        assert len(so.num_scheduled_tokens) <= 2 and s.num_running <= 2
    assert run.outputs == {r.request_id: expected(r) for r in requests}
    assert [new_req_ids(so) for so in run.steps if so.scheduled_new_reqs][0] == ["r0", "r1"]


# -- preemption -------------------------------------------------------------------------
def test_preemption_takes_the_most_recently_admitted_request():
    s = make_scheduler(num_blocks=6, max_num_seqs=3)
    requests = [make_request(name, 16, max_tokens=4) for name in "ABCD"]
    for r in requests:
        s.add_request(r)
    runner, run = runner_for(s), Run()
    step(s, runner, run)  # A, B, C admitted: 2 full blocks each, pool full; D waits
    so = step(s, runner, run)  # A and B each need a third block
    assert so.preempted_req_ids == {"C"} and "C" not in so.finished_req_ids
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    c = requests[2]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.num_preemptions_total == 1
    assert s.num_preempted_tokens_total == 16  # its prompt, computed in the first step
    assert list(s.waiting) == [c, requests[3]]  # back at the front, ahead of D
    rest = run_to_completion(s, runner)
    for r in requests:
        assert run.outputs.get(r.request_id, []) + rest.outputs[r.request_id] == expected(r)


def test_preempted_request_resumes_with_all_its_tokens():
    s = make_scheduler(num_blocks=6)
    requests = [make_request(name, 16, max_tokens=4) for name in "ABC"]
    for r in requests:
        s.add_request(r)
    runner = runner_for(s)
    run = run_to_completion(s, runner)
    c = requests[2]
    resumed = [n for so in run.steps[1:] for n in so.scheduled_new_reqs if n.request_id == "C"]
    assert len(resumed) == 1
    first_token = expected(c)[0]
    assert resumed[0].token_ids == c.prompt_token_ids + [first_token]
    assert resumed[0].num_prompt_tokens == 16
    assert run.outputs["C"] == expected(c)


def test_a_request_preempts_itself_when_it_is_the_last_running_one():
    s = make_scheduler(num_blocks=5)
    a = make_request("A", 15, max_tokens=4)  # 16 tokens after one output: still 2 blocks
    b = make_request("B", 24, max_tokens=4)  # 25 tokens: needs a 4th block
    s.add_request(a)
    s.add_request(b)
    runner, run = runner_for(s), Run()
    step(s, runner, run)
    so = step(s, runner, run)
    assert so.preempted_req_ids == {"B"}
    assert so.num_scheduled_tokens == {"A": 1}
    rest = run_to_completion(s, runner)
    assert run.outputs["B"] + rest.outputs["B"] == expected(b)
    assert run.outputs["A"] + rest.outputs["A"] == expected(a)


def test_no_request_is_admitted_in_a_step_that_preempted():
    s = make_scheduler(num_blocks=6, policy="priority")
    for name in "ABC":
        s.add_request(make_request(name, 15 if name == "B" else 16, max_tokens=4))
    runner, run = runner_for(s), Run()
    step(s, runner, run)
    s.add_request(make_request("urgent", 4, max_tokens=1, priority=-1))
    so = step(s, runner, run)  # A preempts C; one block is left, but memory is short
    assert so.preempted_req_ids == {"C"}
    assert so.scheduled_new_reqs == []
    later = [rid for so in run_to_completion(s, runner).steps for rid in new_req_ids(so)]
    assert later == ["urgent", "C"]


# -- admission order --------------------------------------------------------------------
def admission_order(s) -> list[str]:
    run = run_to_completion(s, runner_for(s))
    return [rid for so in run.steps for rid in new_req_ids(so)]


def test_fcfs_admits_in_arrival_order():
    s = make_scheduler(max_num_seqs=1)
    for name in ("c", "a", "b"):
        s.add_request(make_request(name, 5, max_tokens=2))
    assert admission_order(s) == ["c", "a", "b"]


def test_priority_policy_admits_lower_priority_values_first_then_by_arrival():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    for name, priority, arrival in (("r1", 5, 1.0), ("r2", 1, 2.0), ("r3", 1, 3.0), ("r4", 3, 0.0)):
        s.add_request(make_request(name, 5, max_tokens=2, priority=priority, arrival_time=arrival))
    assert admission_order(s) == ["r2", "r3", "r4", "r1"]


# -- prefix caching through the scheduler -----------------------------------------------
def test_prefix_hits_skip_computed_tokens_and_are_reported():
    s = make_scheduler()
    shared = list(range(500, 520))
    s.add_request(make_request("first", shared, max_tokens=2))
    runner = runner_for(s)
    run_to_completion(s, runner)
    s.add_request(make_request("second", shared + [7, 8], max_tokens=2))
    run = Run()
    so = step(s, runner, run)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {"second": 6}
    assert run.core_outputs[0][0].num_cached_tokens == 16


def test_prompt_logprobs_request_skips_prefix_hits_and_gets_every_prompt_position():
    s = make_scheduler(max_num_batched_tokens=8)
    shared = list(range(500, 520))
    s.add_request(make_request("first", shared, max_tokens=1))
    runner = runner_for(s)
    run_to_completion(s, runner)
    s.add_request(make_request("logprobs", shared, max_tokens=1, prompt_logprobs=1))
    run = run_to_completion(s, runner)
    assert run.steps[0].scheduled_new_reqs[0].num_computed_tokens == 0
    assert sum(run.steps[i].num_scheduled_tokens["logprobs"] for i in range(3)) == 20
    entries = run.prompt_logprobs["logprobs"]
    assert len(entries) == 20 and entries[0] is None
    assert [e[0][0] for e in entries[1:]] == shared[1:]
    # The partial chunks reported prompt logprobs without tokens.
    assert [len(outs[0].new_token_ids) for outs in run.core_outputs] == [0, 0, 1]


def test_sampled_tokens_for_a_partial_prefill_chunk_are_dropped():
    s = make_scheduler(max_num_batched_tokens=8)
    r = make_request("r", 20)
    s.add_request(r)
    so = s.schedule()
    assert s.update_from_output(so, ModelRunnerOutput(["r"], [[42]])) == []
    assert r.output_token_ids == []


# -- outputs ----------------------------------------------------------------------------
def test_stop_token_finishes_with_stop_and_reports_it():
    probe = make_request("r", 6, max_tokens=8)
    stop_token = expected(probe)[2]
    s = make_scheduler()
    s.add_request(make_request("r", 6, max_tokens=8, stop_token_ids=[stop_token]))
    s.add_request(make_request("eos", probe.prompt_token_ids, max_tokens=8,
                               eos_token_ids=frozenset({stop_token})))
    s.add_request(make_request("len", 6, max_tokens=3))
    run = run_to_completion(s, runner_for(s))
    assert run.outputs["r"] == expected(probe)[:3]
    final = {o.request_id: o for outs in run.core_outputs for o in outs if o.finished}
    assert (final["r"].finish_reason, final["r"].stop_reason) == ("stop", stop_token)
    assert run.outputs["eos"] == expected(probe)[:3]
    assert (final["eos"].finish_reason, final["eos"].stop_reason) == ("stop", None)
    assert final["len"].finish_reason == "length" and len(run.outputs["len"]) == 3


def test_sampled_logprobs_are_carried_into_outputs():
    s = make_scheduler()
    s.add_request(make_request("r", 6, max_tokens=3, logprobs=1))
    run = run_to_completion(s, runner_for(s))
    for outs in run.core_outputs:
        for out in outs:
            assert out.new_logprobs == [([t], [-0.5], 1) for t in out.new_token_ids]


# -- aborts and bookkeeping -------------------------------------------------------------
def test_abort_frees_blocks_at_once_and_tells_the_runner_next_step():
    s = make_scheduler(num_blocks=10, max_num_seqs=1)
    running, waiting = make_request("running", 20), make_request("waiting", 4, max_tokens=1)
    s.add_request(running)
    s.add_request(waiting)
    runner, run = runner_for(s), Run()
    step(s, runner, run)
    assert s.kv_cache_usage == pytest.approx(0.3)
    s.abort_requests(["running", "unknown"])
    assert s.kv_cache_manager.num_free_blocks == 10 and s.num_running == 0
    assert running.status == RequestStatus.FINISHED_ABORTED
    so = step(s, runner, run)
    assert "running" in so.finished_req_ids and new_req_ids(so) == ["waiting"]
    assert all(o.request_id != "running" for o in run.core_outputs[-1])


def test_abort_of_a_waiting_request_and_between_schedule_and_update():
    s = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 4, max_tokens=5), make_request("b", 4)
    s.add_request(a)
    s.add_request(b)
    s.abort_requests("b")
    assert s.num_waiting == 1 and s.get_num_unfinished_requests() == 1
    runner = runner_for(s)
    so = s.schedule()
    mro = runner.execute_model(so)
    s.abort_requests("a", RequestStatus.FINISHED_STOPPED)
    assert s.update_from_output(so, mro) == []
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
    with pytest.raises(ValueError, match="status"):
        s.abort_requests("a", RequestStatus.RUNNING)


def test_pool_returns_to_full_after_all_requests_finish():
    s = make_scheduler(num_blocks=20, max_num_batched_tokens=24)
    shared = list(range(300, 316))
    requests = [make_request(f"r{i}", shared[: 4 + 3 * i] + [i] * (i % 5), max_tokens=2 + i % 4)
                for i in range(8)]
    for r in requests:
        s.add_request(r)
    assert (s.num_waiting, s.num_running, s.get_num_unfinished_requests()) == (8, 0, 8)
    run = run_to_completion(s, runner_for(s))
    assert run.outputs == {r.request_id: expected(r) for r in requests}
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and s.kv_cache_usage == 0.0
    assert (s.num_waiting, s.num_running, s.has_unfinished_requests()) == (0, 0, False)
    assert kv.prefix_cache_stats.hits > 0


def test_add_request_refuses_what_could_never_run():
    s = make_scheduler(num_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match="max-model-len"):
        s.add_request(make_request("long", 65, max_model_len=128))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request(make_request("grows", 30, max_tokens=10, max_model_len=64))
    s.add_request(make_request("ok", 30, max_tokens=3, max_model_len=64))
    with pytest.raises(ValueError, match="unique id"):
        s.add_request(make_request("ok", 4, max_model_len=64))


def test_request_built_for_a_longer_context_stops_at_the_engine_max_model_len():
    s = make_scheduler(max_model_len=32)
    r = make_request("r", 30, max_tokens=10, max_model_len=4096)
    s.add_request(r)
    run = run_to_completion(s, runner_for(s))
    assert len(run.outputs["r"]) == 2 and run.finish_reasons["r"] == "length"


# -- purity -----------------------------------------------------------------------------
def test_core_imports_no_torch_and_hashes_are_stable_across_processes():
    code = (
        "import sys\n"
        "import pagedllm.core.scheduler, pagedllm.core.kv_cache as kv\n"
        "assert 'torch' not in sys.modules, 'the core imported torch'\n"
        "print(kv.hash_block_tokens(None, (1, 2, 3), ('salt',)).value.hex())\n"
    )
    root = Path(__file__).resolve().parents[2]
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                           env={**os.environ, "PYTHONHASHSEED": seed}) for seed in ("1", "2")]
    for out in outs:
        assert out.returncode == 0, out.stderr
    assert outs[0].stdout == outs[1].stdout != ""
