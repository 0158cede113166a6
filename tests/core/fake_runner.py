"""A model runner stand-in for core tests: plain Python, exact, and suspicious.

It rebuilds every request's state from the SchedulerOutputs alone, as the real runner
must, and models the paged KV cache as one entry per slot. The "K/V" written at position
``p`` of a sequence is a fingerprint of its tokens ``0..p`` (what real K/V depend on), so
reading back the context of a request checks that its block table, its prefix-cache hits
and its ``num_computed_tokens`` are all right. The next token is a fixed function of the
sequence so far: whatever the batching, chunking, caching or preemption, a request must end
with the tokens ``reference_outputs`` computes alone.

Swapping: the blocks a step swaps out are copied to a host store and those it swaps in
copied back, before the step writes anything (out first), so a resumed request's context
check reads what was copied.

Speculative decoding: a request's proposed tokens (``SchedulerOutput.spec_token_ids``) are
written and read like any others, then verified against ``next_token``: the step returns
the matching run plus the model's own next token, and the rejected tokens' K/V are left
for later steps to overwrite. With ``num_lookahead_tokens`` the runner plays the draft
model: after a step that samples it proposes that many tokens (some deliberately wrong,
see ``draft_token``) and checks that their K/V slots are the request's own.
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


def draft_token(tokens: list[int]) -> int:
    """The fake draft model: ``next_token``, except for one context in four."""
    token = next_token(tokens)
    return token if hash(tuple(tokens[-3:])) % 4 else token % VOCAB + 4


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
        self.host: dict[int, list[int | None]] = {}  # host block -> its slots' K/V
        self.host_owner: dict[str, range] = {}  # request -> the host blocks it was swapped to

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        self._swap(so)
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        for req_id, spec in so.spec_token_ids.items():
            assert so.num_scheduled_tokens[req_id] == len(spec) + 1
            self.states[req_id].tokens.extend(spec)  # written like known tokens
        for req_id in req_ids:  # the whole batch writes its K/V before anyone attends
            self._write_kv(req_id, so.num_scheduled_tokens[req_id])
        sampled, prompt_logprobs, logprobs, proposals = [], {}, {}, {}
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
                tokens = self._verify(state, so.spec_token_ids.get(req_id, []))
                self.history[req_id].extend(tokens)
                sampled.append(tokens)
                if state.params.logprobs is not None:
                    logprobs[req_id] = [([t], [-0.5], 1) for t in tokens]
                if so.num_lookahead_tokens:
                    proposals[req_id] = self._propose(state, so.num_lookahead_tokens)
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled, logprobs, prompt_logprobs, proposals)

    @staticmethod
    def _verify(state: _State, spec: list[int]) -> list[int]:
        """Keep the proposals ``next_token`` agrees with, then add its own next token."""
        known = len(state.tokens) - len(spec)
        accepted = 0
        while accepted < len(spec) and spec[accepted] == next_token(state.tokens[:known + accepted]):
            accepted += 1
        del state.tokens[known + accepted:]
        del state.prefix[known + accepted:]
        state.num_computed_tokens = known + accepted
        token = next_token(state.tokens)
        state.tokens.append(token)
        return spec[:accepted] + [token]

    def _propose(self, state: _State, num_lookahead: int) -> list[int]:
        """Draft after a step that sampled: as many tokens as the request's slots hold (the
        draft writes the K/V of its last sampled token and of each proposal but the last),
        up to ``num_lookahead``, and at least as many as it may still keep."""
        last = len(state.tokens) - 1
        room = len(state.block_ids) * self.block_size - last
        max_tokens = state.params.max_tokens
        useful = num_lookahead if max_tokens is None else min(
            num_lookahead, state.num_prompt_tokens + max_tokens - 1 - last)
        if max(useful, 0) > room:
            raise AssertionError(f"the draft's {useful} proposals need {useful} slots past "
                                 f"position {last}, the request's blocks hold {room}")
        proposal: list[int] = []
        for _ in range(min(num_lookahead, room)):
            proposal.append(draft_token(state.tokens + proposal))
        return proposal

    def _swap(self, so: SchedulerOutput) -> None:
        """The step's copies. A request finished while swapped out (aborted) left its host
        blocks to the scheduler, which may swap another request out to them in this very
        step: their K/V is dropped first, so an overwrite of a block another request still
        needs is caught."""
        size = self.block_size
        for req_id in so.finished_req_ids & self.host_owner.keys():
            for block in self.host_owner.pop(req_id):
                del self.host[block]
        for start, block_ids in so.blocks_to_swap_out:
            owner = [req_id for req_id in so.preempted_req_ids if req_id in self.states
                     and self.states[req_id].block_ids[:len(block_ids)] == block_ids]
            assert len(owner) == 1, "a swap-out of blocks no preempted request held"
            self.host_owner[owner[0]] = range(start, start + len(block_ids))
            for i, block in enumerate(block_ids):
                assert start + i not in self.host, "a swap-out overwrote a swapped-out block"
                self.host[start + i] = self.slots[block * size:(block + 1) * size]
        for start, block_ids in so.blocks_to_swap_in:
            owner = [req_id for req_id, blocks in self.host_owner.items() if blocks.start == start]
            assert len(owner) == 1 and len(self.host_owner[owner[0]]) == len(block_ids), \
                "a swap-in of host blocks no swapped-out request holds"
            del self.host_owner[owner[0]]
            for i, block in enumerate(block_ids):
                self.slots[block * size:(block + 1) * size] = self.host.pop(start + i)

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
