"""The token-budget scheduler: which requests run this step, and how many tokens each computes.

Pure Python, no torch. There is no prefill or decode phase: a request needs
``num_tokens + num_output_placeholders - num_computed_tokens`` tokens computed, and one
step hands out a single budget of ``max_num_batched_tokens`` tokens::

    budget = max_num_batched_tokens
    1. running requests, in admission order. Each gets what it needs, capped by the budget
       with chunked prefill (without it, all or nothing). A decode needs 1 token, so
       decodes are never starved by long prompts, which come later in the order. If the
       KV blocks run out, the most recently admitted running request is preempted
       (blocks freed, status PREEMPTED, back to the front of the waiting queue, recomputed
       later; or with host blocks, ``num_host_blocks``, its KV swapped out and copied back
       when it is re-admitted, its computed tokens kept) until the allocation fits, or the
       request was itself that victim.
    2. waiting requests, in policy order, unless step 1 preempted someone (memory is
       short), while ``max_num_seqs`` allows: prefix-cache lookup, then as many tokens as
       the budget allows. A request that does not fit (the budget without chunked prefill,
       the blocks in any case) stops admission: nobody skips ahead of it.
    3. the SchedulerOutput. Each scheduled request's ``num_computed_tokens`` has already
       advanced by its share, as if the step had run; the output carries the values from
       before the step. A request whose share reaches its end samples a token in this step:
       it gains an output placeholder.

``update_from_output`` then fills the placeholders with the sampled tokens, finishes
requests that stop, and frees their blocks at once.

Structured outputs: a request with an output constraint waits in ``waiting_for_grammar``
(status WAITING_FOR_GRAMMAR, counted as waiting) until its grammar has compiled, then
queues like any other; nothing else waits for it. Each output token advances its grammar
(``Request.append_output_token``), and a complete output finishes it with "stop".

Asynchronous scheduling: the engine may call ``schedule()`` for step N+1 before step N's
output is back. A decoding request then has a placeholder, so it is scheduled one more
token (the model runner feeds it the id sampled on the device), unless the tokens in flight
already reach ``max_tokens``. A request that stops on a stop token in step N was also
scheduled in step N+1; that token is dropped. A request preempted with a token in flight
keeps it and is re-admitted only once it is back, so a recompute sees every token. A step
that speculates is planned with no step in flight (the engine resolves it first), so a
request verifying proposals never has a placeholder.

Pipeline parallelism (``pipeline_parallel_size`` M > 1): the engine keeps up to M steps in
flight, one per stage, and a request with a token in flight is not planned again until
that step's output is back (its token is the first stage's next input, and it comes from
the last stage), so the steps in flight run on disjoint requests. A step takes at most
``ceil(max_num_seqs / M)`` requests, so the running requests split into M micro-batches
that keep every stage busy.

Speculative decoding: a decoding request with proposed tokens (``spec_token_ids``, from
the n-gram proposer or the draft model) is scheduled as its last token plus ``k`` of them,
``k`` capped by the budget and by ``max_tokens`` (a step yields at most ``k + 1`` tokens,
so no step computes a token past ``max_tokens``), and for a request with an output
constraint cut at the first proposal its grammar refuses (``proposals_to_verify``).
``update_from_output`` gets the accepted run (1 to ``k + 1`` tokens) and moves
``num_computed_tokens`` back by the rejected ones; their KV slots stay allocated and are
overwritten by later tokens. With a draft model, a step that samples for a request also
allocates the slots of the drafts the model writes after it (``num_lookahead_tokens``), so
the draft's K/V always land in the request's own blocks. Above ``disable_by_batch_size``
running requests a step speculates for nobody.

For the model runner: ``finished_req_ids`` holds the requests finished or aborted since
the last step, ``preempted_req_ids`` those preempted in this step. The runner forgets
both; a preempted request comes back later as a ``NewRequestData`` with all its tokens
(prompt + outputs), while per-request state that must survive (a seeded generator) is
dropped only for finished ones. A swapped one comes back with its ``num_computed_tokens``
as a prefix-cache hit would, the step's ``blocks_to_swap_in`` bringing their KV; the host
blocks are freed once that step's output is back.
"""

