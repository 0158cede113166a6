"""The plain data that crosses the core's boundary each step. No torch.

One step: ``Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute_model() ->
ModelRunnerOutput -> Scheduler.update_from_output() -> list[EngineCoreOutput]``.

The model runner keeps its own copy of every running request (token ids, block table,
sampling state), so a step sends only what changed: new requests in full, running ones
as newly allocated block ids and their ``num_computed_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams

# One position's logprobs: ``(token_ids, logprobs, sampled_rank)``. ``token_ids[0]`` is the
# token that was sampled (or, for prompt logprobs, the actual prompt token); the rest are the
# top-k tokens in descending order, whose ranks are 1..k. ``sampled_rank`` is the rank of
# ``token_ids[0]`` in the full distribution (1 = most likely).
LogprobsEntry = tuple[list[int], list[float], int]


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (recomputed, or
    swapped back in: then its computed tokens' KV arrives by the step's copies)."""

    request_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hits: K/V already in the cache


@dataclass
class CachedRequestData:
    """Running requests the runner already holds, in parallel lists."""

    request_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # request id -> tokens to compute this step (> 0 for every scheduled request)
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished, were aborted or preempted since the last step: the runner
    # forgets them (a preempted one comes back later as a NewRequestData).
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    # Speculative decoding. request id -> the proposed tokens it verifies this step, after
    # its one known token (its num_scheduled_tokens count them); absent: none.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Tokens the draft model proposes after this step for each request the step samples
    # for (fewer where its KV slots or max_tokens end sooner); 0: no draft model, or no
    # speculation this step.
    num_lookahead_tokens: int = 0
    # Whether the step speculates (its requests may verify proposals and get new ones):
    # such a step is resolved before the next one is planned or launched.
    speculative: bool = False
    # Swapping at preemption: (first host block, GPU block ids), GPU block i copied to
    # host block first + i (out) or host block first + i to GPU block i (in). The runner
    # copies them before the forward pass, out first: a block swapped out may be reused by
    # this step.
    blocks_to_swap_out: list[tuple[int, list[int]]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, per scheduled request (ordered as ``req_ids``)."""

    req_ids: list[str]
    # Sampled tokens per request; empty for a prefill chunk that does not reach the end.
    sampled_token_ids: list[list[int]]
    # request id -> one entry per sampled token (only for requests that asked for logprobs)
    logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    # request id -> one entry per prompt position computed this step (None for position 0)
    prompt_logprobs: dict[str, list[LogprobsEntry | None]] = field(default_factory=dict)
    # request id -> the draft model's proposals for the request's next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What one step produced for one request, for the front end to detokenize and stream."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None
    new_prompt_logprobs: list[LogprobsEntry | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SpecDecodingStats:
    """Speculative decoding totals: ``num_drafts`` request-steps that verified proposals,
    ``num_draft_tokens`` tokens proposed in them, ``num_accepted_tokens`` of those accepted,
    and ``accepted_per_position[i]`` drafts whose token ``i`` (0-based) was accepted.

    A step of a draft of ``k`` tokens with ``a`` accepted yields ``a + 1`` tokens, so the
    mean accepted length (tokens per verifying step) is ``1 + num_accepted_tokens /
    num_drafts`` and the acceptance rate ``num_accepted_tokens / num_draft_tokens``.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification: ``num_accepted`` of ``num_draft_tokens`` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_position = self.accepted_per_position
        if len(per_position) < num_accepted:
            per_position.extend([0] * (num_accepted - len(per_position)))
        for i in range(num_accepted):
            per_position[i] += 1

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.accepted_per_position))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler for metrics and the periodic log line (counters are totals)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, total
    prefix_cache_hits: int  # of those, tokens found, total
    num_preemptions: int  # total
    num_waiting_for_grammar: int = 0  # of num_waiting: output constraints still compiling
    num_preempted_tokens: int = 0  # computed tokens preemptions dropped (computed again), total
    num_swapped_tokens: int = 0  # computed tokens preemptions swapped out instead, total
    spec_decoding: SpecDecodingStats | None = None  # totals; None without speculation
