"""The sampling side of a speculative step: each verifying request's ``k + 1`` target rows
through the rejection sampler (``layers/rejection_sampler.py``), and the logprobs of the
tokens it keeps.

Row ``j`` of a request judges its proposal ``j + 1`` (the last row gives the token after
all of them), so each row is sampled as if the proposals before it were output already:
its penalties and ``min_tokens`` count them, and under an output constraint its logits are
masked by the grammar's state after them (the masked logits are the raw ones, as in
``sampler.py``: logprobs are of the masked distribution).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from pagedllm.core.outputs import LogprobsEntry
from pagedllm.layers.rejection_sampler import verify
from pagedllm.layers.sampler import SamplingMetadata, apply_token_bitmask, gather_logprobs
from pagedllm.worker.input_batch import CachedRequestState, StepInputs


def verify_proposals(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    inputs: StepInputs,
    indices: list[int],
    spec_token_ids: dict[str, list[int]],
    generators: dict[str, torch.Generator],
    draft_probs: Callable[[str], torch.Tensor | None],
    vocab_size: int,
    grammar_bitmask: Callable[[list[str], list[list[int]]], torch.Tensor],
) -> tuple[list[list[int]], dict[str, list[LogprobsEntry]]]:
    """The tokens each of the step's requests ``indices`` (into ``inputs``) keeps, and the
    logprobs of those tokens for the requests that ask for them.

    ``grammar_bitmask(request_ids, proposals)``: the bitmask of the constrained requests'
    verification rows (theirs only, in order; int32 ``[rows, words]`` on the device), asked
    only when the step has some."""
    device = hidden_states.device
    states = [inputs.states[i] for i in indices]
    drafts = [spec_token_ids[s.request_id] for s in states]
    starts = inputs.query_start_loc[indices]
    rows = np.concatenate([np.arange(start, start + len(d) + 1) for start, d in zip(starts, drafts)])
    logits = compute_logits(hidden_states[torch.from_numpy(rows).to(device)])
    constrained = [n for n, s in enumerate(states) if s.sampling_params.structured_outputs is not None]
    if constrained:
        logits = _masked(logits, states, drafts, constrained, grammar_bitmask)
    meta = _row_metadata(states, drafts, generators, vocab_size, device)
    runs = verify(
        logits, meta, drafts,
        draft_probs=[draft_probs(s.request_id) for s in states],
        greedy=[s.sampling_params.greedy for s in states],
        generators=[generators.get(s.request_id) for s in states],
    )
    return runs, _logprobs(logits, states, drafts, runs)


def _masked(
    logits: torch.Tensor,
    states: list[CachedRequestState],
    drafts: list[list[int]],
    constrained: list[int],
    grammar_bitmask: Callable[[list[str], list[list[int]]], torch.Tensor],
) -> torch.Tensor:
    """``logits`` with the rows of the ``constrained`` requests (indices into ``states``)
    masked by their grammars."""
    starts = np.cumsum([0] + [len(d) + 1 for d in drafts])
    rows = np.concatenate([np.arange(starts[n], starts[n + 1]) for n in constrained])
    bitmask = grammar_bitmask([states[n].request_id for n in constrained],
                              [drafts[n] for n in constrained])
    return apply_token_bitmask(logits, torch.from_numpy(rows).to(logits.device), bitmask)


def _row_metadata(
    states: list[CachedRequestState],
    drafts: list[list[int]],
    generators: dict[str, torch.Generator],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Sampling metadata of every target row: the request's parameters and its output so
    far, the proposals before the row counted as pending output (only where penalties,
    ``min_tokens`` or bad words read the output; the lists are shared, never copied)."""
    params, prompts, outputs, row_generators = [], [], [], []
    pending_rows, pending_ids = [], []
    for state, draft in zip(states, drafts):
        generator = generators.get(state.request_id)
        p = state.sampling_params
        reads_output = (p.has_penalties or p.min_tokens > len(state.output_token_ids)
                        or p.bans_after_output)
        for j in range(len(draft) + 1):
            if reads_output:
                pending_rows.extend([len(params)] * j)
                pending_ids.extend(draft[:j])
            params.append(p)
            prompts.append(state.prompt_token_ids)
            outputs.append(state.output_token_ids)
            row_generators.append(generator)
    pending = None
    if pending_rows:
        ids = torch.tensor(pending_ids, dtype=torch.long).to(device, non_blocking=True)
        pending = (pending_rows, ids)
    return SamplingMetadata.build(params=params, prompt_token_ids=prompts,
                                  output_token_ids=outputs, generators=row_generators,
                                  vocab_size=vocab_size, device=device,
                                  pending_token_ids=pending)


def _logprobs(
    logits: torch.Tensor,
    states: list[CachedRequestState],
    drafts: list[list[int]],
    runs: list[list[int]],
) -> dict[str, list[LogprobsEntry]]:
    """Per request asking for ``logprobs``: each kept token's logprob under the raw logits
    of the row that produced it, with the row's top ``k``."""
    wanted = [i for i, s in enumerate(states) if s.sampling_params.logprobs is not None]
    if not wanted:
        return {}
    starts = np.cumsum([0] + [len(d) + 1 for d in drafts])
    rows = [starts[i] + j for i in wanted for j in range(len(runs[i]))]
    tokens = [t for i in wanted for t in runs[i]]
    device = logits.device
    raw = torch.log_softmax(logits[torch.tensor(rows, device=device)], dim=-1, dtype=torch.float32)
    k = max(states[i].sampling_params.logprobs for i in wanted)
    tensors = gather_logprobs(raw, torch.tensor(tokens, dtype=torch.long, device=device), k)
    result, at = {}, 0
    for i in wanted:
        state = states[i]
        n = len(runs[i])
        result[state.request_id] = [tensors.to_entries(at + j, state.sampling_params.logprobs)
                                    for j in range(n)]
        at += n
    return result
