"""The batched sampler: greedy, random with filters, seeds, penalties and min_tokens."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.sampler import Sampler, SamplingMetadata, apply_penalties
from pagedllm.sampling_params import SamplingParams
from tests.utils import token_bitmask

V = 32
sampler = Sampler()


def build(params, prompts=None, outputs=None, generators=None, vocab_size=V, device="cpu"):
    n = len(params)
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=prompts or [[1, 2, 3]] * n,
        output_token_ids=outputs or [[] for _ in range(n)],
        generators=generators or [None] * n,
        vocab_size=vocab_size,
        device=device,
    )


def sample(logits, params, **kwargs) -> list[int]:
    return sampler(logits, build(params, device=logits.device, **kwargs)).sampled_token_ids.tolist()


DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


def random_logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_exactly_torch_argmax_including_ties():
    logits = random_logits(6)
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1  # tie: torch picks the first
    logits[2, :] = 0.0
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert out == logits.argmax(-1).tolist()
    assert out[1] == 5 and out[2] == 0


def test_all_greedy_batch_carries_no_sampling_tensors():
    meta = build([SamplingParams(temperature=0.0)] * 4)
    assert meta.all_greedy and meta.no_penalties and meta.max_num_logprobs is None
    assert meta.temperature is None and meta.top_k is None and meta.top_p is None
    assert meta.min_p is None and meta.output_counts is None and meta.min_tokens_rows is None
    assert sampler(random_logits(4), meta).logprobs is None


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = random_logits(8, seed=3)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(8)]
    for _ in range(5):
        out = sample(logits, params)
        assert out[1::2] == logits.argmax(-1)[1::2].tolist()


def test_half_precision_logits_sample_what_their_float32_values_sample():
    """A model's logits come in its dtype: every path (greedy, penalties, filters, seeded
    draws, logprobs) chooses as it would from the same values widened to float32."""
    logits = random_logits(4, seed=9).to(torch.bfloat16)
    # Row 1 penalises token 1 to 1.515625 / 1.5 = 1.0104 > 1.0078 (token 0) in float32;
    # bfloat16 arithmetic would round it to a tie, which token 0 wins.
    logits[1] = -5.0
    logits[1, :2] = torch.tensor([1.0078125, 1.515625])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3, logprobs=2),
        SamplingParams(temperature=1.2, seed=4, min_tokens=2),
    ]

    def run(x):
        gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
        return sampler(x, build(params, prompts=[[2, 3]] * 4, outputs=[[1, 4]] * 4, generators=gens))

    half, wide = run(logits), run(logits.float())
    assert half.sampled_token_ids.tolist() == wide.sampled_token_ids.tolist()
    assert half.sampled_token_ids[1] == 1
    assert torch.equal(half.logprobs.logprobs, wide.logprobs.logprobs)


def test_token_counts_kept_across_steps_equal_counts_built_afresh():
    """The runner keeps penalty counts on the device by batch row: filled from the token
    lists when a row gets a new owner (pending tokens included), then fed each step's
    sampled ids. Step by step they equal counts built from scratch, through a request
    leaving, another taking its row, and a request coming back (a new owner object)."""
    from pagedllm.layers.sampler import RowCounts, TokenCounts

    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4)
    table = TokenCounts(4, V, "cpu")
    gen = torch.Generator().manual_seed(5)
    requests = {name: ([int(t) for t in torch.randint(0, V, (6,), generator=gen)], [])
                for name in "abc"}
    owners = {name: object() for name in "abc"}
    rows = {"a": 0, "b": 3}
    pending: dict[str, int] = {}  # a sampled id not yet read back, per request
    for step in range(8):
        if step == 3:  # b leaves; c takes its row
            del rows["b"]
            rows["c"] = 3
        if step == 5:  # a comes back in another row as a new entry
            rows["a"] = 1
            owners["a"] = object()
        names = list(rows)
        pending_rows = [i for i, n in enumerate(names) if n in pending]
        pending_ids = torch.tensor([pending[names[i]] for i in pending_rows], dtype=torch.long)
        lists = dict(prompt_token_ids=[requests[n][0] for n in names],
                     output_token_ids=[list(requests[n][1]) for n in names],
                     generators=[None] * len(names), vocab_size=V, device="cpu",
                     pending_token_ids=(pending_rows, pending_ids) if pending_rows else None)
        kept = SamplingMetadata.build(
            params=[params] * len(names), **lists,
            counts=RowCounts(table, [rows[n] for n in names], [owners[n] for n in names]))
        fresh = SamplingMetadata.build(params=[params] * len(names), **lists)
        assert torch.equal(kept.output_counts, fresh.output_counts)
        assert torch.equal(kept.seen_mask, fresh.seen_mask)
        sampled = torch.randint(0, V, (len(names),), generator=gen)
        kept.record_sampled(sampled)
        for n in pending:  # last step's ids come back
            requests[n][1].append(pending[n])
        pending = {n: int(t) for n, t in zip(names, sampled)}


def test_caller_logits_are_not_modified():
    logits = random_logits(3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3,
                             presence_penalty=0.5, frequency_penalty=0.5, min_tokens=2, logprobs=3)] * 3
    sample(logits, [p.clone(eos_token_ids=frozenset({4})) for p in params], outputs=[[1], [2, 2], []])
    assert torch.equal(logits, before)


def test_random_sampling_follows_softmax_with_temperature():
    torch.manual_seed(0)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 40000
    out = torch.tensor(sample(base.repeat(rows, 1), [SamplingParams(temperature=0.8)] * rows, vocab_size=6))
    freq = torch.bincount(out, minlength=6).float() / rows
    expected = torch.softmax(base / 0.8, -1)
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)


def test_top_k_samples_only_the_k_most_likely():
    torch.manual_seed(1)
    logits = random_logits(4, seed=7)
    rows = 2000
    batch = logits.repeat_interleave(rows // 4, 0)
    params = [SamplingParams(temperature=2.0, top_k=k) for k in (1, 3, 5, 0) for _ in range(rows // 4)]
    out = torch.tensor(sample(batch, params)).view(4, -1)
    for row, k in enumerate((1, 3, 5)):
        allowed = set(logits[row].topk(k).indices.tolist())
        assert set(out[row].tolist()) == allowed  # every one of the k shows up at temperature 2
    assert len(set(out[3].tolist())) > 5  # top_k=0 disables the filter


def test_top_p_samples_only_the_nucleus():
    torch.manual_seed(2)
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    rows = 5000
    out = sample(probs.log().repeat(rows, 1), [SamplingParams(top_p=0.85)] * rows, vocab_size=5)
    # Smallest set reaching 0.85: {0, 1, 2} (0.5 + 0.3 < 0.85 <= 0.9).
    assert set(out) == {0, 1, 2}
    freq = torch.bincount(torch.tensor(out), minlength=5).float() / rows
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.1]) / 0.9, atol=0.03)


def test_min_p_drops_tokens_below_fraction_of_top():
    torch.manual_seed(3)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    rows = 4000
    out = sample(probs.log().repeat(rows, 1), [SamplingParams(min_p=0.3)] * rows, vocab_size=5)
    assert set(out) == {0, 1, 2}  # threshold 0.3 * 0.4 = 0.12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("own_filter", [True, False], ids=["top-p", "no-filter"])
def test_seeded_request_samples_same_tokens_whatever_the_batch(device, own_filter):
    """A seeded row draws the same tokens alone or beside rows with other temperatures and
    top-k filters (on a GPU the filters of other rows once switched its sampling path)."""
    params = SamplingParams(temperature=1.0, seed=42, top_p=0.9 if own_filter else 1.0)
    steps = [random_logits(1, seed=s)[0] for s in range(6)]

    def run(batch_size: int, row: int) -> list[int]:
        generator = torch.Generator(device=device).manual_seed(42)
        tokens = []
        for step, logits_row in enumerate(steps):
            logits = random_logits(batch_size, seed=100 + step + batch_size)
            logits[row] = logits_row
            params_batch = [SamplingParams(temperature=0.5, top_k=3)] * batch_size
            params_batch[row] = params
            gens = [None] * batch_size
            gens[row] = generator
            tokens.append(sample(logits.to(device), params_batch, generators=gens)[row])
        return tokens

    alone = run(1, 0)
    assert run(5, 3) == alone
    assert run(3, 0) == alone
    assert len(set(alone)) > 1


def test_seeded_generator_advances_once_per_sampled_token():
    def state_after(batch_size: int, row: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(7)
        params = [SamplingParams(temperature=1.0)] * batch_size
        params[row] = SamplingParams(temperature=1.0, seed=7)
        gens = [None] * batch_size
        gens[row] = generator
        sample(random_logits(batch_size), params, generators=gens)
        return generator.get_state()

    reference = torch.Generator().manual_seed(7)
    torch.empty(V).exponential_(generator=reference)
    assert torch.equal(state_after(1, 0), reference.get_state())
    assert torch.equal(state_after(4, 2), reference.get_state())


def test_seed_without_generator_is_rejected():
    with pytest.raises(ValueError, match="generator"):
        build([SamplingParams(seed=1)])


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    params = [SamplingParams(repetition_penalty=2.0)]
    meta = build(params, prompts=[[0]], outputs=[[1]], vocab_size=5)
    out = apply_penalties(logits, meta)
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 5)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)]
    meta = build(params, prompts=[[4, 4, 4]], outputs=[[1, 2, 2, 2]], vocab_size=5)
    out = apply_penalties(logits, meta)
    assert out.tolist() == [[0.0, -0.75, -1.25, 0.0, 0.0]]


def test_penalties_are_per_row():
    logits = torch.ones(3, 4)
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(), SamplingParams(frequency_penalty=1.0)]
    meta = build(params, prompts=[[0], [0], [0]], outputs=[[1], [1], [1, 1]], vocab_size=4)
    out = apply_penalties(logits, meta)
    assert out.tolist() == [[0.5, 0.5, 1, 1], [1, 1, 1, 1], [1, -1, 1, 1]]


def test_repetition_penalty_steers_greedy_away_from_repeats():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0)], vocab_size=3) == [0]
    params = [SamplingParams(temperature=0, repetition_penalty=1.2)]
    assert sample(logits, params, prompts=[[0]], vocab_size=3) == [1]


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 3)
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]).clone(eos_token_ids=frozenset({1}))
    outputs = [[], [3], [3, 3]]
    assert sample(logits, [params] * 3, outputs=outputs, vocab_size=4) == [3, 3, 1]
    # ignore_eos: EOS is not a stop token, so it is not masked.
    params = params.clone(ignore_eos=True)
    assert sample(logits[:1], [params], outputs=[[]], vocab_size=4) == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_adds_to_the_listed_logits_before_penalties(device):
    """Bias is added per row to the listed tokens only, before the repetition penalty
    divides the biased logit, so greedy and random rows follow the biased distribution;
    the raw logits the caller passed are left alone."""
    logits = torch.tensor([[3.0, 2.0, 0.0, 1.0]] * 3, device=device)
    kept = logits.clone()
    params = [SamplingParams(temperature=0, logit_bias={2: 5.0}),  # 5.0 beats 3.0
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={2: 5.0}, repetition_penalty=2.0)]
    # Row 2: token 2 seen, so its biased logit 5.0 is halved to 2.5, below token 0's 3.0.
    assert sample(logits, params, prompts=[[1], [1], [2]], vocab_size=4) == [2, 0, 0]
    assert torch.equal(logits, kept)
    banned = SamplingParams(temperature=1.0, seed=0, logit_bias={0: -100.0, 1: -100.0})
    gens = [torch.Generator(device=device).manual_seed(0)]
    draws = [sample(logits[:1], [banned], vocab_size=4, generators=gens)[0] for _ in range(40)]
    assert set(draws) <= {2, 3} and len(set(draws)) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_allowed_token_ids_limit_greedy_and_random_rows_to_their_tokens(device):
    logits = random_logits(4, seed=9).to(device)
    allowed = [3, 17, 30]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.5, seed=1, allowed_token_ids=allowed),
              SamplingParams(temperature=1.5, seed=2)]
    gens = [None, None] + [torch.Generator(device=device).manual_seed(s) for s in (1, 2)]
    draws = [sample(logits, params, generators=gens) for _ in range(30)]
    first = logits[0, allowed].argmax().item()
    assert all(d[0] == allowed[first] and d[1] == logits[1].argmax().item() for d in draws)
    assert {d[2] for d in draws} <= set(allowed) and len({d[2] for d in draws}) > 1
    assert not {d[3] for d in draws} <= set(allowed)


def test_bad_words_ban_a_last_token_where_the_output_ends_with_the_rest():
    """One-token words always; longer ones where the output ends with their head, read on
    the host, or on the device for pending tokens (one of async decoding, several of a
    verification); two words may ban the same token."""
    words = [[5], [7, 9], [1, 2, 3], [4, 2, 3]]
    params = SamplingParams(temperature=0).clone(bad_words_token_ids=words)
    logits = torch.zeros(7, V)
    logits[:, [3, 5, 9]] = torch.tensor([3.0, 2.0, 1.0])  # 3 beats 5 beats 9 beats the rest

    def banned(outputs, pending=None):
        meta = SamplingMetadata.build([params] * len(outputs), [[0]] * len(outputs), outputs,
                                      [None] * len(outputs), V, "cpu", pending_token_ids=pending)
        return sample_meta(logits[:len(outputs)], meta)

    # 5 always; 3 after [1, 2] or [4, 2]; 9 after 7.
    assert banned([[], [1, 2], [4, 2], [7], [2], [1, 2, 0]]) == [3, 9, 9, 3, 3, 3]
    pending = ([0, 1, 2, 3, 3], torch.tensor([2, 4, 7, 1, 2]))  # row 3: two pending tokens
    assert banned([[1], [1], [0], []], pending) == [9, 3, 3, 9]


def sample_meta(logits, meta) -> list[int]:
    return sampler(logits, meta).sampled_token_ids.tolist()


def test_metadata_rejects_ragged_inputs():
    with pytest.raises(ValueError, match="output_token_ids"):
        SamplingMetadata.build([SamplingParams()], [[1]], [], [None], V, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_forward_never_syncs_with_host_and_seeds_reproduce():
    device = torch.device("cuda")
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                       presence_penalty=0.3, frequency_penalty=0.3, min_tokens=3, seed=5)
        .clone(eos_token_ids=frozenset({1})),
        SamplingParams(temperature=1.2, logprobs=0),
    ]

    def step(seed_row_generator):
        meta = SamplingMetadata.build(params, [[1, 2, 3]] * 3, [[4], [5, 5], []],
                                      [None, seed_row_generator, None], V, device)
        logits = random_logits(3).to(device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = sampler(logits, meta)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return out

    out_a = step(torch.Generator(device=device).manual_seed(5))
    out_b = step(torch.Generator(device=device).manual_seed(5))
    assert out_a.sampled_token_ids[1].item() == out_b.sampled_token_ids[1].item()
    assert out_a.sampled_token_ids[0].item() == random_logits(3)[0].argmax().item()
    assert out_a.logprobs.to_entries(0, 2)[0][0] == out_a.sampled_token_ids[0].item()


def test_pending_device_tokens_count_like_host_outputs() -> None:
    """Penalties and min_tokens treat a token known only on the device (sampled by a step
    whose ids were not read back) exactly as the same token in the host's outputs."""
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.4,
                       frequency_penalty=0.7),
        SamplingParams(temperature=0.0, min_tokens=2).clone(eos_token_ids=frozenset({7})),
        SamplingParams(temperature=0.0),
    ]
    logits = random_logits(3)
    on_host = SamplingMetadata.build(params, [[1, 2]] * 3, [[4, 9], [5, 6], [3]], [None] * 3,
                                     V, "cpu")
    pending = SamplingMetadata.build(params, [[1, 2]] * 3, [[4], [5], [3]], [None] * 3, V, "cpu",
                                     pending_token_ids=([0, 1], torch.tensor([9, 6])))
    assert torch.equal(pending.output_counts, on_host.output_counts)
    assert torch.equal(pending.seen_mask, on_host.seen_mask)
    assert pending.min_tokens_rows is None and on_host.min_tokens_rows is None  # 1 + 1 >= 2
    sampler = Sampler()
    assert torch.equal(sampler(logits, pending).sampled_token_ids,
                       sampler(logits, on_host).sampled_token_ids)
    short = SamplingMetadata.build(params, [[1, 2]] * 3, [[4], [], [3]], [None] * 3, V, "cpu",
                                   pending_token_ids=([1], torch.tensor([6])))
    assert short.min_tokens_rows.tolist() == [1]  # 0 + 1 < 2: EOS still masked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fused_sampling_is_seeded_per_row_and_follows_the_distribution():
    """Without top-k/top-p/min-p, CUDA samples with the one-pass Gumbel kernel."""
    device = torch.device("cuda")
    rows = 4000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 0.0])).repeat(rows, 1).to(device)
    meta = SamplingMetadata.build([SamplingParams(temperature=1.0)] * rows, [[1]] * rows,
                                  [[] for _ in range(rows)], [None] * rows, 4, device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drawn = sampler(logits, meta).sampled_token_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")
    freq = torch.bincount(drawn.cpu(), minlength=4).float() / rows
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.04, rtol=0)

    def seeded_row_token(batch_size: int) -> int:
        params = [SamplingParams(temperature=1.0)] * (batch_size - 1) + [
            SamplingParams(temperature=1.0, seed=3)]
        generators = [None] * (batch_size - 1) + [torch.Generator(device=device).manual_seed(3)]
        logits = random_logits(batch_size, seed=4).to(device)
        logits[-1] = random_logits(1, seed=5)[0].to(device)
        meta = SamplingMetadata.build(params, [[1]] * batch_size,
                                      [[] for _ in range(batch_size)], generators, V, device)
        return sampler(logits, meta).sampled_token_ids[-1].item()

    assert len({seeded_row_token(n) for n in (1, 2, 7)}) == 1


