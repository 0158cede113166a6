"""Small builders and a step driver shared by the core tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.kv_cache import BlockPool, KVCacheManager
from pagedllm.core.outputs import EngineCoreOutput, SchedulerOutput
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from tests.core.fake_runner import FakeModelRunner

BLOCK_SIZE = 8


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_model_len: int = 128,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int | None = None,
    chunked: bool = True,
    caching: bool = True,
    policy: str = "fcfs",
    block_size: int = BLOCK_SIZE,
    speculative_config: SpeculativeConfig | None = None,
    num_host_blocks: int = 0,
) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked,
        policy=policy,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    return Scheduler(scheduler_config, cache_config, num_blocks, speculative_config,
                     num_host_blocks=num_host_blocks)


def make_request(
    request_id: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    *,
    max_model_len: int = 128,
    arrival_time: float | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    **params,
) -> Request:
    """``prompt`` is a token list, or a length (tokens derived from the id, all distinct)."""
    if isinstance(prompt, int):
        base = 1000 * (1 + sum(ord(c) for c in request_id))
        prompt = [base + i for i in range(prompt)]
    sampling_params = SamplingParams(max_tokens=max_tokens, **params)
    return Request(request_id, prompt, sampling_params, max_model_len, arrival_time=arrival_time,
                   priority=priority, cache_salt=cache_salt)


@dataclass
class Run:
    """What a driven scheduler produced, per request and per step."""

    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    core_outputs: list[list[EngineCoreOutput]] = field(default_factory=list)

    def record(self, outs: list[EngineCoreOutput]) -> None:
        self.core_outputs.append(outs)
        for out in outs:
            assert out.request_id not in self.finish_reasons, "output after finishing"
            self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_prompt_logprobs is not None:
                self.prompt_logprobs.setdefault(out.request_id, []).extend(out.new_prompt_logprobs)
            if out.finished:
                self.finish_reasons[out.request_id] = out.finish_reason


def step(scheduler: Scheduler, runner: FakeModelRunner, run: Run) -> SchedulerOutput:
    so = scheduler.schedule()
    run.steps.append(so)
    run.record(scheduler.update_from_output(so, runner.execute_model(so)))
    check_pool_invariants(scheduler.kv_cache_manager)
    return so


class AsyncStepper:
    """Drives a scheduler as the engine does with asynchronous scheduling: step N is
    scheduled and run before step N-1's output reaches the scheduler."""

    def __init__(self, scheduler: Scheduler, runner: FakeModelRunner, run: Run) -> None:
        self.scheduler, self.runner, self.run = scheduler, runner, run
        self.in_flight: tuple[SchedulerOutput, object] | None = None

    def step(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        self.run.steps.append(so)
        output = self.runner.execute_model(so)
        assert not so.is_empty or self.in_flight is not None, (
            "a step with nothing in flight scheduled nothing")
        if self.in_flight is not None:
            self.run.record(self.scheduler.update_from_output(*self.in_flight))
        self.in_flight = None if so.is_empty else (so, output)
        check_pool_invariants(self.scheduler.kv_cache_manager)
        return so


def run_to_completion(scheduler: Scheduler, runner: FakeModelRunner, max_steps: int = 2000) -> Run:
    run = Run()
    while scheduler.has_unfinished_requests():
        so = step(scheduler, runner, run)
        assert not so.is_empty, "a step with unfinished requests scheduled nothing"
        assert len(run.steps) < max_steps, "the scheduler does not make progress"
    return run


def runner_for(scheduler: Scheduler) -> FakeModelRunner:
    kv = scheduler.kv_cache_manager
    return FakeModelRunner(kv.num_blocks, kv.block_size)


def check_pool_invariants(kv: KVCacheManager) -> None:
    """ref counts match holders, the free queue is exactly the unheld blocks, the hash map
    is exactly the blocks with a hash."""
    pool: BlockPool = kv.block_pool
    holders = [0] * pool.num_blocks
    for blocks in kv.req_to_blocks.values():
        ids = [b.block_id for b in blocks]
        assert len(set(ids)) == len(ids), "a request holds a block twice"
        for block_id in ids:
            holders[block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == holders
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.num_free_blocks
    assert sorted(b.block_id for b in free) == [i for i, n in enumerate(holders) if n == 0]
    cached = {b.block_id for b in pool.cached_block_hash_to_block.values()}
    assert cached == {b.block_id for b in pool.blocks if b.block_hash is not None}
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash is block_hash

