"""The step loop: schedule -> execute -> update. Owns the scheduler and the model runner.

Runs in-process for the offline API and tests; the server runs the same object in its own
process. Data flows one way per step and only plain data crosses the core boundary.

With asynchronous scheduling (``SchedulerConfig.async_scheduling``) one step is kept in
flight: ``step()`` schedules and launches step N, and only then waits for step N-1's
sampled ids and updates the scheduler with them, so the host's work for step N (schedule,
input preparation, launch) runs while the device computes step N-1. The scheduler plans
step N with placeholders for step N-1's tokens (see scheduler.py); outputs come back one
call later, and the call that finds nothing to schedule drains the step in flight.

Structured outputs: the runner asks about a step's constrained rows through
``StepGrammars`` (``structured/manager.py``). Most rows are sampled without a mask and
their tokens checked when the step's ids are read, before the grammars take them; a row
whose token is refused gets a bitmask and is drawn again. Rows masked before sampling
(logprobs; top-k, top-p, min-p) ask for their bitmask after the forward pass is launched:
the step in flight is resolved first, so every grammar has taken the previous step's
tokens, and the masks are filled on the host while the device runs the forward pass. As
soon as the step after a check is launched, the checked rows' grammars take their tokens
(the sampled or the redrawn one) in one call, and their next masks are filled by a worker
thread while the device computes (``MaskPrefetch``; ``PAGEDLLM_PREFETCH_MASKS``, on for a
GPU), so a row refused at the next check takes its mask ready. With those masks filled
ahead and a step in flight (a GPU's default), nothing is checked at all: the runner samples
a step's constrained rows under the masks filled ahead, just before it launches the next
forward pass (``StepGrammars.defers_masks``).

Pipeline parallelism keeps up to one step in flight per stage (``_pipelined_step``), each
on other requests, so every stage works on some step while the last one samples.

Speculative decoding: with the n-gram method the engine core proposes each decoding
request's next tokens from its own token ids after every step (``spec_decode/ngram.py``);
with a draft model the model runner proposes them at the end of the step. Either way the
proposals wait on the request for the next step to verify (a constrained request's cut at
the first token its grammar refuses, by the scheduler). A step that speculates runs
synchronously, the step in flight resolved before it is planned; with asynchronous
scheduling the steps that do not (above ``disable_by_batch_size`` running requests) keep
one in flight as usual.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import EngineCoreOutput, SchedulerOutput, SchedulerStats
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.distributed.executor import make_model_runner
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.structured.backend import constraint_forms
from pagedllm.structured.manager import (
    StepGrammars, StructuredOutputManager, masks_ahead_wanted, prefetch_masks_wanted,
)
from pagedllm.worker.async_output import AsyncStepOutput

logger = logging.getLogger(__name__)

# Seconds a step with nothing to run sleeps while constraints compile (no busy loop).
GRAMMAR_POLL_S = 0.002


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        # The ModelRunner, or with tensor parallelism the executor driving the ranks.
        self.model_runner = make_model_runner(config)
        if hasattr(self.model_runner, "shutdown"):
            self._finalizer = weakref.finalize(self, self.model_runner.shutdown)
        self.num_kv_blocks = self.model_runner.initialize_kv_cache()
        spec = config.speculative_config
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.num_kv_blocks,
                                   spec, num_host_blocks=self.model_runner.num_host_blocks)
        self.ngram: NgramProposer | None = None
        if spec is not None and spec.method == "ngram":
            self.ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                       spec.prompt_lookup_max)
        if spec is not None:
            if spec.disable_by_batch_size is not None:
                limit = f", none above {spec.disable_by_batch_size} running requests"
            elif config.scheduler_config.async_scheduling:
                limit = ("; every step speculates, so every step runs synchronously "
                         "(asynchronous scheduling applies above "
                         "--speculative-disable-by-batch-size)")
            else:
                limit = ""
            logger.info(
                "Speculative decoding: %s, %d tokens proposed a step%s",
                f"draft model {spec.draft_model_config.path.name}" if spec.method == "draft_model"
                else f"n-gram lookup (n = {spec.prompt_lookup_max} down to {spec.prompt_lookup_min})",
                spec.num_speculative_tokens, limit)
        self.async_scheduling = config.scheduler_config.async_scheduling
        # Pipeline parallelism: the steps in flight (one per stage at most), oldest first.
        self.pipeline_depth = config.parallel_config.pipeline_parallel_size
        self._pipeline: deque[tuple[SchedulerOutput, AsyncStepOutput]] = deque()
        self._in_flight: tuple[SchedulerOutput, AsyncStepOutput] | None = None
        self.structured = StructuredOutputManager(
            self._make_grammar_backend, prefetch_masks=prefetch_masks_wanted(config.device),
            forms_per_constraint=constraint_forms(config.scheduler_config.max_num_seqs))
        # Constrained rows sampled under masks filled ahead, no check (see StepGrammars).
        self._defers_masks = masks_ahead_wanted(config)
        logger.info(
            "Engine ready in %.1f s: model %s (%s, %s), KV cache (%s) %d blocks x %d tokens = "
            "%d tokens, max concurrency at max_model_len=%d: %.1fx, asynchronous scheduling %s",
            time.perf_counter() - start, config.model_config.path.name,
            str(self.model_runner.dtype).replace("torch.", ""), config.device,
            self.kv_cache_dtype, self.num_kv_blocks, config.cache_config.block_size,
            self.num_kv_tokens, config.model_config.max_model_len,
            self.num_kv_tokens / config.model_config.max_model_len,
            "on" if config.scheduler_config.async_scheduling else "off",
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any, and the grammar threads (idempotent)."""
        if hasattr(self, "structured"):
            self.structured.shutdown()
        if hasattr(self, "_finalizer"):
            self._finalizer()

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.config.cache_config.block_size

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's element type, e.g. ``"bfloat16"`` or ``"float8_e4m3fn"``."""
        return str(self.model_runner.kv_cache_dtype).replace("torch.", "")

    def _make_grammar_backend(self):
        from pagedllm.engine.tokenizer import Tokenizer
        from pagedllm.structured.llguidance_backend import LLGuidanceBackend

        model_config = self.config.model_config
        tokenizer = Tokenizer.from_pretrained(model_config.tokenizer_path,
                                              revision=model_config.revision)
        return LLGuidanceBackend(tokenizer, model_config.vocab_size)

    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            self.structured.attach(request)
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
            num_preempted_tokens=scheduler.num_preempted_tokens_total,
            num_swapped_tokens=scheduler.num_swapped_tokens_total,
            num_waiting_for_grammar=scheduler.num_waiting_for_grammar,
            spec_decoding=(None if scheduler.spec_decoding_stats is None
                           else scheduler.spec_decoding_stats.copy()),
        )

    def _propose_ngrams(self) -> None:
        """N-gram proposals (with that method) for every running request whose next step
        is a decode with all its tokens known."""
        scheduler = self.scheduler
        if self.ngram is None or not scheduler.speculates(len(scheduler.running)):
            return
        for request in scheduler.running:
            if request.num_computed_tokens == request.num_tokens - 1:
                request.spec_token_ids = self.ngram.propose(request.request_id,
                                                            request.all_token_ids)
        if len(self.ngram) > 2 * len(scheduler.requests) + 64:
            self.ngram.retain(scheduler.requests)

    def step(self) -> list[EngineCoreOutput]:
        """Run one step; returns what each request produced (with asynchronous scheduling:
        in the previous step, unless this step speculates)."""
        if self.pipeline_depth > 1:
            return self._pipelined_step()
        scheduler = self.scheduler
        outputs: list[EngineCoreOutput] = []

        def resolve_in_flight() -> None:
            if self._in_flight is not None:
                previous_output, previous_launched = self._in_flight
                self._in_flight = None
                outputs.extend(scheduler.update_from_output(
                    previous_output, previous_launched.get()))

        # A step that speculates is planned from every token (proposals follow a request's
        # last token, and a step's count is known once verified): it runs synchronously.
        speculates = scheduler.speculates(scheduler.num_running)
        if speculates and self._in_flight is not None:
            resolve_in_flight()
            self._propose_ngrams()
        scheduler_output = scheduler.schedule()
        outputs.extend(scheduler.take_unstepped_outputs())
        grammar = StepGrammars(self.structured, scheduler.requests, resolve_in_flight,
                               self._defers_masks)
        launched = self.model_runner.execute_model_async(scheduler_output, grammar)
        if scheduler_output.is_empty and scheduler.num_waiting_for_grammar:
            time.sleep(GRAMMAR_POLL_S)  # nothing runs until a constraint has compiled
        if not self.async_scheduling or scheduler_output.speculative:
            if not scheduler_output.is_empty:
                outputs.extend(scheduler.update_from_output(scheduler_output, launched.get()))
                self._propose_ngrams()
        else:
            resolve_in_flight()
            if not scheduler_output.is_empty:
                self._in_flight = (scheduler_output, launched)
        self.structured.take_checked()  # if the runner has not (see StepGrammars)
        return outputs

    def _pipelined_step(self) -> list[EngineCoreOutput]:
        """Pipeline parallelism: launch a step while up to ``pipeline_depth - 1`` earlier
        ones are still in the stages; a full pipeline first gives back its oldest step, so
        that step's requests can be planned again (the scheduler plans none with a step in
        flight, so a request's grammar has always taken its tokens before it is planned)."""
        outputs: list[EngineCoreOutput] = []

        def resolve_oldest() -> None:
            done_output, done_launched = self._pipeline.popleft()
            outputs.extend(self.scheduler.update_from_output(done_output, done_launched.get()))

        if len(self._pipeline) >= self.pipeline_depth:
            resolve_oldest()
        scheduler_output = self.scheduler.schedule()
        outputs.extend(self.scheduler.take_unstepped_outputs())
        grammar = StepGrammars(self.structured, self.scheduler.requests, lambda: None)
        launched = self.model_runner.execute_model_async(scheduler_output, grammar)
        if not scheduler_output.is_empty:
            self._pipeline.append((scheduler_output, launched))
        elif self._pipeline:
            resolve_oldest()  # nothing new to plan: the oldest step's requests are next
        elif self.scheduler.num_waiting_for_grammar:
            time.sleep(GRAMMAR_POLL_S)
        return outputs