def random_bitmask(rows: int, seed: int, vocab: int = V) -> torch.Tensor:
    """Int32 bitmask rows allowing a random quarter of the tokens, at least one each."""
    allowed = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(seed)) < 0.25
    allowed[:, seed % vocab] = True
    return token_bitmask(allowed)


def allowed_by(bitmask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return ((bitmask.gather(1, (tokens // 32).unsqueeze(1)).squeeze(1) >> (tokens % 32)) & 1).bool()


def mixed_rows(rows: int) -> tuple[list[SamplingParams], list[list[int]]]:
    """Rows of every kind a constrained batch holds, and their outputs so far: greedy and
    random, seeded and not, with penalties, logit biases, allowed tokens and min_tokens."""
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.6][i % 4],
                             seed=i if i % 3 == 0 else None,
                             repetition_penalty=1.4 if i % 5 == 0 else 1.0,
                             frequency_penalty=0.5 if i % 7 == 0 else 0.0,
                             min_tokens=4 if i % 2 else 0,
                             logit_bias={5: 2.5, 9: -1.5} if i % 4 == 1 else None,
                             allowed_token_ids=list(range(0, V, 2)) if i % 6 == 2 else None,
                             ).clone(eos_token_ids=frozenset({3}))
              for i in range(rows)]
    return params, [[(i * 7 + k) % V for k in range(i % 4)] for i in range(rows)]


def test_check_then_mask_draws_the_token_masking_first_draws():
    """A row sampled without its mask, kept if the mask allows its token and drawn again
    under the mask otherwise (with the noise of its first draw), gets the token that
    masking before sampling gives: greedy and random rows, seeded and not, with penalties,
    logit biases, allowed tokens, min_tokens and temperatures; seeded generators end in the
    same state."""
    rows = 24
    params, outputs = mixed_rows(rows)
    for step in range(5):
        logits = random_logits(rows, seed=50 + step)
        bitmask = random_bitmask(rows, seed=step)
        every_row = torch.arange(rows)

        def run(mask_first: bool):
            torch.manual_seed(step)  # the unseeded rows' noise
            gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed + step)
                    for p in params]
            meta = build(params, outputs=outputs, generators=gens)
            if mask_first:
                meta.grammar_rows, meta.grammar_bitmask = every_row, bitmask
                return sampler(logits, meta).sampled_token_ids, gens
            meta.keep_draw = True
            out = sampler(logits, meta)
            tokens = out.sampled_token_ids.clone()
            refused = (~allowed_by(bitmask, tokens)).nonzero().flatten()
            assert len(refused) > 0
            tokens[refused] = sampler.redraw(out.draw, refused, bitmask[refused])
            return tokens, gens

        want, want_gens = run(mask_first=True)
        got, got_gens = run(mask_first=False)
        assert torch.equal(got, want)
        assert allowed_by(bitmask, got).all()
        for a, b in zip(got_gens, want_gens):
            assert a is None or torch.equal(a.get_state(), b.get_state())


