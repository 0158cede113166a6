"""The model runner's persistent copy of the scheduled requests, and the step's flat inputs.

Each live request owns a row in two host arrays, so a step's inputs come from a handful of
vectorised numpy gathers rather than a Python loop over tokens::

    token_ids   [max_num_seqs, max_model_len]      prompt + sampled tokens of each row
    block_table [max_num_seqs, max_blocks_per_seq] the row's KV block ids, in order

A step's batch (``T`` tokens from ``B`` requests, prefill chunks and decodes mixed)::

    positions[i]    = num_computed_tokens[b] + (i - query_start_loc[b])   (absolute index)
    input_ids[i]    = token_ids[row[b], positions[i]]
    slot_mapping[i] = block_table[row[b], positions[i] // block_size] * block_size
                      + positions[i] % block_size

A request samples when this step computes its last token (known on the host or pending,
see below); a prefill chunk that stops short of the end samples nothing. No torch here: the runner moves the arrays.

Pending tokens (asynchronous scheduling): a token sampled by a launched step whose id has
not been read back yet is known only on the device. Two more arrays, by row::

    num_pending        [max_num_seqs]  sampled tokens of the row not appended yet
    pending_sample_row [max_num_seqs]  the row's index in the last launched step's
                                       sampled ids

A step that computes a pending token takes its id from the previous step's sampled ids on
the device: ``StepInputs.pending_token_indices`` (flat positions in this step) and
``pending_sample_rows`` (where to read them). Only the last launched step can have ids in
flight when a step is prepared, so one source tensor serves them all.

Speculative decoding: a request verifying ``k`` proposals computes its last token and the
proposals, written into its ``token_ids`` row just past its known tokens (the accepted ones
are appended over them later), so ``input_ids`` gathers them like any token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedllm.core.outputs import NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    request_id: str
    row: int
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    num_blocks: int
    # The draft model's K/V (speculative decoding with a draft model): exact for positions
    # below ``draft_end``; the proposals' K/V are written at the ``num_draft_kv`` positions
    # after it, and count once the target accepts them.
    draft_end: int = 0
    num_draft_kv: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class StepInputs:
    """Host arrays for one forward pass (int64 unless noted)."""

    req_ids: list[str]
    states: list[CachedRequestState]
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, ceil(max_seq_len / block_size)] int32
    max_query_len: int
    sample_req_indices: list[int]  # indices into req_ids of the requests that sample
    logits_indices: np.ndarray  # flat token index whose logits each sampling request uses
    # Tokens whose ids are on the device only: flat index here, row in the last step's ids.
    pending_token_indices: np.ndarray
    pending_sample_rows: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self.num_pending = np.zeros(max_num_seqs, dtype=np.int64)
        self.pending_sample_row = np.zeros(max_num_seqs, dtype=np.int64)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}
        # Live requests with an output constraint (a step without any skips the grammar).
        self.num_constrained = 0

    def update(self, so: SchedulerOutput) -> None:
        """Apply a step's changes: drop finished/preempted, add new, extend block tables."""
        for req_id in so.finished_req_ids:
            self.remove(req_id)
        for req_id in so.preempted_req_ids:
            self.remove(req_id)
        for new in so.scheduled_new_reqs:
            self.add(new)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[req_id]
            state.num_computed_tokens = num_computed
            if new_blocks:
                n = state.num_blocks
                self.block_table[state.row, n:n + len(new_blocks)] = new_blocks
                state.num_blocks = n + len(new_blocks)

    def add(self, new: NewRequestData) -> None:
        self.remove(new.request_id)
        row = self.free_rows.pop()
        tokens = new.token_ids
        self.token_ids[row, :len(tokens)] = tokens
        self.block_table[row, :len(new.block_ids)] = new.block_ids
        self.num_pending[row] = 0
        self.num_constrained += new.sampling_params.structured_outputs is not None
        self.requests[new.request_id] = CachedRequestState(
            request_id=new.request_id, row=row, sampling_params=new.sampling_params,
            prompt_token_ids=list(tokens[:new.num_prompt_tokens]),
            output_token_ids=list(tokens[new.num_prompt_tokens:]),
            num_computed_tokens=new.num_computed_tokens, num_blocks=len(new.block_ids),
            draft_end=new.num_computed_tokens,
        )

    def remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.free_rows.append(state.row)
            self.num_constrained -= state.sampling_params.structured_outputs is not None

    def append_token(self, state: CachedRequestState, token: int) -> None:
        position = state.num_tokens
        if position < self.max_model_len:
            self.token_ids[state.row, position] = token
        state.output_token_ids.append(token)

    def mark_pending(self, states: list[CachedRequestState]) -> None:
        """A step was launched that samples one token for each of ``states``, in order."""
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        self.num_pending[rows] += 1
        self.pending_sample_row[rows] = np.arange(len(states))

    def append_pending_token(self, state: CachedRequestState, token: int) -> None:
        """The id of ``state``'s oldest pending token has come back from the device."""
        self.num_pending[state.row] -= 1
        self.append_token(state, token)

    def is_live(self, state: CachedRequestState) -> bool:
        """Whether ``state`` still describes a request in the batch (not removed since)."""
        return self.requests.get(state.request_id) is state

    def prepare(
        self,
        num_scheduled_tokens: dict[str, int],
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> StepInputs:
        """The step's flat inputs; ``spec_token_ids``: the proposals each verifying request
        computes after its last token (see the module docstring)."""
        req_ids = list(num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        num_reqs = len(req_ids)
        num_sched = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_reqs)
        num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
        num_host = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=num_reqs)
        if spec_token_ids:
            for i, state in enumerate(states):
                spec = spec_token_ids.get(state.request_id)
                if spec:
                    self.token_ids[state.row, num_host[i]:num_host[i] + len(spec)] = spec
                    num_host[i] += len(spec)
        num_known = num_host + self.num_pending[rows]
        inputs = self.spans(req_ids, states, rows, num_computed, num_sched)
        samples = inputs.seq_lens >= num_known
        token_req = np.repeat(np.arange(num_reqs), num_sched)
        pending_tokens = np.flatnonzero(inputs.positions >= num_host[token_req])
        inputs.sample_req_indices = np.flatnonzero(samples).tolist()
        inputs.logits_indices = inputs.query_start_loc[1:][samples] - 1
        inputs.pending_token_indices = pending_tokens
        inputs.pending_sample_rows = self.pending_sample_row[rows[token_req[pending_tokens]]]
        return inputs

    def spans(
        self,
        req_ids: list[str],
        states: list[CachedRequestState],
        rows: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
    ) -> StepInputs:
        """Flat inputs computing, for each request, ``counts[i]`` tokens of its row from
        position ``starts[i]`` (all known on the host), sampling the last row of each."""
        num_reqs = len(req_ids)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        token_req = np.repeat(np.arange(num_reqs), counts)
        positions = np.arange(total) - query_start_loc[token_req] + starts[token_req]
        token_rows = rows[token_req]
        bs = self.block_size
        slot_mapping = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = starts + counts
        empty = np.zeros(0, dtype=np.int64)
        return StepInputs(
            req_ids=req_ids,
            states=states,
            input_ids=self.token_ids[token_rows, positions],
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=self.block_table[rows, : -(-int(seq_lens.max()) // bs)],
            max_query_len=int(counts.max()),
            sample_req_indices=list(range(num_reqs)),
            logits_indices=query_start_loc[1:] - 1,
            pending_token_indices=empty,
            pending_sample_rows=empty,
        )
