"""``pagedllm bench overhead``: the CPU cost of one engine step outside the model.

Times, per decode step with ``--num-requests`` running requests: ``Scheduler.schedule()``,
the runner's input preparation (``InputBatch.update`` + ``prepare``, the host side of
building the flat batch) and ``Scheduler.update_from_output()``. The forward pass is
replaced by a fixed sampled token, so only the engine's own bookkeeping is measured.

With ``--penalties`` every request has repetition and frequency penalties, and each step
also times the sampler's metadata for them, side by side: from the token counts kept
across steps (``TokenCounts``, what the runner does) and built afresh from the token
lists. The tensors live on the CPU here, so vocabulary-sized copies count too: a small
``--vocab-size`` leaves mostly the host's part.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.benchmarks.common import result_record, write_json
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.outputs import ModelRunnerOutput
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.layers.sampler import RowCounts, SamplingMetadata, TokenCounts
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=256,
                        help="Requests running in every timed step.")
    parser.add_argument("--prompt-len", type=int, default=512, help="Prompt tokens per request.")
    parser.add_argument("--steps", type=int, default=200,
                        help="Timed decode steps (medians are reported).")
    parser.add_argument("--block-size", type=int, default=16, help="Tokens per KV cache block.")
    parser.add_argument("--penalties", action="store_true",
                        help="Penalised requests; also time their sampling metadata.")
    parser.add_argument("--vocab-size", type=int, default=1024,
                        help="Vocabulary of the penalty tensors (with --penalties).")
    parser.add_argument("--output-json", default=None, help="Write the result record here.")


def measure(num_requests: int, prompt_len: int, steps: int, block_size: int = 16,
            penalties: bool = False, vocab_size: int = 1024) -> dict:
    max_model_len = prompt_len + steps + 64
    sched_config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=num_requests,
                                   max_num_batched_tokens=max(8192, num_requests))
    cache_config = CacheConfig(block_size=block_size)
    blocks_per_req = -(-max_model_len // block_size)
    scheduler = Scheduler(sched_config, cache_config, num_requests * blocks_per_req + 16)
    batch = InputBatch(num_requests, max_model_len, block_size)
    params = SamplingParams(max_tokens=steps + 32, ignore_eos=True, temperature=0.0,
                            **(dict(repetition_penalty=1.1, frequency_penalty=0.1) if penalties else {}))
    counts = TokenCounts(num_requests, vocab_size, "cpu") if penalties else None
    for i in range(num_requests):
        prompt = [(i * 7 + j) % min(1000, vocab_size) for j in range(prompt_len)]
        scheduler.add_request(Request(str(i), prompt, params, max_model_len=max_model_len))

    def penalty_metadata(states: list) -> tuple[float, float]:
        """Seconds to build the penalties' metadata for ``states``: kept, then afresh."""
        lists = dict(params=[s.sampling_params for s in states],
                     prompt_token_ids=[s.prompt_token_ids for s in states],
                     output_token_ids=[s.output_token_ids for s in states],
                     generators=[None] * len(states), vocab_size=vocab_size, device="cpu")
        t0 = time.perf_counter()
        meta = SamplingMetadata.build(**lists, counts=RowCounts(counts, [s.row for s in states], states))
        meta.record_sampled(torch.ones(len(states), dtype=torch.long))
        t1 = time.perf_counter()
        SamplingMetadata.build(**lists)
        return t1 - t0, time.perf_counter() - t1

    def one_step() -> tuple[float, ...]:
        t0 = time.perf_counter()
        so = scheduler.schedule()
        t1 = time.perf_counter()
        batch.update(so)
        inputs = batch.prepare(so.num_scheduled_tokens)
        t2 = time.perf_counter()
        kept = fresh = 0.0
        if penalties and inputs.sample_req_indices:
            kept, fresh = penalty_metadata([inputs.states[i] for i in inputs.sample_req_indices])
        t3 = time.perf_counter()
        sampled = [[] for _ in inputs.req_ids]
        for i in inputs.sample_req_indices:
            batch.append_token(inputs.states[i], 1)
            sampled[i] = [1]
        prep = (t2 - t1) + (time.perf_counter() - t3)
        t4 = time.perf_counter()
        scheduler.update_from_output(so, ModelRunnerOutput(inputs.req_ids, sampled))
        t5 = time.perf_counter()
        return t1 - t0, prep, t5 - t4, inputs.num_tokens, kept, fresh

    # Prefill everything first, so the timed steps are pure decode with all requests running.
    while True:
        num_tokens = one_step()[3]
        if num_tokens == num_requests:
            break
    timings = [one_step() for _ in range(steps)]

    def median_ms(values) -> float:
        return round(statistics.median(values) * 1e3, 4)

    record = {"num_requests": num_requests,
              "schedule_ms": median_ms(t[0] for t in timings),
              "prepare_inputs_ms": median_ms(t[1] for t in timings),
              "update_ms": median_ms(t[2] for t in timings),
              "step_total_ms": median_ms(sum(t[:3]) for t in timings)}
    if penalties:
        record.update(vocab_size=vocab_size,
                      penalty_metadata_kept_ms=median_ms(t[4] for t in timings),
                      penalty_metadata_afresh_ms=median_ms(t[5] for t in timings))
    return record


def run(args: argparse.Namespace) -> dict:
    numbers = measure(args.num_requests, args.prompt_len, args.steps, args.block_size,
                      args.penalties, args.vocab_size)
    record = result_record(workload="engine_overhead", **numbers)
    print(f"{'running':>8} {'schedule ms':>12} {'prepare ms':>11} {'update ms':>10} {'total ms':>9}")
    print(f"{numbers['num_requests']:>8} {numbers['schedule_ms']:>12.3f} "
          f"{numbers['prepare_inputs_ms']:>11.3f} {numbers['update_ms']:>10.3f} "
          f"{numbers['step_total_ms']:>9.3f}   (medians over {args.steps} decode steps)")
    if args.penalties:
        print(f"penalty metadata per step (vocab {args.vocab_size}): "
              f"{numbers['penalty_metadata_kept_ms']:.3f} ms from the kept counts, "
              f"{numbers['penalty_metadata_afresh_ms']:.3f} ms built afresh")
    write_json(args.output_json, record)
    return record