from __future__ import annotations

import time
from typing import Iterable

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.kv_cache import KVCacheManager, cdiv
from pagedllm.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SpecDecodingStats,
)
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import make_request_queue

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class _StepPlan:
    """What one ``schedule()`` call has decided so far."""

    __slots__ = ("token_budget", "num_scheduled_tokens", "new_reqs", "cached_reqs",
                 "preempted_req_ids", "speculate", "num_lookahead", "spec_token_ids",
                 "swap_out", "swap_in")

    def __init__(self, token_budget: int, speculate: bool = False, num_lookahead: int = 0) -> None:
        self.token_budget = token_budget
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_reqs: list[NewRequestData] = []
        self.cached_reqs = CachedRequestData()
        self.preempted_req_ids: set[str] = set()
        # Whether requests verify their proposals this step, and the draft model's slots
        # past a sampling request's tokens (see the module docstring).
        self.speculate = speculate
        self.num_lookahead = num_lookahead
        self.spec_token_ids: dict[str, list[int]] = {}
        # (first host block, GPU block ids) the step's copies move, out and back in.
        self.swap_out: list[tuple[int, list[int]]] = []
        self.swap_in: list[tuple[int, list[int]]] = []

    def add_new(self, request: Request, num_tokens: int, block_ids: list[int]) -> None:
        self.new_reqs.append(NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
        ))
        self._add(request, num_tokens)

    def _add(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens >= request.num_tokens:
            request.num_output_placeholders += 1  # this step samples
        self.token_budget -= num_tokens


class Scheduler:
    """Owns every unfinished request (waiting or running) and the KV cache manager.

    ``num_kv_blocks`` is the size of the KV cache the model runner allocated (with a draft
    model, each block holds the draft's K/V too). ``speculative_config``: None, or how
    requests speculate (see the module docstring). ``num_host_blocks``: host blocks a
    preempted request's KV is swapped out to (0: preemption recomputes).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        speculative_config: SpeculativeConfig | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.pipeline_parallel_size = scheduler_config.pipeline_parallel_size
        # Requests one step may take: a micro-batch of the running ones with stages.
        self.max_step_reqs = -(-self.max_num_seqs // self.pipeline_parallel_size)
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_kv_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            max_model_len=scheduler_config.max_model_len,
            num_host_blocks=num_host_blocks,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(scheduler_config.policy)
        self.running: list[Request] = []  # admission order; preemption takes from the end
        # Requests whose output constraint is compiling; queued in ``waiting`` once ready.
        self.waiting_for_grammar: list[Request] = []
        # Outputs of requests finished outside a step (a constraint that failed to compile).
        self._unstepped_outputs: list[EngineCoreOutput] = []
        self._finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        # Computed tokens whose KV the preemptions dropped (to be computed again), total.
        self.num_preempted_tokens_total = 0
        # Computed tokens whose KV the preemptions moved to host memory instead, total.
        self.num_swapped_tokens_total = 0
        spec = speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.spec_disable_by_batch_size = spec.disable_by_batch_size if spec is not None else None
        self.uses_draft_model = spec is not None and spec.method == "draft_model"
        self.spec_decoding_stats = SpecDecodingStats() if spec is not None else None

    # -- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if it could never run in this engine."""
        if request.request_id in self.requests:
            raise ValueError(
                f"Request id {request.request_id!r} is already in use: give each request a "
                "unique id."
            )
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"The prompt has {request.num_prompt_tokens} tokens but max_model_len is "
                f"{self.max_model_len}: shorten the prompt or raise --max-model-len."
            )
        # A request built for a longer context still stops at this engine's max_model_len.
        max_tokens = min(request.max_tokens, self.max_model_len - request.num_prompt_tokens)
        # The last sampled token is never computed, so it needs no slot.
        most_tokens = max(request.num_tokens, request.num_prompt_tokens + max_tokens - 1)
        if cdiv(most_tokens, self.block_size) > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"The KV cache holds {self.kv_cache_manager.num_blocks * self.block_size} tokens "
                f"but this request may need {most_tokens} (prompt {request.num_prompt_tokens} + "
                f"max_tokens {max_tokens}): lower max_tokens or --max-model-len, or give the KV "
                "cache more memory."
            )
        request.max_tokens = max_tokens
        self.requests[request.request_id] = request
        if request.grammar is not None and not request.grammar.ready:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(request)
        else:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)

    def abort_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> None:
        """Finish requests now with ``status``, freeing their blocks. Unknown ids are ignored.

        Aborted requests produce no EngineCoreOutput; their ids reach the runner in the next
        SchedulerOutput's ``finished_req_ids``.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished status, got {status!r}.")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.pop(req_id, None)
            if request is None:
                continue
            if request.status == _RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.waiting_for_grammar.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self.kv_cache_manager.free(request)
            self._finished_req_ids.add(req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet, those whose constraint is compiling included."""
        return len(self.waiting) + len(self.waiting_for_grammar)

    @property
    def num_waiting_for_grammar(self) -> int:
        return len(self.waiting_for_grammar)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by running requests, in [0, 1]."""
        return self.kv_cache_manager.usage

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch (see the module docstring); never blocks or loops."""
        speculate = self.speculates(len(self.running))
        plan = _StepPlan(self.max_num_batched_tokens, speculate,
                         self.num_spec_tokens if speculate and self.uses_draft_model else 0)
        if self.waiting_for_grammar:
            self._queue_compiled_requests()
        self._schedule_running(plan)
        if not plan.preempted_req_ids:
            self._schedule_waiting(plan)
        return self._make_output(plan)

    def speculates(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running requests speculates."""
        limit = self.spec_disable_by_batch_size
        return self.num_spec_tokens > 0 and (limit is None or num_running <= limit)

    def _schedule_running(self, plan: _StepPlan) -> None:
        # The hot loop (one pass per running request per step): locals, no helper calls
        # on the common path.
        running = self.running
        allocate = self.kv_cache_manager.allocate_slots
        chunked = self.enable_chunked_prefill
        budget = plan.token_budget
        cached = plan.cached_reqs
        num_scheduled = plan.num_scheduled_tokens
        lookahead = plan.num_lookahead
        one_step_each = self.pipeline_parallel_size > 1
        max_step_reqs = self.max_step_reqs
        i = 0
        while i < len(running) and budget > 0 and len(num_scheduled) < max_step_reqs:
            request = running[i]
            placeholders = request.num_output_placeholders
            if placeholders and (one_step_each or len(request.output_token_ids) + placeholders
                                 >= request.max_tokens):
                i += 1  # its step in flight comes first, or its tokens reach max_tokens
                continue
            end = len(request.all_token_ids) + placeholders
            num_tokens = end - request.num_computed_tokens
            spec = request.spec_token_ids
            if spec:
                request.spec_token_ids = []  # consumed by this step, verified or not
                if num_tokens == 1 and plan.speculate:
                    num_tokens += self._take_spec_tokens(request, spec, budget, plan)
            if num_tokens > budget:
                num_tokens = budget if chunked else 0
            if num_tokens <= 0:
                i += 1
                continue
            num_slots = num_tokens
            if lookahead:
                num_slots += self._num_lookahead_slots(request, num_tokens, end, lookahead)
            new_block_ids = allocate(request, num_slots)
            if new_block_ids is None:
                new_block_ids = self._preempt_until_allocated(request, num_slots, plan)
                if new_block_ids is None:
                    break  # it preempted itself, so it was the last running request
            req_id = request.request_id
            cached.request_ids.append(req_id)
            cached.new_block_ids.append(new_block_ids)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            num_scheduled[req_id] = num_tokens
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens >= end:
                request.num_output_placeholders = placeholders + 1  # this step samples
            budget -= num_tokens
            i += 1
        plan.token_budget = budget

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        waiting, kv = self.waiting, self.kv_cache_manager
        while (waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs
               and len(plan.num_scheduled_tokens) < self.max_step_reqs):
            request = waiting.peek()
            if request.num_output_placeholders:
                return  # preempted while a step samples for it: re-admit once that is back
            if kv.is_swapped_out(request):
                if not self._swap_in(request, plan):
                    return
                continue
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_tokens = self._num_tokens_to_schedule(
                request.num_tokens - num_hit_tokens, plan.token_budget)
            if num_tokens == 0:
                if plan.token_budget == self.max_num_batched_tokens:
                    raise RuntimeError(
                        f"Request {request.request_id!r} needs {request.num_tokens} tokens in one "
                        f"step but max_num_batched_tokens is {self.max_num_batched_tokens}: enable "
                        "chunked prefill or raise --max-num-batched-tokens."
                    )
                return  # its whole prompt does not fit this step; nobody skips ahead of it
            num_slots = num_tokens
            if plan.num_lookahead:
                num_slots += self._num_lookahead_slots(
                    request, num_hit_tokens + num_tokens, request.num_tokens, plan.num_lookahead)
            if kv.allocate_slots(request, num_slots, hit_blocks, num_hit_tokens) is None:
                if not self.running:
                    raise RuntimeError(
                        f"Request {request.request_id!r} needs more KV blocks than the whole "
                        f"cache ({kv.num_blocks} blocks) holds; add_request should have refused it."
                    )
                return
            waiting.pop()
            self._admit(request, num_hit_tokens)
            plan.add_new(request, num_tokens, kv.get_block_ids(request.request_id))

    def _swap_in(self, request: Request, plan: _StepPlan) -> bool:
        """Admit a swapped-out request with its computed tokens as they were (their KV
        copied back before the step's forward pass), computing the rest; False when the
        step's budget or the free blocks do not reach."""
        kv = self.kv_cache_manager
        num_tokens = self._num_tokens_to_schedule(
            request.num_tokens - request.num_computed_tokens, plan.token_budget)
        if num_tokens == 0:
            return False
        swapped = kv.swap_in(request, num_tokens)
        if swapped is None:
            return False
        self.waiting.pop()
        self._admit(request, request.num_computed_tokens)
        plan.swap_in.append(swapped)
        plan.add_new(request, num_tokens, kv.get_block_ids(request.request_id))
        return True

    def _queue_compiled_requests(self) -> None:
        """Move requests whose constraint has compiled to the waiting queue; one whose
        constraint failed finishes at once (aborted, reported by ``take_unstepped_outputs``)."""
        still_compiling = []
        for request in self.waiting_for_grammar:
            if not request.grammar.ready:
                still_compiling.append(request)
            elif request.grammar.error is not None:
                request.status = RequestStatus.FINISHED_ABORTED
                request.stop_reason = request.grammar.error
                self._unstepped_outputs.append(EngineCoreOutput(
                    request.request_id, [], finish_reason="abort", stop_reason=request.stop_reason))
                self._free_finished(request)
            else:
                request.status = RequestStatus.WAITING
                self.waiting.add(request)
        self.waiting_for_grammar = still_compiling

    def take_unstepped_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests that finished without a step since the last call."""
        outputs, self._unstepped_outputs = self._unstepped_outputs, []
        return outputs

    def _take_spec_tokens(self, request: Request, spec: list[int], budget: int,
                          plan: _StepPlan) -> int:
        """How many of the request's proposals this step verifies (recorded in ``plan``):
        all, but within the budget beside its own token, with ``k + 1`` tokens at most
        left to reach ``max_tokens``, and, under an output constraint, none after the first
        the grammar refuses (see ``proposals_to_verify``)."""
        k = len(spec)
        if request.grammar is not None:
            drawn = self.uses_draft_model and not request.sampling_params.greedy
            k = proposals_to_verify(request.grammar.num_allowed(spec), k, drawn)
        k = min(k, budget - 1, request.max_tokens - len(request.output_token_ids) - 1)
        if k <= 0:
            return 0
        plan.spec_token_ids[request.request_id] = spec if k == len(spec) else spec[:k]
        return k

    @staticmethod
    def _num_lookahead_slots(request: Request, num_tokens: int, end: int, lookahead: int) -> int:
        """KV slots past the step's ``num_tokens`` (counted from ``num_computed_tokens``)
        that the draft model writes after the step: ``lookahead`` when the step reaches the
        request's ``end`` (it samples), fewer near ``max_tokens`` (the draft never proposes
        a token the request cannot keep), 0 otherwise."""
        step_end = request.num_computed_tokens + num_tokens
        if step_end < end:
            return 0
        last_useful = request.num_prompt_tokens + request.max_tokens - 1
        return max(0, min(lookahead, last_useful - step_end))

    def _num_tokens_to_schedule(self, num_needed: int, token_budget: int) -> int:
        if num_needed <= token_budget:
            return max(num_needed, 0)
        return token_budget if self.enable_chunked_prefill else 0

    def _preempt_until_allocated(
        self, request: Request, num_tokens: int, plan: _StepPlan
    ) -> list[int] | None:
        """Preempt from the end of ``running`` until the request's blocks fit; returns its
        new block ids, or None if the request itself had to be preempted."""
        while True:
            victim = self.running.pop()
            self._preempt(victim, plan)
            if victim is request:
                return None
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_tokens)
            if new_block_ids is not None:
                return new_block_ids

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Take the request's blocks: its KV swapped out to host blocks where there is room
        (it keeps its computed tokens), else dropped (they are computed again). A request
        with prompt logprobs always recomputes (as it skips prefix-cache hits)."""
        swapped = (self.kv_cache_manager.swap_out(request)
                   if request.use_prefix_cache else None)
        if swapped is not None:
            plan.swap_out.append(swapped)
            self.num_swapped_tokens_total += request.num_computed_tokens
        else:
            self.kv_cache_manager.free(request)
            self.num_preempted_tokens_total += request.num_computed_tokens
            request.num_computed_tokens = 0
        request.spec_token_ids = []
        plan.spec_token_ids.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend(request)
        plan.preempted_req_ids.add(request.request_id)

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        request.status = _RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(request)

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        finished = self._finished_req_ids
        self._finished_req_ids = set()
        return SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - plan.token_budget,
            finished_req_ids=finished,
            preempted_req_ids=plan.preempted_req_ids,
            spec_token_ids=plan.spec_token_ids,
            num_lookahead_tokens=plan.num_lookahead,
            speculative=plan.speculate,
            blocks_to_swap_out=plan.swap_out,
            blocks_to_swap_in=plan.swap_in,
        )

    # -- after the forward pass ---------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish and free stopped requests, report per request.

        A request gets an EngineCoreOutput when it has new tokens or prompt logprobs to
        report. Each step's sampled tokens (one, or with speculation the accepted run)
        fill one of the request's output placeholders. Requests
        finished or aborted since ``schedule()`` are skipped (with asynchronous scheduling a
        step may have been planned before the previous one's output stopped the request:
        its extra token is dropped). A request preempted since keeps its token.
        """
        for start, block_ids in scheduler_output.blocks_to_swap_in:  # read: the step ran
            self.kv_cache_manager.release_host(start, len(block_ids))
        runner = model_runner_output
        requests = self.requests
        all_logprobs = runner.logprobs
        all_prompt_logprobs = runner.prompt_logprobs
        verified = scheduler_output.spec_token_ids
        proposals = runner.spec_token_ids
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        for req_id, sampled in zip(runner.req_ids, runner.sampled_token_ids):
            request = requests.get(req_id)
            if request is None:
                continue  # finished or aborted since this step was scheduled
            if sampled:
                if request.num_output_placeholders == 0:
                    sampled = []  # not a step that samples for it (cannot happen)
                else:
                    request.num_output_placeholders -= 1
            # A request preempted after this step was scheduled still takes the token the
            # step sampled for it: the token is valid, and a seeded generator has drawn it.
            was_running = request.status == _RUNNING
            if not was_running and not (sampled and request.status == _PREEMPTED):
                continue
            if verified and was_running and req_id in verified:
                self._roll_back_rejected(request, len(verified[req_id]), len(sampled))
            if proposals and was_running:
                request.spec_token_ids = proposals.get(req_id, [])
            if len(sampled) == 1:
                request.append_output_token(sampled[0])
                request.check_stop()
                new_token_ids = sampled
            else:
                new_token_ids = self._append_tokens(request, sampled)
            prompt_logprobs = all_prompt_logprobs.get(req_id) if all_prompt_logprobs else None
            if prompt_logprobs is not None:
                prompt_logprobs = self._unreported(request, scheduler_output, prompt_logprobs)
            if not new_token_ids and prompt_logprobs is None:
                continue
            logprobs = all_logprobs.get(req_id) if all_logprobs else None
            if logprobs is not None and len(logprobs) > len(new_token_ids):
                logprobs = logprobs[:len(new_token_ids)]
            status = request.status
            if not RequestStatus.is_finished(status):
                finish_reason = stop_reason = None
            else:
                finish_reason = RequestStatus.finish_reason(status)
                stop_reason = request.stop_reason
                if was_running:
                    any_finished = True
                else:
                    self.waiting.remove(request)
                self._free_finished(request)
            outputs.append(EngineCoreOutput(  # positional: once per request per step
                req_id, new_token_ids, logprobs, prompt_logprobs, finish_reason, stop_reason,
                request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
            ))
        if any_finished:
            self.running = [request for request in self.running if request.status == _RUNNING]
        return outputs

    def _roll_back_rejected(self, request: Request, num_draft: int, num_sampled: int) -> None:
        """The step computed the request's last token and ``num_draft`` proposals and
        yielded ``num_sampled`` tokens: the accepted proposals plus one of the target's."""
        if not 1 <= num_sampled <= num_draft + 1:
            raise RuntimeError(
                f"Request {request.request_id!r} verified {num_draft} proposed tokens but the "
                f"step returned {num_sampled} tokens (1 to {num_draft + 1} expected)."
            )
        request.num_computed_tokens -= num_draft + 1 - num_sampled
        self.spec_decoding_stats.observe(num_draft, num_sampled - 1)

    @staticmethod
    def _unreported(request: Request, so: SchedulerOutput, entries: list) -> list | None:
        """The prompt-logprob ``entries`` a step computed for ``request`` minus those
        already reported: a request preempted after reporting some recomputes them. None
        when nothing is new.

        A step computing positions [s, e) scores prompt tokens s + 1 .. e (logits at p
        score token p + 1), and the first chunk adds None for token 0: its entries cover
        prompt positions from 0 when s == 0, else from s + 1.
        """
        step_start = _step_start(so, request.request_id)
        start = step_start + 1 if step_start else 0
        end = start + len(entries)
        reported = request.num_prompt_logprobs_reported
        if end <= reported:
            return None
        request.num_prompt_logprobs_reported = end
        return entries[reported - start:] if reported > start else entries

    @staticmethod
    def _append_tokens(request: Request, sampled: list[int]) -> list[int]:
        """Append until a stop; returns the tokens kept (all, or up to the stopping one)."""
        for i, token_id in enumerate(sampled):
            request.append_output_token(token_id)
            if request.check_stop():
                return sampled[:i + 1] if i + 1 < len(sampled) else sampled
        return sampled

    def _free_finished(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)


def proposals_to_verify(num_allowed: int, num_proposed: int, drawn: bool) -> int:
    """How many of a constrained request's ``num_proposed`` proposals to verify, the first
    ``num_allowed`` of them allowed by its grammar: those, plus the first refused one when
    the proposals were ``drawn`` from the draft's distribution. The target rejects a
    refused proposal always (its mask gives it probability 0), and the rejection draws
    from the residual of the target's and the draft's distributions; cutting the refused
    proposal would draw from the target's instead, which is the same only for a point
    mass (n-gram lookup, greedy drafting)."""
    return num_allowed + 1 if drawn and num_allowed < num_proposed else num_allowed


def _step_start(so: SchedulerOutput, request_id: str) -> int:
    """The request's ``num_computed_tokens`` when ``so`` was scheduled."""
    for new in so.scheduled_new_reqs:
        if new.request_id == request_id:
            return new.num_computed_tokens
    cached = so.scheduled_cached_reqs
    return cached.num_computed_tokens[cached.request_ids.index(request_id)]
