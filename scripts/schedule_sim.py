#!/usr/bin/env python3
"""The engine's scheduler on fixed-length workloads, without a model: how long a shape
would take under a step-time model, and what its preemptions cost, for one admission
policy or another. It weighs scheduling choices (the batch limit, the cache size,
admission that reserves room for growth) before any GPU time is spent on them.

    python scripts/schedule_sim.py --shapes 500/2000x1500,2048/2048x750 \
        [--policy engine,reserve,full] [--kv-tokens 971856] [--max-num-seqs 512]

Each step the real ``Scheduler`` plans is charged ``STEP_MS + ROW_US * decoding rows +
CONTEXT_US * (context tokens of every scheduled request) / 1000 + PROMPT_US * prompt
tokens``; the sampled token of every request that samples is fed back, and requests stop
at their output length. The defaults fit Llama-3.1-8B with FP8 weights and cache on one
H100 (TensorRT-LLM's shapes at half their request counts: 99.4, 185.5, 189.3 and 74.9 s
for 1000/1000, 500/2000, 2048/2048 and 128/128 against 102.4, 183.7, 185.9 and 76.1
measured; docs/benchmarks.md). Policies:

- ``engine``: the scheduler as it is (greedy admission, the most recent request
  preempted and recomputed when the cache runs out).
- ``reserve``: a request is admitted only while the free cache covers its prompt and the
  remaining ``max_tokens`` of every running request times a ratio that starts at
  ``--reserve-ratio``, falls to a tenth over 600 steps, and is raised after a preemption
  (SGLang's estimate of running requests' growth).
- ``full``: the same with the ratio held at 1: every request's whole ``max_tokens`` is
  reserved, so nothing is ever preempted (TensorRT-LLM's default, "guaranteed no evict").
- ``swap``: the engine with ``--swap-space --swap-gib`` (default 64): a preempted request's
  cache goes to host blocks and comes back instead of being computed again (while a run of
  host blocks is free; else it recomputes); the blocks a step's copies move
  (``SchedulerOutput.blocks_to_swap_out/in``) are charged ``--kv-bytes-per-token`` a token
  at ``--swap-gb-s``, on the step, not overlapped.

Prints, per shape and policy: simulated seconds, output tok/s, steps, prompt tokens
computed (recomputation included), preemptions, and the median time to first token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.config import CacheConfig, SchedulerConfig  # noqa: E402
from pagedllm.core.outputs import ModelRunnerOutput  # noqa: E402
from pagedllm.core.request import Request  # noqa: E402
from pagedllm.core.scheduler import Scheduler  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

STEP_MS, ROW_US, CONTEXT_US, PROMPT_US = 8.7, 4.3, 20.0, 13.5
# Llama-3.1-8B's KV cache in FP8: 32 layers x 8 KV heads x 128 x (key, value) bytes.
KV_BYTES_PER_TOKEN = 65_536
RESERVE_FLOOR, RESERVE_DECAY_STEPS, RESERVE_CLIP = 0.1, 600, 4096
SAMPLED_TOKEN = 7


class ReservingScheduler(Scheduler):
    """Admits a waiting request only while the free blocks cover its prompt and the
    running requests' projected growth (``reserve`` in the module docstring)."""

    def __init__(self, *args, reserve_ratio: float = 0.7, floor: float = RESERVE_FLOOR,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start_ratio = self.ratio = reserve_ratio
        self.floor = floor

    def schedule(self):
        output = super().schedule()
        if output.preempted_req_ids:  # the estimate was short: what the running ones show
            decoded = sum(len(r.output_token_ids) for r in self.running)
            budget = sum(min(r.max_tokens, RESERVE_CLIP) for r in self.running) or 1
            self.ratio = min(1.0, max(self.ratio, (decoded + 20 * len(self.running)) / budget))
        else:
            step = (self.start_ratio - self.floor) / RESERVE_DECAY_STEPS
            self.ratio = max(self.floor, self.ratio - step)
        return output

    def _growth(self, request: Request) -> float:
        remaining = request.max_tokens - len(request.output_token_ids)
        return min(remaining, RESERVE_CLIP) * self.ratio

    def _schedule_waiting(self, plan) -> None:
        if not self.waiting:
            return
        kv = self.kv_cache_manager
        reserved = [sum(self._growth(r) for r in self.running)]
        allocate = kv.allocate_slots

        def allocate_within_reserve(request, num_slots, *args):
            free = kv.block_pool.num_free_blocks * self.block_size
            if free - reserved[0] < request.num_tokens + self._growth(request):
                return None
            block_ids = allocate(request, num_slots, *args)
            if block_ids is not None:
                reserved[0] += self._growth(request)
            return block_ids

        kv.allocate_slots = allocate_within_reserve
        try:
            super()._schedule_waiting(plan)
        finally:
            del kv.allocate_slots


def simulate(prompt_len: int, output_len: int, num_requests: int, policy: str = "engine",
             kv_tokens: int = 971_856, max_num_seqs: int = 512,
             max_num_batched_tokens: int = 8192, block_size: int = 16,
             reserve_ratio: float = 0.7, kv_bytes_per_token: int = KV_BYTES_PER_TOKEN,
             swap_gb_s: float = 25.0, swap_gib: float = 64.0) -> dict:
    """One shape under one policy; the figures ``main`` prints."""
    max_model_len = prompt_len + output_len
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
        enable_chunked_prefill=True)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    blocks = kv_tokens // block_size
    if policy in ("engine", "swap"):
        host_blocks = (int(swap_gib * 2**30) // (kv_bytes_per_token * block_size)
                       if policy == "swap" else 0)
        scheduler = Scheduler(scheduler_config, cache_config, blocks,
                              num_host_blocks=host_blocks)
    elif policy == "reserve":
        scheduler = ReservingScheduler(scheduler_config, cache_config, blocks,
                                       reserve_ratio=reserve_ratio)
    elif policy == "full":
        scheduler = ReservingScheduler(scheduler_config, cache_config, blocks,
                                       reserve_ratio=1.0, floor=1.0)
    else:
        raise ValueError(f"unknown policy {policy!r}: engine, reserve, full or swap.")
    swap_ms_per_block = kv_bytes_per_token * block_size / (swap_gb_s * 1e9) * 1e3
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):  # distinct prompts: no prefix-cache hits between them
        prompt = [(i * 7919 + j * 31) % 100_000 + 5 for j in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, params, max_model_len))
    elapsed_ms, steps, prompt_tokens, swap_ms = 0.0, 0, 0, 0.0
    first_token_ms: dict[str, float] = {}
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        sampled, rows, context, prompt = [], 0, 0, 0
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            context += request.num_computed_tokens  # after the step: its context
            if num_tokens > 1 or request.num_computed_tokens - num_tokens < request.num_prompt_tokens:
                prompt += num_tokens
            else:
                rows += 1
            if request.num_output_placeholders:
                sampled.append(req_id)
        moved = sum(len(ids) for _, ids in output.blocks_to_swap_out + output.blocks_to_swap_in)
        copies_ms = swap_ms_per_block * moved
        swap_ms += copies_ms
        elapsed_ms += (STEP_MS + ROW_US * rows / 1e3 + CONTEXT_US * context / 1e6
                       + PROMPT_US * prompt / 1e3 + copies_ms)
        for req_id in sampled:
            first_token_ms.setdefault(req_id, elapsed_ms)
        steps += 1
        prompt_tokens += prompt
        scheduler.update_from_output(output, ModelRunnerOutput(
            sampled, [[SAMPLED_TOKEN] for _ in sampled]))
    seconds = elapsed_ms / 1e3
    firsts = sorted(first_token_ms.values())
    return {"shape": f"{prompt_len}/{output_len}x{num_requests}", "policy": policy,
            "seconds": round(seconds, 1),
            "output_tok_s": round(num_requests * output_len / seconds),
            "steps": steps, "prompt_tokens_computed": prompt_tokens,
            "preemptions": scheduler.num_preemptions_total,
            "swapped_tokens": scheduler.num_swapped_tokens_total,
            "swap_s": round(swap_ms / 1e3, 1),
            "ttft_median_s": round(firsts[len(firsts) // 2] / 1e3, 1)}


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        lengths, count = text.strip().split("x")
        prompt_len, output_len = lengths.split("/")
        return int(prompt_len), int(output_len), int(count)
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not IN/OUTxREQUESTS (e.g. 500/2000x1500).") \
            from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", required=True)
    parser.add_argument("--policy", default="engine,reserve")
    parser.add_argument("--kv-tokens", type=int, default=971_856)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--reserve-ratio", type=float, default=0.7)
    parser.add_argument("--kv-bytes-per-token", type=int, default=KV_BYTES_PER_TOKEN,
                        help="swap: the cache's bytes a token (default: Llama-3.1-8B, FP8)")
    parser.add_argument("--swap-gb-s", type=float, default=25.0,
                        help="swap: host <-> device copy rate, GB/s each way")
    parser.add_argument("--swap-gib", type=float, default=64.0,
                        help="swap: the engine's --swap-space, GiB of host memory")
    args = parser.parse_args()
    print(f"{'shape':>16} {'policy':>8} {'seconds':>8} {'out tok/s':>10} {'steps':>6} "
          f"{'prompt tokens':>13} {'preemptions':>11} {'swap s':>6} {'TTFT median s':>13}")
    for shape in args.shapes.split(","):
        for policy in args.policy.split(","):
            r = simulate(*parse_shape(shape), policy=policy, kv_tokens=args.kv_tokens,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         reserve_ratio=args.reserve_ratio,
                         kv_bytes_per_token=args.kv_bytes_per_token, swap_gb_s=args.swap_gb_s,
                         swap_gib=args.swap_gib)
            print(f"{r['shape']:>16} {r['policy']:>8} {r['seconds']:>8} {r['output_tok_s']:>10} "
                  f"{r['steps']:>6} {r['prompt_tokens_computed']:>13} {r['preemptions']:>11} "
                  f"{r['swap_s']:>6} {r['ttft_median_s']:>13}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
