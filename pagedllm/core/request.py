"""The state of one sequence inside the engine core. Pure Python, no torch.

A ``Request`` is one sequence: a prompt and the tokens generated after it. (An API call
with ``n > 1`` becomes ``n`` requests that share the prompt; the prefix cache makes the
shared prompt cost one prefill.)

Token accounting, the only thing the scheduler knows about a request::

    all_token_ids:  [ p0 p1 ... p(P-1) | o0 o1 ... o(O-1) ]
                      ^-- prompt (P) --^  ^-- output (O) --^
    num_tokens          = P + O
    num_computed_tokens = tokens whose K/V are in the cache (prefix hits included)
    num_output_placeholders = tokens being sampled by scheduled steps whose outputs have
                          not been appended yet (the scheduler may plan a step before the
                          previous one's output is back: asynchronous scheduling)
    to compute          = num_tokens + num_output_placeholders - num_computed_tokens
    spec_token_ids      = tokens a proposer suggests after the last one (speculative
                          decoding): a decode step computes the last token plus these, and
                          the step's accepted tokens leave num_computed_tokens just past the
                          last accepted one (the rejected ones' K/V slots are rewritten later)

A decode step computes exactly one token (the last sampled one); a prefill chunk computes
many; a preempted request drops to ``num_computed_tokens == 0`` and recomputes prompt and
outputs together, so it resumes with the same tokens it had.
"""

from __future__ import annotations

import enum
import time

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # its output constraint is still compiling
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this line is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        """The OpenAI ``finish_reason`` for a finished status ("stop", "length", "abort")."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence the scheduler can run. Mutated only by the scheduler and KV manager."""

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "arrival_time", "priority",
        "all_token_ids", "output_token_ids", "num_computed_tokens", "num_cached_tokens",
        "status", "stop_reason", "max_tokens", "stop_token_ids", "block_hashes",
        "num_preemptions", "first_scheduled_time", "use_prefix_cache", "cache_salt",
        "num_output_placeholders", "num_prompt_logprobs_reported", "grammar", "spec_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_model_len: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("The prompt is empty: give at least one token.")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens being sampled by steps already scheduled whose outputs have not come back
        # (0 or 1 with synchronous steps, up to 2 with asynchronous scheduling).
        self.num_output_placeholders = 0
        # Prompt positions whose logprobs were reported (a recompute after preemption
        # computes them again; they are reported once).
        self.num_prompt_logprobs_reported = 0
        # Prompt tokens found in the prefix cache at the first admission (for metrics).
        self.num_cached_tokens = -1
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # The most output tokens this request may have: max_tokens, capped by the context.
        room = max_model_len - len(prompt_token_ids)
        wanted = sampling_params.max_tokens
        self.max_tokens = room if wanted is None else min(wanted, room)
        self.stop_token_ids = sampling_params.all_stop_token_ids
        # Hashes of the request's full blocks, in order; extended by the KV cache manager.
        self.block_hashes: list = []
        # Mixed into the first block's hash: requests with different salts never share
        # cached blocks (tenant isolation), requests with equal salts share as usual.
        self.cache_salt = cache_salt
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        # Prompt logprobs need logits for every prompt token, so such requests skip hits.
        self.use_prefix_cache = sampling_params.prompt_logprobs is None
        # The output constraint's state (``pagedllm.structured.manager.RequestGrammar``),
        # set by the engine for a request with ``structured_outputs``: ``ready`` once
        # compiled, ``accept_token`` for each output token, ``is_terminated`` when the
        # output is complete or the constraint failed (``error``: then the request ends as
        # aborted, with the error as its stop reason).
        self.grammar = None
        # Proposed next tokens, consumed by the next step that schedules the request.
        self.spec_token_ids: list[int] = []

    # -- pickling (a request crosses to the engine core process once) -------------------
    def __getstate__(self) -> dict:
        """Every slot but ``all_token_ids``, which is the prompt then the outputs and is
        rebuilt on load: the prompt's thousands of ids cross once, not twice."""
        return {name: getattr(self, name) for name in self.__slots__ if name != "all_token_ids"}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    # -- token accounting ---------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept_token(token_id)

    def check_stop(self) -> bool:
        """After appending a token: set a finished status if this request is done."""
        if self.output_token_ids:
            last = self.output_token_ids[-1]
            if last in self.stop_token_ids and len(self.output_token_ids) >= self.sampling_params.min_tokens:
                self.status = RequestStatus.FINISHED_STOPPED
                # EOS is not reported as a stop reason; an explicit stop token id is.
                if last in self.sampling_params.stop_token_ids:
                    self.stop_reason = last
                return True
        if self.grammar is not None and self.grammar.is_terminated():
            if self.grammar.error is None:
                self.status = RequestStatus.FINISHED_STOPPED  # the output is complete
            else:  # the constraint failed (a backend limit): the output is cut, not complete
                self.status = RequestStatus.FINISHED_ABORTED
                self.stop_reason = f"The output constraint failed: {self.grammar.error}"
            return True
        if len(self.output_token_ids) >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
