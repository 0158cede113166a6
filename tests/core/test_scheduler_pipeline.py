"""Pipeline parallelism in the scheduler: M steps in flight run on disjoint micro-batches
of at most ceil(max_num_seqs / M) requests, and every request still ends with the tokens
it produces alone."""

from __future__ import annotations

from collections import deque

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from tests.core.fake_runner import reference_outputs
from tests.core.helpers import Run, check_pool_invariants, make_request, runner_for


def test_steps_in_flight_take_disjoint_micro_batches_and_keep_every_token() -> None:
    stages, max_num_seqs = 2, 8
    config = SchedulerConfig(max_model_len=128, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=64, pipeline_parallel_size=stages)
    scheduler = Scheduler(config, CacheConfig(block_size=8), 64)
    runner = runner_for(scheduler)
    requests = [make_request(f"r{i}", 5 + i, max_tokens=6 + i % 3) for i in range(10)]
    for request in requests:
        scheduler.add_request(request)
    run, in_flight, sizes, overlapped = Run(), deque(), [], 0
    while scheduler.has_unfinished_requests() or in_flight:
        if len(in_flight) == stages:
            run.record(scheduler.update_from_output(*in_flight.popleft()))
        so = scheduler.schedule()
        if so.is_empty:
            assert in_flight, "nothing in flight and nothing scheduled"
            run.record(scheduler.update_from_output(*in_flight.popleft()))
            continue
        busy = {r for step, _ in in_flight for r in step.num_scheduled_tokens}
        assert not busy & set(so.num_scheduled_tokens), "a request in two steps in flight"
        overlapped += bool(in_flight)
        sizes.append(len(so.num_scheduled_tokens))
        in_flight.append((so, runner.execute_model(so)))
        check_pool_invariants(scheduler.kv_cache_manager)
        assert len(sizes) < 1000, "the scheduler does not make progress"
    assert max(sizes) <= -(-max_num_seqs // stages)
    assert overlapped > len(sizes) // 2  # most steps ran beside another
    for request in requests:
        assert run.outputs[request.request_id] == reference_outputs(
            request.prompt_token_ids, request.sampling_params, 128)
