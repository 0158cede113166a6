"""What the engine core sends the API process each step survives the trip intact."""

from __future__ import annotations

import pickle
from dataclasses import fields

from pagedllm.core.outputs import EngineCoreOutput, SchedulerStats
from pagedllm.engine.core_process import StepResult


def test_a_step_result_round_trips_every_output_field():
    full = EngineCoreOutput(
        request_id="cmpl-1-0", new_token_ids=[5, 6], new_logprobs=[([5, 9], [-0.1, -2.5], 1)],
        new_prompt_logprobs=[None, ([3], [-1.0], 1)], finish_reason="stop", stop_reason="\n",
        num_cached_tokens=16)
    # Every field differs from its default, so a field the packing dropped would show.
    assert all(getattr(full, f.name) != f.default for f in fields(EngineCoreOutput))
    result = StepResult([full, EngineCoreOutput("cmpl-2-0", [7])], SchedulerStats(1, 0, 0.5, 32, 16, 0),
                        queue_times=[0.25], num_running=1)
    assert pickle.loads(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)) == result


def test_a_request_round_trips_with_its_prompt_and_outputs():
    from pagedllm.core.request import Request
    from pagedllm.sampling_params import SamplingParams

    request = Request("cmpl-1-0", [3, 1, 4, 1, 5], SamplingParams(max_tokens=8, seed=7),
                      max_model_len=64, arrival_time=12.5, priority=2, cache_salt="tenant")
    request.append_output_token(9)
    request.append_output_token(2)
    copy = pickle.loads(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
    for name in Request.__slots__:
        assert getattr(copy, name) == getattr(request, name), name
    assert copy.all_token_ids == [3, 1, 4, 1, 5, 9, 2]
    copy.append_output_token(6)  # the lists are the copy's own
    assert request.all_token_ids == [3, 1, 4, 1, 5, 9, 2] and request.output_token_ids == [9, 2]
