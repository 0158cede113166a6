"""Verifying proposed tokens: which proposals the target keeps, and the token it adds.

A speculating request's step computes its last token and ``k`` proposals ``d_1..d_k``, so
the target gives ``k + 1`` next-token distributions ``P_1..P_{k+1}``: ``P_j`` follows
``d_1..d_{j-1}``, processed as any sampled row is (penalties and ``min_tokens`` counting
those proposals as output, then temperature, top-k, top-p, min-p; see ``sampler.py``).
The step yields ``a + 1`` tokens, ``0 <= a <= k``::

    greedy   d_1..d_a, the longest run with d_j == argmax P_j, then argmax P_{a+1}:
             exactly the tokens decoding without speculation produces.
    random   (Leviathan et al. 2023; Chen et al. 2023) d_j is kept with probability
             min(1, P_j(d_j) / Q_j(d_j)), Q_j the proposer's distribution (a point mass
             for n-gram lookup); at the first rejection the token is drawn from
             norm(max(0, P_j - Q_j)) and the run ends; if all k are kept, a bonus token
             is drawn from P_{k+1}. Each token then has exactly the target's distribution.

Randomness per request: ``k`` uniforms, then one exponential draw of ``V`` values per
target row (``argmax(probs / noise)`` samples ``probs``), from the request's own generator
when it is seeded, so its tokens do not depend on the batch. The acceptance arithmetic is
one vectorised pass over all rows; the only host sync is reading the decisions.
"""

from __future__ import annotations

import torch

from pagedllm.layers.sampler import (
    SamplingMetadata,
    exponential_noise,
    penalized_logits,
    sampling_probs,
)


def verify(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    greedy: list[bool],
    generators: list[torch.Generator | None],
) -> list[list[int]]:
    """The tokens each request keeps: its accepted proposals, then one of the target's.

    ``logits [N, V]``: the target's raw logits, request ``r``'s ``k_r + 1`` rows together
    in request order (``N = sum(k_r + 1)``); ``meta`` describes those ``N`` rows (each
    request's parameters repeated, row ``j``'s output counting ``d_1..d_j``).
    Per request: ``draft_token_ids`` (``k_r >= 0`` proposals), ``draft_probs`` (``[k_r, V]``
    float32: the distribution each proposal was drawn from; None: a point mass, or
    greedy), ``greedy``, and its seeded generator or None.
    """
    num_draft = [len(d) for d in draft_token_ids]
    if logits.shape[0] != sum(num_draft) + len(num_draft):
        raise ValueError(
            f"logits has {logits.shape[0]} rows but {len(num_draft)} requests with "
            f"{sum(num_draft)} proposals need {sum(num_draft) + len(num_draft)}."
        )
    device = logits.device
    penalized = penalized_logits(logits, meta)
    drafts = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.long)
    drafts = drafts.to(device, non_blocking=True)
    target_rows = torch.tensor(_target_rows(num_draft), dtype=torch.long).to(device, non_blocking=True)
    tokens = penalized.argmax(dim=-1)
    accepted = tokens[target_rows] == drafts
    if not all(greedy):
        random_rows = [r for r, g in enumerate(greedy) if not g]
        uniform, noise = _draws(random_rows, num_draft, generators, penalized.shape[-1], device)
        q = _draft_distributions(drafts, penalized.shape[-1], num_draft, draft_probs, random_rows)
        random_accepted, random_tokens = _verify_random(
            sampling_probs(penalized, meta), q, drafts, target_rows, num_draft, random_rows,
            uniform, noise)
        is_random_row = _row_mask(random_rows, num_draft, extra=1, device=device)
        is_random_draft = _row_mask(random_rows, num_draft, extra=0, device=device)
        tokens = torch.where(is_random_row, random_tokens, tokens)
        accepted = torch.where(is_random_draft, random_accepted, accepted)
    host = torch.cat([accepted.long(), tokens]).tolist()
    return _runs(draft_token_ids, host[:len(drafts)], host[len(drafts):])


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft: list[int],
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> list[list[int]]:
    """The rule on its own, from given randomness (see the module docstring).

    ``target_probs [N, V]`` (rows grouped by request, ``k_r + 1`` each), ``draft_probs
    [M, V]`` or None (point masses), ``draft_token_ids [M]``, ``uniform [M]`` in [0, 1),
    ``noise [N, V]`` Exp(1). Returns each request's kept tokens.
    """
    target_rows = torch.tensor(_target_rows(num_draft), dtype=torch.long, device=target_probs.device)
    requests = list(range(len(num_draft)))
    q = draft_probs
    if q is None:
        q = _draft_distributions(draft_token_ids, target_probs.shape[-1], num_draft,
                                 [None] * len(num_draft), [])
    accepted, tokens = _verify_random(target_probs, q, draft_token_ids, target_rows, num_draft,
                                      requests, uniform, noise)
    host = torch.cat([accepted.long(), tokens]).tolist()
    drafts = draft_token_ids.tolist()
    offsets = [0]
    for k in num_draft:
        offsets.append(offsets[-1] + k)
    per_request = [drafts[offsets[r]:offsets[r + 1]] for r in requests]
    return _runs(per_request, host[:len(drafts)], host[len(drafts):])


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """The chance of keeping a proposal the proposer drew with probability ``q_draft`` and
    the target gives ``p_draft`` (compared with a uniform in [0, 1): ratios of 1 or more
    always keep it)."""
    return p_draft / q_draft