def test_a_refused_rows_first_allowed_candidate_is_the_token_masking_first_draws():
    """A row's candidates (``Sampler.candidates``: the tokens its draw ranked best, the
    drawn one first): the first that a mask allows is the token masking before sampling
    gives, for greedy and random rows, seeded and not, with penalties, logit biases,
    allowed tokens and min_tokens; a row whose mask allows none of them is left to the
    redraw."""
    rows, count = 24, 8
    params, outputs = mixed_rows(rows)
    every_row = torch.arange(rows)
    resolved = 0
    for step in range(6):
        logits = random_logits(rows, seed=70 + step)
        bitmask = random_bitmask(rows, seed=step)
        torch.manual_seed(step)
        gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed + step)
                for p in params]
        meta = build(params, outputs=outputs, generators=gens)
        meta.keep_draw = True
        out = sampler(logits, meta)
        candidates = sampler.candidates(out.draw, every_row, count)
        assert candidates.shape == (rows, count)
        assert torch.equal(candidates[:, 0], out.sampled_token_ids)
        want = sampler.redraw(out.draw, every_row, bitmask)
        for row in range(rows):
            ranked = [t for t in candidates[row].tolist() if t >= 0]
            allowed = [t for t in ranked if allowed_by(bitmask[row:row + 1], torch.tensor([t]))]
            if allowed:
                assert allowed[0] == want[row], (step, row)
                resolved += allowed[0] != ranked[0]
    assert resolved > 0  # some rows refused their drawn token and took a later candidate
