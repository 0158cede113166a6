"""The rejection sampler keeps the target's distribution exactly, and a wrong rule is caught.

A toy "model" over a vocabulary of 6 whose next-token distribution depends only on the
position (``P[t]``), a proposer drawing from other distributions (``Q[t]``), and 20,000
sequences of 3 tokens generated step by step with 3 proposals a step: the tokens at each
position, and the pairs at positions 0 and 1, must follow ``P`` by a chi-square test.
The same test run with a deliberately wrong acceptance rule must fail it.

Under an output constraint (a toy grammar allowing a few tokens at each position), the
target's distributions are masked, proposals are cut as the scheduler cuts them
(``proposals_to_verify``), and the tokens must follow the masked ``P``; cutting drawn
proposals before the refused one, which is wrong, must fail the test.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.scheduler import proposals_to_verify
from pagedllm.layers import rejection_sampler
from pagedllm.layers.rejection_sampler import rejection_sample, verify
from pagedllm.layers.sampler import SamplingMetadata
from pagedllm.sampling_params import SamplingParams

V, K, LENGTH, TRIALS = 6, 3, 3, 20_000


def distributions(seed: int) -> torch.Tensor:
    logits = torch.randn(LENGTH + K, V, generator=torch.Generator().manual_seed(seed)) * 1.5
    return logits.softmax(dim=-1)


P, Q = distributions(1), distributions(2)


# The toy grammar: position t allows the tokens of ALLOWED[t]; the proposer's Q puts most
# of its mass elsewhere.
ALLOWED = torch.zeros(LENGTH + K, V, dtype=torch.bool)
ALLOWED[:, :3] = True
ALLOWED[1] = torch.tensor([False, True, True, False, True, False])


def masked(probs: torch.Tensor) -> torch.Tensor:
    allowed = probs * ALLOWED[:probs.shape[0]]
    return allowed / allowed.sum(dim=-1, keepdim=True)


def generate(point_mass: bool, seed: int = 0, constrained: bool = False,
             cut=proposals_to_verify) -> torch.Tensor:
    """``[TRIALS, LENGTH]`` tokens, each trial decoded with speculation until it has
    ``LENGTH`` tokens. ``point_mass``: the proposer always proposes ``argmax Q[t]`` and the
    sampler is told nothing about its distribution (as with n-gram lookup).
    ``constrained``: the target's distributions masked by ``ALLOWED``, and each trial's
    proposals cut to ``cut(num_allowed, K, drawn)``."""
    gen = torch.Generator().manual_seed(seed)
    target_probs = masked(P) if constrained else P
    outputs: list[list[int]] = [[] for _ in range(TRIALS)]
    while True:
        active = [i for i, out in enumerate(outputs) if len(out) < LENGTH]
        if not active:
            break
        pos = torch.tensor([len(outputs[i]) for i in active])
        draft_pos = pos[:, None] + torch.arange(K)  # [n, K]
        q = Q[draft_pos]  # [n, K, V]
        if point_mass:
            drafts = q.argmax(dim=-1)
        else:
            drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(len(active), K)
        num_draft = [K] * len(active)
        if constrained:
            allowed = ALLOWED[draft_pos, drafts].long().cumprod(dim=-1).sum(dim=-1).tolist()
            num_draft = [cut(a, K, not point_mass) for a in allowed]
        keep = torch.arange(K)[None, :] < torch.tensor(num_draft)[:, None]  # [n, K]
        rows = torch.cat([pos[i] + torch.arange(k + 1) for i, k in enumerate(num_draft)])
        runs = rejection_sample(
            target_probs=target_probs[rows],
            draft_probs=None if point_mass else q[keep],
            draft_token_ids=drafts[keep],
            num_draft=num_draft,
            uniform=torch.rand(sum(num_draft), generator=gen),
            noise=torch.empty(len(rows), V).exponential_(generator=gen),
        )
        for i, run in zip(active, runs):
            assert 1 <= len(run) <= K + 1
            outputs[i].extend(run)
    return torch.tensor([out[:LENGTH] for out in outputs])


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of counts ``observed`` against the
    probabilities ``expected_probs`` (cells with expected count under 5 pooled; a count in
    a cell of probability 0 gives 0)."""
    expected = expected_probs.double().flatten() * observed.sum()
    observed = observed.double().flatten()
    impossible = expected == 0
    if observed[impossible].any():
        return 0.0
    expected, observed = expected[~impossible], observed[~impossible]
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def p_values(tokens: torch.Tensor, target: torch.Tensor = P) -> list[float]:
    """One test per position, and one of the joint pairs at positions 0 and 1, against
    the target's per-position distributions ``target``."""
    values = [chi_square_p_value(torch.bincount(tokens[:, t], minlength=V), target[t])
              for t in range(LENGTH)]
    pairs = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
    values.append(chi_square_p_value(pairs, target[0][:, None] * target[1][None, :]))
    return values


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-distribution", "point-mass"])
def test_output_follows_the_target_distribution(point_mass):
    assert min(p_values(generate(point_mass))) > 1e-3


