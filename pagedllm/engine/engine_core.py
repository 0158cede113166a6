"""The step loop: schedule -> execute -> update. Owns the scheduler and the model runner.

Runs in-process for the offline API and tests; the server runs the same object in its own
process. Data flows one way per step and only plain data crosses the core boundary.

With asynchronous scheduling (``SchedulerConfig.async_scheduling``) one step is kept in
flight: ``step()`` schedules and launches step N, and only then waits for step N-1's
sampled ids and updates the scheduler with them, so the host's work for step N (schedule,
input preparation, launch) runs while the device computes step N-1. The scheduler plans
step N with placeholders for step N-1's tokens (see scheduler.py); outputs come back one
call later, and the call that finds nothing to schedule drains the step in flight.
"""

from __future__ import annotations

import logging
import time

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import EngineCoreOutput, SchedulerOutput, SchedulerStats
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.worker.async_output import AsyncStepOutput
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        self.model_runner = ModelRunner(config)
        self.num_kv_blocks = self.model_runner.initialize_kv_cache()
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.num_kv_blocks)
        self.async_scheduling = config.scheduler_config.async_scheduling
        self._in_flight: tuple[SchedulerOutput, AsyncStepOutput] | None = None
        logger.info(
            "Engine ready in %.1f s: model %s (%s, %s), KV cache %d blocks x %d tokens = %d tokens, "
            "max concurrency at max_model_len=%d: %.1fx, asynchronous scheduling %s",
            time.perf_counter() - start, config.model_config.path.name,
            str(self.model_runner.dtype).replace("torch.", ""), config.device,
            self.num_kv_blocks, config.cache_config.block_size,
            self.num_kv_tokens, config.model_config.max_model_len,
            self.num_kv_tokens / config.model_config.max_model_len,
            "on" if config.scheduler_config.async_scheduling else "off",
        )

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.config.cache_config.block_size

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        scheduler = self.scheduler
        prefix = scheduler.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=scheduler.kv_cache_usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=scheduler.num_preemptions_total,
        )

    def step(self) -> list[EngineCoreOutput]:
        """Run one step; returns what each request produced (with asynchronous scheduling:
        in the previous step)."""
        scheduler_output = self.scheduler.schedule()
        launched = self.model_runner.execute_model_async(scheduler_output)
        if not self.async_scheduling:
            if scheduler_output.is_empty:
                return []
            return self.scheduler.update_from_output(scheduler_output, launched.get())
        previous, self._in_flight = self._in_flight, (
            None if scheduler_output.is_empty else (scheduler_output, launched))
        if previous is None:
            return []
        previous_output, previous_launched = previous
        return self.scheduler.update_from_output(previous_output, previous_launched.get())
