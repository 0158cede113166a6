"""Preemption by swapping (``num_host_blocks``): a preempted request's KV moves to host
blocks and back, so it resumes with its computed tokens instead of computing them again;
without room on the host it recomputes, as without host blocks."""

from __future__ import annotations

from pagedllm.core.kv_cache import HostBlockPool
from pagedllm.core.request import RequestStatus
from tests.core.helpers import Run, make_request, make_scheduler, run_to_completion, runner_for, step
from tests.core.test_scheduler import expected


def test_host_blocks_are_handed_out_as_contiguous_runs_and_merge_when_freed():
    pool = HostBlockPool(10)
    assert [pool.allocate(n) for n in (3, 3, 3)] == [0, 3, 6]
    assert pool.allocate(2) is None and pool.num_free_blocks == 1
    pool.free(3, 3)
    assert pool.allocate(4) is None  # 3 + 1 free, but not side by side
    pool.free(0, 3)  # merges with 3..5: a run of 6
    assert pool.allocate(5) == 0 and pool.num_free_blocks == 2
    pool.free(6, 3)
    pool.free(0, 5)
    assert pool.num_free_blocks == 10 and pool.allocate(10) == 0


def _three_running_and_one_waiting(num_host_blocks: int):
    s = make_scheduler(num_blocks=6, max_num_seqs=3, num_host_blocks=num_host_blocks)
    requests = [make_request(name, 16, max_tokens=4) for name in "ABCD"]
    for r in requests:
        s.add_request(r)
    runner, run = runner_for(s), Run()
    step(s, runner, run)  # A, B, C admitted: 2 full blocks each, pool full; D waits
    return s, requests, runner, run


def test_a_preempted_request_is_swapped_out_and_resumes_with_its_computed_tokens():
    s, requests, runner, run = _three_running_and_one_waiting(num_host_blocks=4)
    c = requests[2]
    c_blocks = s.kv_cache_manager.get_block_ids("C")
    so = step(s, runner, run)  # A and B each need a third block: C is preempted
    assert so.preempted_req_ids == {"C"}
    assert so.blocks_to_swap_out == [(0, c_blocks)]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 16
    assert (s.num_swapped_tokens_total, s.num_preempted_tokens_total) == (16, 0)
    rest = run_to_completion(s, runner)
    resumed = [(so, new) for so in rest.steps for new in so.scheduled_new_reqs
               if new.request_id == "C"]
    assert len(resumed) == 1
    so, new = resumed[0]
    # Back with its prompt's KV copied in: only its first sampled token is computed.
    assert new.num_computed_tokens == 16 and so.num_scheduled_tokens["C"] == 1
    assert so.blocks_to_swap_in == [(0, new.block_ids[:2])]
    for r in requests:
        assert run.outputs.get(r.request_id, []) + rest.outputs[r.request_id] == expected(r)
    host = s.kv_cache_manager.host_pool
    assert host.num_free_blocks == host.num_blocks and runner.host == {}


def test_without_room_on_the_host_a_preempted_request_recomputes():
    s, requests, runner, run = _three_running_and_one_waiting(num_host_blocks=1)
    so = step(s, runner, run)
    assert so.preempted_req_ids == {"C"} and so.blocks_to_swap_out == []
    assert requests[2].num_computed_tokens == 0
    assert (s.num_swapped_tokens_total, s.num_preempted_tokens_total) == (0, 16)
    rest = run_to_completion(s, runner)
    for r in requests:
        assert run.outputs.get(r.request_id, []) + rest.outputs[r.request_id] == expected(r)


def test_an_aborted_swapped_out_request_gives_its_host_blocks_back():
    s, requests, runner, run = _three_running_and_one_waiting(num_host_blocks=4)
    step(s, runner, run)
    host = s.kv_cache_manager.host_pool
    assert host.num_free_blocks == 2
    s.abort_requests("C")
    assert host.num_free_blocks == 4
    run_to_completion(s, runner)
