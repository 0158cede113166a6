"""``pagedllm bench overhead``: the CPU cost of one engine step outside the model.

Times, per decode step with ``--num-requests`` running requests: ``Scheduler.schedule()``,
the runner's input preparation (``InputBatch.update`` + ``prepare``, the host side of
building the flat batch) and ``Scheduler.update_from_output()``. The forward pass is
replaced by a fixed sampled token, so only the engine's own bookkeeping is measured.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm.benchmarks.common import result_record, write_json
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--output-json", default=None)


def measure(num_requests: int, prompt_len: int, steps: int, block_size: int = 16) -> dict:
    max_model_len = prompt_len + steps + 64
    sched_config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=num_requests,
                                   max_num_batched_tokens=max(8192, num_requests))
    cache_config = CacheConfig(block_size=block_size)
    blocks_per_req = -(-max_model_len // block_size)
    scheduler = Scheduler(sched_config, cache_config, num_requests * blocks_per_req + 16)
    batch = InputBatch(num_requests, max_model_len, block_size)
    params = SamplingParams(max_tokens=steps + 32, ignore_eos=True, temperature=0.0)
    for i in range(num_requests):
        prompt = [(i * 7 + j) % 1000 for j in range(prompt_len)]
        scheduler.add_request(Request(str(i), prompt, params, max_model_len=max_model_len))

    def one_step() -> tuple[float, float, float, int]:
        t0 = time.perf_counter()
        so = scheduler.schedule()
        t1 = time.perf_counter()
        batch.update(so)
        inputs = batch.prepare(so.num_scheduled_tokens)
        sampled = [[] for _ in inputs.req_ids]
        for i in inputs.sample_req_indices:
            batch.append_token(inputs.states[i], 1)
            sampled[i] = [1]
        t2 = time.perf_counter()
        scheduler.update_from_output(so, ModelRunnerOutput(inputs.req_ids, sampled))
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, inputs.num_tokens

    # Prefill everything first, so the timed steps are pure decode with all requests running.
    while True:
        *_, num_tokens = one_step()
        if num_tokens == num_requests:
            break
    timings = [one_step() for _ in range(steps)]
    sched_ms = statistics.median(t[0] for t in timings) * 1e3
    prep_ms = statistics.median(t[1] for t in timings) * 1e3
    update_ms = statistics.median(t[2] for t in timings) * 1e3
    total_ms = statistics.median(sum(t[:3]) for t in timings) * 1e3
    return {"num_requests": num_requests, "schedule_ms": round(sched_ms, 4),
            "prepare_inputs_ms": round(prep_ms, 4), "update_ms": round(update_ms, 4),
            "step_total_ms": round(total_ms, 4)}


def run(args: argparse.Namespace) -> dict:
    numbers = measure(args.num_requests, args.prompt_len, args.steps, args.block_size)
    record = result_record(workload="engine_overhead", **numbers)
    print(f"{'running':>8} {'schedule ms':>12} {'prepare ms':>11} {'update ms':>10} {'total ms':>9}")
    print(f"{numbers['num_requests']:>8} {numbers['schedule_ms']:>12.3f} "
          f"{numbers['prepare_inputs_ms']:>11.3f} {numbers['update_ms']:>10.3f} "
          f"{numbers['step_total_ms']:>9.3f}   (medians over {args.steps} decode steps)")
    write_json(args.output_json, record)
    return record
