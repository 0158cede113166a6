"""A model runner stand-in for core tests: plain Python, exact, and suspicious.

It rebuilds every request's state from the SchedulerOutputs alone, as the real runner
must, and models the paged KV cache as one entry per slot. The "K/V" written at position
``p`` of a sequence is a fingerprint of its tokens ``0..p`` (what real K/V depend on), so
reading back the context of a request checks that its block table, its prefix-cache hits
and its ``num_computed_tokens`` are all right. The next token is a fixed function of the
sequence so far: whatever the batching, chunking, caching or preemption, a request must end
with the tokens ``reference_outputs`` computes alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

VOCAB = 97


def next_token(tokens: list[int]) -> int:
    """The deterministic "model": depends on every token and on the length."""
    acc = len(tokens)
    for t in tokens:
        acc = (acc * 31 + t) % 1_000_003
    return acc % VOCAB + 3


def reference_outputs(prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The tokens a request must produce, computed without any scheduler."""
    request = Request("ref", prompt, params, max_model_len)
    while True:
        request.append_output_token(next_token(request.all_token_ids))
        if request.check_stop():
            return request.output_token_ids


def _fingerprint(prev: int, token: int) -> int:
    return hash((prev, token))


@dataclass
class _State:
    tokens: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    prefix: list[int] = field(default_factory=list)  # fingerprint of tokens[:p + 1]

    def fingerprint(self, pos: int) -> int:
        while len(self.prefix) <= pos:
            prev = self.prefix[-1] if self.prefix else 0
            self.prefix.append(_fingerprint(prev, self.tokens[len(self.prefix)]))
        return self.prefix[pos]


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.states: dict[str, _State] = {}
        # Every token a request ever had, to check a resumed request comes back whole.
        self.history: dict[str, list[int]] = {}
        self.steps: list[SchedulerOutput] = []

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        for req_id in req_ids:  # the whole batch writes its K/V before anyone attends
            self._write_kv(req_id, so.num_scheduled_tokens[req_id])
        sampled, prompt_logprobs, logprobs = [], {}, {}
        for req_id in req_ids:
            state = self.states[req_id]
            num_new = so.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            end = start + num_new
            self._check_context(req_id, end)
            if state.params.prompt_logprobs is not None and start < state.num_prompt_tokens:
                # As the real runner: logits at position p score prompt token p + 1, so
                # the chunk [start, end) scores tokens start + 1 .. min(end, P - 1), and the
                # first chunk reports None for token 0.
                last = min(end, state.num_prompt_tokens - 1)
                prompt_logprobs[req_id] = [None] * (start == 0) + [
                    ([state.tokens[q]], [-1.0], 1) for q in range(start + 1, last + 1)
                ]
            state.num_computed_tokens = end
            if end == len(state.tokens):
                token = next_token(state.tokens)
                state.tokens.append(token)
                self.history[req_id].append(token)
                sampled.append([token])
                if state.params.logprobs is not None:
                    logprobs[req_id] = [([token], [-0.5], 1)]
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled, logprobs, prompt_logprobs)

    def _update_states(self, so: SchedulerOutput) -> None:
        assert not so.preempted_req_ids & so.finished_req_ids
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.request_id not in self.states, "a request was sent twice as new"
            history = self.history.setdefault(new.request_id, list(new.token_ids))
            assert new.token_ids == history, "a resumed request lost or changed tokens"
            self.states[new.request_id] = _State(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                new.num_computed_tokens, new.sampling_params,
            )
            if new.sampling_params.prompt_logprobs is not None:
                assert new.num_computed_tokens == 0, "a prompt-logprobs request used the cache"
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.states[req_id]
            assert state.num_computed_tokens == num_computed
            state.block_ids.extend(new_blocks)
        assert set(so.num_scheduled_tokens) == (
            {n.request_id for n in so.scheduled_new_reqs} | set(cached.request_ids)
        )
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())

    def _slot(self, state: _State, pos: int) -> int:
        block = state.block_ids[pos // self.block_size]
        return block * self.block_size + pos % self.block_size

    def _write_kv(self, req_id: str, num_new: int) -> None:
        state = self.states[req_id]
        start = state.num_computed_tokens
        assert num_new > 0 and start + num_new <= len(state.tokens)
        assert len(state.block_ids) * self.block_size >= start + num_new
        for pos in range(start, start + num_new):
            self.slots[self._slot(state, pos)] = state.fingerprint(pos)

    def _check_context(self, req_id: str, end: int) -> None:
        state = self.states[req_id]
        for pos in range(end):
            assert self.slots[self._slot(state, pos)] == state.fingerprint(pos), (
                f"request {req_id} reads wrong K/V at position {pos}"
            )
