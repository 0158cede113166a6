"""A refused constrained row settled by its best candidates is drawn again exactly as under
its grammar's whole mask (CPU under the Triton interpreter, as the GPU's Gumbel race)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from pagedllm.layers import triton_ops
from pagedllm.layers.sampler import Draw, Sampler
from pagedllm.structured.manager import settle_row
from tests.utils import token_bitmask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K = 8


class SetGrammar:
    """A grammar state that allows a fixed set of tokens."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed

    def is_allowed(self, token: int) -> bool:
        return bool(self.allowed[token])


def gumbel_draw(logits: torch.Tensor, greedy: torch.Tensor, seed: int = 0) -> Draw:
    rows = logits.shape[0]
    gen = torch.Generator().manual_seed(seed)
    temperature = torch.rand(rows, generator=gen) + 0.5
    seeds = torch.randint(0, 2**31 - 1, (rows,), generator=gen)
    meta = SimpleNamespace(all_greedy=False, temperature=temperature.to(DEVICE),
                           greedy_mask=greedy.to(DEVICE))
    return Draw(logits=logits.to(DEVICE), meta=meta, noise=seeds.to(DEVICE))


def test_gumbel_scores_are_the_scores_the_race_takes_the_best_of() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 5000, generator=gen) * 3).to(torch.bfloat16)
    logits[2, 100:4000] = float("-inf")
    temperature = torch.tensor([1.0, 0.7, 1.3, 2.0, 1e-3, 1.0])
    seeds = torch.tensor([5, 6, 7, 8, 9, 10])
    args = logits.to(DEVICE), temperature.to(DEVICE), seeds.to(DEVICE)
    scores = triton_ops.gumbel_scores(*args)
    assert scores.dtype == torch.float32 and scores.shape == (6, 5000)
    assert scores.argmax(-1).tolist() == triton_ops.gumbel_sample(*args).tolist()
    assert bool((scores[2, 100:4000] == float("-inf")).all())
    # The noise is Gumbel: the scores less the scaled logits average Euler's constant.
    noise = scores[0] - logits[0].float().to(DEVICE)
    assert abs(noise.mean().item() - 0.5772) < 0.05


def test_a_row_settled_by_its_candidates_redraws_as_under_the_whole_mask() -> None:
    """Rows with many, some and few allowed tokens, greedy and random, bf16 logits (ties):
    the redraw over the candidates' mask is the redraw over the grammar's mask, and the
    rows where most tokens are allowed are settled."""
    rows, vocab = 64, 5000
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(torch.bfloat16)
    greedy = torch.arange(rows) % 2 == 0
    density = torch.tensor([0.9, 0.5, 0.05, 0.002]).repeat_interleave(rows // 4)
    allowed = torch.rand(rows, vocab, generator=gen) < density.unsqueeze(-1)
    draw = gumbel_draw(logits, greedy)
    index = torch.arange(rows, device=DEVICE)
    ids, scores = Sampler.candidates(draw, index, K)
    full = token_bitmask(allowed)
    mixed = full.numpy().copy()
    settled = [settle_row(SetGrammar(allowed[r]), ids[r].tolist(), scores[r].tolist(), mixed[r])
               for r in range(rows)]
    want = Sampler.redraw(draw, index, full.to(DEVICE))
    got = Sampler.redraw(draw, index, torch.from_numpy(mixed).to(DEVICE))
    assert got.tolist() == want.tolist()
    assert all(settled[: rows // 4]) and sum(settled[rows // 4: rows // 2]) >= rows // 8
    assert all(bool(allowed[r, t]) for r, t in enumerate(want.tolist()))
    # A settled row's mask allows only candidates the grammar allows.
    for r in (r for r in range(rows) if settled[r]):
        bits = np.unpackbits(mixed[r].view(np.uint8), bitorder="little")[:vocab]
        assert set(np.flatnonzero(bits)) <= {t for t in ids[r].tolist() if allowed[r, t]}


def test_a_tie_at_the_last_candidate_leaves_the_row_to_the_whole_mask() -> None:
    """Greedy rows whose best allowed candidates tie with the k-th: a lower id outside the
    candidates may tie too, so the candidates do not settle the row; ties above it do."""
    vocab = 300
    logits = torch.zeros(2, vocab)
    logits[0, 200:200 + K + 4] = 5.0  # K + 4 tokens tie for the best
    logits[1, [50, 40, 30]] = torch.tensor([9.0, 7.0, 7.0])  # a tie between candidates
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, 200:] = True
    allowed[1, [30, 40]] = True
    draw = Draw(logits=logits.to(DEVICE), meta=SimpleNamespace(all_greedy=True), noise=None)
    index = torch.arange(2, device=DEVICE)
    ids, scores = Sampler.candidates(draw, index, K)
    out = np.zeros((2, (vocab + 31) // 32), dtype=np.int32)
    assert not settle_row(SetGrammar(allowed[0]), ids[0].tolist(), scores[0].tolist(), out[0])
    assert settle_row(SetGrammar(allowed[1]), ids[1].tolist(), scores[1].tolist(), out[1])
    assert Sampler.redraw(draw, index[1:], torch.from_numpy(out[1:]).to(DEVICE)).tolist() == [30]
