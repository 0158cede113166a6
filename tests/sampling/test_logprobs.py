"""Logprobs: from the raw logits, sampled token first with its rank, then the top k."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.layers.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs
from pagedllm.sampling_params import SamplingParams

V = 16
sampler = Sampler()


def run(logits, params, outputs=None):
    n = len(params)
    meta = SamplingMetadata.build(params, [[0]] * n, outputs or [[] for _ in range(n)], [None] * n, V, "cpu")
    return sampler(logits, meta)


def test_logprobs_come_from_raw_logits_not_processed_ones():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 2
    raw = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(temperature=0.3, top_k=2, logprobs=2, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=4, presence_penalty=1.0),
        SamplingParams(temperature=2.0, top_p=0.5, logprobs=0),
    ]
    out = run(logits, params, outputs=[[1, 2], [3], []])
    assert out.logprobs is not None
    for row, k in enumerate((2, 4, 0)):
        token_ids, logprobs, rank = out.logprobs.to_entries(row, k)
        sampled = out.sampled_token_ids[row].item()
        assert token_ids[0] == sampled
        assert logprobs[0] == pytest.approx(raw[row, sampled].item(), abs=1e-6)
        top = raw[row].topk(k)
        assert token_ids[1:] == top.indices.tolist()
        assert logprobs[1:] == pytest.approx(top.values.tolist(), abs=1e-6)
        assert rank == 1 + int((raw[row] > raw[row, sampled]).sum())


def test_entries_are_cut_to_each_rows_k_and_rows_without_logprobs_still_sample():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=1)]
    out = run(logits, params)
    assert out.logprobs.token_ids.shape == (3, 6)  # computed once for the largest k
    ids, lps, rank = out.logprobs.to_entries(2, 1)
    assert len(ids) == len(lps) == 2 and rank == 1  # greedy token is the most likely
    assert ids[0] == ids[1] == logits[2].argmax().item()
    assert len(out.logprobs.to_entries(0, 5)[0]) == 6
    with pytest.raises(ValueError, match="k must be"):
        out.logprobs.to_entries(0, -1)


def test_top_logprobs_stop_at_the_vocabulary_size():
    logits = torch.randn(1, 4)
    meta = SamplingMetadata.build([SamplingParams(temperature=0, logprobs=20)], [[0]], [[]], [None], 4, "cpu")
    ids, lps, _ = sampler(logits, meta).logprobs.to_entries(0, 20)
    assert len(ids) == len(lps) == 5 and sorted(ids[1:]) == [0, 1, 2, 3]


def test_rank_counts_only_strictly_greater_tokens():
    logits = torch.full((1, V), -5.0)
    logits[0, 3] = logits[0, 7] = 2.0  # a tie for the top
    logits[0, 9] = 1.0
    meta = SamplingMetadata.build([SamplingParams(temperature=0, logprobs=3, min_tokens=1)
                                   .clone(eos_token_ids=frozenset({3, 7}))], [[0]], [[]], [None], V, "cpu")
    out = sampler(logits, meta)
    # min_tokens masks both top tokens, so 9 is sampled: two tokens are strictly more likely.
    ids, lps, rank = out.logprobs.to_entries(0, 3)
    assert ids[0] == 9 and rank == 3
    assert sorted(ids[1:3]) == [3, 7] and ids[3] == 9
    # A token tied for the top has rank 1: ties are not "strictly greater".
    out = run(logits, [SamplingParams(temperature=0, logprobs=1)])
    ids, _, rank = out.logprobs.to_entries(0, 1)
    assert ids[0] == 3 and rank == 1


def test_prompt_logprobs_score_each_target_token():
    torch.manual_seed(2)
    logits = torch.randn(4, V)
    targets = torch.tensor([5, 0, 15, 5])
    entries = compute_prompt_logprobs(logits, targets, k=2)
    raw = torch.log_softmax(logits, -1)
    assert len(entries) == 4
    for i, (ids, lps, rank) in enumerate(entries):
        t = targets[i].item()
        assert ids[0] == t and len(ids) == 3
        assert lps[0] == pytest.approx(raw[i, t].item(), abs=1e-6)
        assert ids[1:] == raw[i].topk(2).indices.tolist()
        assert rank == 1 + int((raw[i] > raw[i, t]).sum())
        assert math.exp(lps[1]) >= math.exp(lps[2])
    assert compute_prompt_logprobs(logits[:0], targets[:0], k=2) == []
    with pytest.raises(ValueError, match="rows"):
        compute_prompt_logprobs(logits, targets[:2], k=1)