@pytest.mark.parametrize("wrong_rule", [
    pytest.param(lambda p, q: torch.ones_like(p), id="accept-every-proposal"),
    pytest.param(lambda p, q: q / p, id="inverted-ratio"),
    pytest.param(lambda p, q: p, id="ignores-the-proposer"),
])
def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch, wrong_rule):
    monkeypatch.setattr(rejection_sampler, "acceptance_probability", wrong_rule)
    assert min(p_values(generate(point_mass=False))) < 1e-6


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-distribution", "point-mass"])
def test_constrained_output_follows_the_masked_target_distribution(point_mass):
    tokens = generate(point_mass, constrained=True)
    assert ALLOWED[torch.arange(LENGTH), tokens].all()
    assert min(p_values(tokens, masked(P))) > 1e-3


def test_cutting_drawn_proposals_before_the_refused_one_fails_the_same_test():
    tokens = generate(point_mass=False, constrained=True, cut=lambda allowed, k, drawn: allowed)
    assert min(p_values(tokens, masked(P))) < 1e-6


def _meta(params: list[SamplingParams], drafts: list[list[int]], vocab: int,
          generators=None) -> SamplingMetadata:
    rows_params, outputs, row_generators = [], [], []
    for i, (p, d) in enumerate(zip(params, drafts)):
        for j in range(len(d) + 1):
            rows_params.append(p)
            outputs.append(list(d[:j]))
            row_generators.append(generators[i] if generators else None)
    n = len(rows_params)
    return SamplingMetadata.build(params=rows_params, prompt_token_ids=[[0]] * n,
                                  output_token_ids=outputs, generators=row_generators,
                                  vocab_size=vocab, device="cpu")


def test_greedy_keeps_the_longest_agreeing_run_then_the_target_argmax():
    logits = torch.full((7, 10), -5.0)
    argmax = [3, 4, 9, 1, 6, 2, 8]
    logits[torch.arange(7), argmax] = 5.0
    drafts = [[3, 4, 5], [6, 2]]  # rows 0-3 judge the first, rows 4-6 the second
    params = [SamplingParams(temperature=0.0)] * 2
    runs = verify(logits, _meta(params, drafts, 10), drafts, [None, None], [True, True],
                  [None, None])
    assert runs == [[3, 4, 9], [6, 2, 8]]


def test_penalties_count_the_proposals_before_each_row():
    # Row 1 would pick token 4 again, but a strong repetition penalty on the proposal
    # before it (token 4) makes token 5 the greedy choice there.
    logits = torch.zeros(3, 8)
    logits[:, 4] = 3.0
    logits[:, 5] = 2.0
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    runs = verify(logits, _meta(params, [[4, 4]], 8), [[4, 4]], [None], [True], [None])
    assert runs == [[4, 5]]


def test_a_seeded_request_verifies_the_same_whatever_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 16)
    seeded = SamplingParams(temperature=1.0, seed=7)
    other = SamplingParams(temperature=0.9)
    drafts = [[1, 2, 3], [4, 5, 6]]

    def run_seeded(with_other: bool) -> list[int]:
        requests = [seeded, other] if with_other else [seeded]
        d = drafts if with_other else drafts[:1]
        rows = logits if with_other else logits[:4]
        generators = [torch.Generator().manual_seed(7)] + [None] * (len(d) - 1)
        return verify(rows, _meta(requests, d, 16, generators), d, [None] * len(d),
                      [False] * len(d), generators)[0]

    assert run_seeded(True) == run_seeded(False)
