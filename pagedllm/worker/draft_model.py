"""The draft model of speculative decoding: its weights, its KV cache in the target's
blocks, and the proposals it makes at the end of each step.

Paged KV: the draft has one KV tensor per layer of its own, indexed by the same block ids
and slots as the target's, so a request's blocks hold both models' K/V: they are
allocated, freed, cached and preempted together, and the cache sizing counts the bytes of
both per block. Invariant: at the end of every step, a scheduled request's draft K/V are
exact at its positions below ``draft_end`` (``CachedRequestState``), which is never behind
what the target has computed; so a prefix-cache hit serves the draft as well.

After a step that verifies proposals or proposes (``propose``)::

    catch-up forward   one forward over every scheduled request's tokens from draft_end
                       to what the target computed: a prompt chunk, or the accepted
                       proposals not written yet, plus the token the step sampled
    draft loop         k - 1 decode forwards of one token per proposing request, each fed
                       the previous proposal on the device; positions, slots and block
                       tables of every iteration are computed once, up front, and each
                       iteration takes a slice (requests proposing fewer drop off the end)

A step that neither verifies nor proposes (speculation off for it, above
``disable_by_batch_size``) runs the draft over the target's own inputs instead
(``follow``): it reads no sampled id, so such a step can stay in flight under
asynchronous scheduling.

The first proposal comes from the catch-up forward's last row, so ``k`` proposals cost
``k`` draft forwards. The proposals' K/V land in the request's slots past its last token
(the scheduler allocated them: ``num_lookahead_tokens``); those of proposals the target
accepts count toward ``draft_end`` at the next step, the others are overwritten.

Once a request's prompt is in, its catch-up computes 1 or 2 tokens
(``MAX_CATCH_UP_TOKENS``): the token the step sampled, after the last proposal when the
target accepted them all (the draft loop wrote the K/V of every proposal but the last).
On CUDA such a catch-up replays the draft's verify graphs of 2 rows a request
(``cuda_graphs.py``); a longer one (a prompt chunk beside) runs eagerly.

A random request's proposals are drawn from the draft's distribution processed exactly
as the target's is (penalties counting the earlier proposals, temperature, top-k, top-p,
min-p), with the request's own generator; those distributions are kept for the
rejection sampler (``probs``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.layers.attention.backend import set_forward_context
from pagedllm.layers.sampler import (
    SamplingMetadata,
    exponential_noise,
    penalized_logits,
    sampling_probs,
)
from pagedllm.models.loader import load_model
from pagedllm.worker.input_batch import CachedRequestState, InputBatch, StepInputs
from pagedllm.worker.kv_allocator import allocate_kv_caches

# The most tokens a request's catch-up forward computes once its prompt is in (see the
# module docstring): the rows a request gets in the draft's verify graphs.
MAX_CATCH_UP_TOKENS = 2

# forward(inputs, pending_ids) -> hidden states [T, hidden] of the draft over ``inputs``,
# its pending tokens' ids read from ``pending_ids`` (by ``pending_sample_rows``).
Forward = Callable[[StepInputs, "torch.Tensor | None"], torch.Tensor]


class DraftModel:
    """The draft model with its KV cache (``num_blocks`` blocks of the target's layout)."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        spec = config.speculative_config
        self.config = config
        self.model_config = spec.draft_model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = self.model_config.vocab_size
        self.model = load_model(self.model_config, device, dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner = None  # CudaGraphRunner of the draft's forwards, set by the runner
        # request id -> [n, V] float32: the distributions its last proposals were drawn from
        # (random requests only).
        self._probs: dict[str, torch.Tensor] = {}

    def _draft_config(self) -> EngineConfig:
        return EngineConfig(self.model_config, self.config.cache_config,
                            self.config.scheduler_config, device=self.config.device,
                            parallel_config=self.config.parallel_config)

    def allocate_kv_cache(self, num_blocks: int, cache_dtype: torch.dtype) -> None:
        self.kv_caches = allocate_kv_caches(self._draft_config(), num_blocks, cache_dtype,
                                            self.device)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One forward of ``num_tokens`` tokens with no cache (memory profiling)."""
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        with set_forward_context(None, []):
            self.model(input_ids, positions)

    def probs(self, request_id: str) -> torch.Tensor | None:
        """``[n, V]``: the distributions of the request's pending proposals, or None (greedy
        proposals)."""
        return self._probs.get(request_id)

    def forget(self, request_id: str) -> None:
        self._probs.pop(request_id, None)

    # -- after a step ---------------------------------------------------------------------
    def propose(
        self,
        batch: InputBatch,
        inputs: StepInputs,
        num_scheduled: list[int],
        num_verified: list[int],
        new_tokens: list[list[int]],
        num_lookahead: int,
        generators: dict[str, torch.Generator],
        forward: Forward,
    ) -> dict[str, list[int]]:
        """Bring the draft's K/V up to the step's tokens and propose each sampled request's
        next tokens (see the module docstring). ``inputs`` is the step's; per scheduled
        request (in its order): tokens the step computed, proposals it verified, and the
        tokens it yielded (already appended to ``batch``). Returns request id -> proposals.
        """
        spans = self._catch_up_spans(inputs, num_scheduled, num_verified, new_tokens)
        if spans is None:
            return {}
        indices, starts, ends = spans
        states = [inputs.states[i] for i in indices]
        count = [self._num_proposals(inputs.states[i], num_lookahead) if new_tokens[i] else 0
                 for i in indices]
        # Proposing requests, most proposals first: the draft loop's batches are prefixes.
        order = sorted((j for j in range(len(indices)) if count[j] > 0), key=lambda j: -count[j])
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        step = batch.spans([s.request_id for s in states], states, rows, starts, ends - starts)
        hidden = forward(step, None)
        for state, end in zip(states, ends.tolist()):
            state.draft_end = end
        if not order:
            return {}
        last_rows = torch.from_numpy(step.logits_indices[order]).to(self.device)
        logits = self.model.compute_logits(hidden[last_rows])
        proposing = [states[j] for j in order]
        counts = [count[j] for j in order]
        drafted = self._draft_loop(batch, proposing, counts, logits, generators, forward)
        for state, n in zip(proposing, counts):
            state.num_draft_kv = n - 1
        return drafted

    def follow(self, inputs: StepInputs, forward: Callable[[], torch.Tensor]) -> None:
        """A step that neither verifies nor proposes (speculation off for it): the draft
        computes the step's tokens as the target did, ``forward()`` running it over the
        target's ``inputs``, so its K/V keep up without waiting for the step's sampled ids
        (the next step computes the sampled token in both models). Keeps the invariant:
        ``draft_end`` is never below a step's start (a proposing step leaves it at the
        request's tokens), so after this it is at least the step's end."""
        forward()
        for state, end in zip(inputs.states, inputs.seq_lens.tolist()):
            state.draft_end = max(state.draft_end, end)
            state.num_draft_kv = 0  # proposals never verified: later tokens overwrite them

    def _catch_up_spans(
        self,
        inputs: StepInputs,
        num_scheduled: list[int],
        num_verified: list[int],
        new_tokens: list[list[int]],
    ) -> tuple[list[int], np.ndarray, np.ndarray] | None:
        """(scheduled request indices, span starts, span ends) of the tokens the draft
        has not written: from ``draft_end`` (moved past the accepted proposals whose K/V
        the draft wrote) to the target's computed tokens, plus the sampled token if the
        request's slots reach it (if not, the step that computes it allocates its slot,
        and the draft writes it then)."""
        indices, starts, ends = [], [], []
        for i, state in enumerate(inputs.states):
            if num_verified[i]:
                accepted = len(new_tokens[i]) - 1
                state.draft_end += min(accepted, state.num_draft_kv)
            state.num_draft_kv = 0
            end = state.num_tokens if new_tokens[i] else state.num_computed_tokens + num_scheduled[i]
            end = min(end, state.num_blocks * self.block_size)
            if end > state.draft_end:
                indices.append(i)
                starts.append(state.draft_end)
                ends.append(end)
        if not indices:
            return None
        return indices, np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)

    def _num_proposals(self, state: CachedRequestState, num_lookahead: int) -> int:
        """How many tokens to propose for a request that sampled: ``num_lookahead``, but no
        more than its KV slots past its last token hold, nor than it can still keep."""
        params = state.sampling_params
        if not num_lookahead:
            return 0
        last = state.num_tokens - 1
        room = state.num_blocks * self.block_size - last
        max_tokens = self.max_model_len - state.num_prompt_tokens
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        useful = max_tokens - len(state.output_token_ids) - 1
        return max(0, min(num_lookahead, room, useful))

    def _draft_loop(
        self,
        batch: InputBatch,
        states: list[CachedRequestState],
        counts: list[int],
        logits: torch.Tensor,
        generators: dict[str, torch.Generator],
        forward: Forward,
    ) -> dict[str, list[int]]:
        """``counts[i]`` proposals for ``states[i]`` (``counts`` descending), the first from
        ``logits``, each next one from a one-token decode of the previous."""
        n = len(states)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=n)
        last = np.fromiter((s.num_tokens - 1 for s in states), dtype=np.int64, count=n)
        tokens, probs = self._draw(logits, states, [], generators)
        drafted, distributions = [tokens], [probs]
        steps = max(counts)
        if steps > 1:
            plan = _DecodePlan(batch, rows, last, steps - 1, self.block_size)
            active = np.asarray(counts)
            for j in range(1, steps):
                m = int((active > j).sum())
                hidden = forward(plan.step(j, m, [s.request_id for s in states[:m]],
                                           states[:m]), drafted[-1][:m])
                logits = self.model.compute_logits(hidden)
                tokens, probs = self._draw(logits, states[:m], [t[:m] for t in drafted],
                                           generators)
                drafted.append(tokens)
                distributions.append(probs)
        flat = torch.cat(drafted).tolist()
        proposals: dict[str, list[int]] = {}
        offsets = np.cumsum([0] + [len(t) for t in drafted])
        for i, (state, count) in enumerate(zip(states, counts)):
            req_id = state.request_id
            proposals[req_id] = [flat[offsets[j] + i] for j in range(count)]
            if distributions[0] is not None and not state.sampling_params.greedy:
                self._probs[req_id] = torch.stack([distributions[j][i] for j in range(count)])
            else:
                self._probs.pop(req_id, None)
        return proposals

    def _draw(
        self,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        earlier: list[torch.Tensor],
        generators: dict[str, torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One proposal per row of ``logits [m, V]`` (row ``i`` is ``states[i]``'s next
        token after its ``earlier`` proposals, each ``[m]`` on the device): greedy rows
        take the argmax, random rows draw from their processed distribution, returned as
        ``[m, V]`` (None when every row is greedy)."""
        params = [s.sampling_params for s in states]
        if all(p.greedy and not p.has_penalties and not p.min_tokens and not p.bad_words_token_ids
               for p in params):
            return logits.argmax(dim=-1), None
        pending = None
        if earlier and any(p.reads_output for p in params):
            m = len(states)
            pending = ([r for _ in earlier for r in range(m)], torch.cat(earlier))
        meta = SamplingMetadata.build(
            params=params,
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            generators=[generators.get(s.request_id) for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
            pending_token_ids=pending,
        )
        penalized = penalized_logits(logits, meta)
        greedy = penalized.argmax(dim=-1)
        if meta.all_greedy:
            return greedy, None
        probs = sampling_probs(penalized, meta)
        drawn = (probs / exponential_noise(probs, meta.generators)).argmax(dim=-1)
        if not meta.all_random:
            drawn = torch.where(meta.greedy_mask, greedy, drawn)
        return drawn, probs


class _DecodePlan:
    """The inputs of every iteration of the draft loop, computed once: iteration ``j``
    (1-based) feeds each of the first ``m`` requests its proposal ``j`` at position
    ``last + j``. Positions a request never reaches (past its own count, which may run
    past its block table) get a slot of its last table column: computed, never used."""

    def __init__(self, batch: InputBatch, rows: np.ndarray, last: np.ndarray, steps: int,
                 block_size: int) -> None:
        self.positions = last[None, :] + np.arange(1, steps + 1)[:, None]  # [steps, n]
        blocks = batch.block_table[rows]  # [n, max_blocks]
        columns = np.minimum(self.positions // block_size, blocks.shape[1] - 1)
        self.slots = (np.take_along_axis(blocks, columns.T, axis=1).T.astype(np.int64)
                      * block_size + self.positions % block_size)
        width = -(-int(self.positions.max() + 1) // block_size)
        self.block_tables = blocks[:, :width]
        self.index = np.arange(len(rows) + 1, dtype=np.int64)

    def step(self, j: int, m: int, req_ids: list[str], states: list[CachedRequestState]) -> StepInputs:
        positions = self.positions[j - 1, :m]
        return StepInputs(
            req_ids=req_ids,
            states=states,
            input_ids=np.zeros(m, dtype=np.int64),  # the previous proposals, on the device
            positions=positions,
            slot_mapping=self.slots[j - 1, :m],
            query_start_loc=self.index[:m + 1],
            seq_lens=positions + 1,
            block_tables=self.block_tables[:m],
            max_query_len=1,
            sample_req_indices=list(range(m)),
            logits_indices=self.index[:m],
            pending_token_indices=self.index[:m],
            pending_sample_rows=self.index[:m],
        )