def _draft_distributions(
    drafts: torch.Tensor,
    vocab: int,
    num_draft: list[int],
    draft_probs: list[torch.Tensor | None],
    requests: list[int],
) -> torch.Tensor:
    """``Q [M, V]``: each proposal's distribution; point masses on the proposals, except
    for the ``requests`` whose ``draft_probs`` are given."""
    q = torch.zeros(drafts.shape[0], vocab, dtype=torch.float32, device=drafts.device)
    q.scatter_(1, drafts.unsqueeze(1), 1.0)
    offsets = [0]
    for k in num_draft:
        offsets.append(offsets[-1] + k)
    for r in requests:
        if draft_probs[r] is not None and num_draft[r]:
            q[offsets[r]:offsets[r + 1]] = draft_probs[r][:num_draft[r]].float()
    return q


def _verify_random(
    target_probs: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    target_rows: torch.Tensor,
    num_draft: list[int],
    random_requests: list[int],
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [M], token [N])`` under the random rule, valid on the rows of
    ``random_requests`` (``uniform`` and ``noise`` hold their draws, in order; other
    rows are left as anything). ``token[i]`` is what row ``i`` yields if the run ends
    there: a draw from the residual ``max(0, P - Q)`` on a proposal's row, from ``P`` on
    a request's last row."""
    device = target_probs.device
    p_rows = target_probs[target_rows]  # [M, V]: P_j on proposal j's row
    p_draft = p_rows.gather(1, drafts.unsqueeze(1)).squeeze(1)
    q_draft = q.gather(1, drafts.unsqueeze(1)).squeeze(1)
    draft_index = torch.tensor(_draft_positions(random_requests, num_draft), dtype=torch.long,
                               device=device)
    accepted = torch.zeros(drafts.shape[0], dtype=torch.bool, device=device)
    accepted[draft_index] = uniform < acceptance_probability(p_draft[draft_index],
                                                             q_draft[draft_index])
    residual = (p_rows - q).clamp_(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # No mass left (P <= Q everywhere, which makes rejection impossible up to rounding):
    # fall back to P.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_rows)
    final = target_probs.clone()
    final[target_rows] = residual
    row_index = torch.tensor(_all_rows(random_requests, num_draft), dtype=torch.long, device=device)
    tokens = torch.zeros(target_probs.shape[0], dtype=torch.long, device=device)
    tokens[row_index] = (final[row_index] / noise).argmax(dim=-1)
    return accepted, tokens


def _draws(
    random_requests: list[int],
    num_draft: list[int],
    generators: list[torch.Generator | None],
    vocab: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms (one per proposal) and exponential noise (one row of ``V`` per target row)
    of the random requests, in order: each seeded request's from its own generator, first
    its uniforms, then its noise."""
    uniforms, noises = [], []
    for r in random_requests:
        k, generator = num_draft[r], generators[r]
        uniforms.append(torch.rand(k, device=device, generator=generator))
        rows = torch.empty(k + 1, vocab, dtype=torch.float32, device=device)
        noises.append(exponential_noise(rows, {} if generator is None else dict.fromkeys(
            range(k + 1), generator)))
    return torch.cat(uniforms), torch.cat(noises)


def _target_rows(num_draft: list[int]) -> list[int]:
    """For each proposal in order, the target row that judges it: request ``r``'s rows
    start at ``sum(k + 1)`` over the requests before it, and proposal ``j`` is judged by
    its row ``j``."""
    rows, start = [], 0
    for k in num_draft:
        rows.extend(range(start, start + k))
        start += k + 1
    return rows


def _draft_positions(requests: list[int], num_draft: list[int]) -> list[int]:
    """Indices, among all proposals, of the proposals of ``requests``."""
    starts = [0]
    for k in num_draft:
        starts.append(starts[-1] + k)
    return [i for r in requests for i in range(starts[r], starts[r + 1])]


def _all_rows(requests: list[int], num_draft: list[int]) -> list[int]:
    """Indices, among all target rows, of the rows of ``requests``."""
    starts = [0]
    for k in num_draft:
        starts.append(starts[-1] + k + 1)
    return [i for r in requests for i in range(starts[r], starts[r + 1])]


def _row_mask(requests: list[int], num_draft: list[int], extra: int, device) -> torch.Tensor:
    """A bool mask over target rows (``extra=1``) or proposals (``extra=0``), True on
    those of ``requests``."""
    total = sum(num_draft) + extra * len(num_draft)
    mask = torch.zeros(total, dtype=torch.bool)
    index = _all_rows(requests, num_draft) if extra else _draft_positions(requests, num_draft)
    mask[index] = True
    return mask.to(device, non_blocking=True)


def _runs(draft_token_ids: list[list[int]], accepted: list[int], tokens: list[int]) -> list[list[int]]:
    """Per request: its proposals up to the first rejected one, then the token of the row
    where the run ended."""
    out = []
    draft_start = row_start = 0
    for drafts in draft_token_ids:
        k = len(drafts)
        kept = 0
        while kept < k and accepted[draft_start + kept]:
            kept += 1
        out.append(drafts[:kept] + [tokens[row_start + kept]])
        draft_start += k
        row_start += k + 1
    return out
