"""The Triton backend end to end: mixed steps, padding, successive steps, dtypes."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
from tests.kernels.paged_batch import HALF_DTYPES, TOLERANCE, make_step, reference_attention

# A fresh prompt, a chunk on top of cached context, decodes at several context lengths.
MIXED = ((0, 11), (9, 4), (17, 1), (0, 1), (30, 1), (6, 7))
DECODES_ONLY = ((17, 1), (0, 1), (30, 1), (5, 1))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_mixed_prefill_and_decode_step_matches_reference(num_heads, num_kv_heads, window) -> None:
    step = make_step(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads)
    expected, expected_cache = reference_attention(step, 0.25, window)
    out = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, window
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert torch.equal(step.kv_cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seqs", [MIXED, DECODES_ONLY], ids=["mixed", "decodes-only"])
def test_soft_capped_scores_match_the_reference(seqs, window) -> None:
    """Gemma 2's attention soft-capping in the prefill and decode kernels; the cap is
    low enough to bend most scores (their scale here is about 1)."""
    step = make_step(seqs, seed=4)
    expected, _ = reference_attention(step, 0.25, window, logits_soft_cap=0.5)
    uncapped, _ = reference_attention(step, 0.25, window)
    out = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, window,
        logits_soft_cap=0.5,
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert not torch.allclose(expected, uncapped, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_mixed_step_matches_fp32_reference(dtype) -> None:
    step = make_step(MIXED, seed=1, dtype=dtype)
    expected, _ = reference_attention(step, 0.25, None)
    out = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, None
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


def test_padding_rows_past_num_actual_tokens_are_not_cached_or_attended() -> None:
    """A runner pads a step to a captured shape; padded rows point at a spare slot."""
    step = make_step(MIXED, seed=2)
    n = step.query.shape[0]
    expected, _ = reference_attention(step, 0.25, None)
    pad = 3
    md = step.metadata
    spare_slot = step.spare_block * md.block_size
    md.slot_mapping = torch.cat(
        [md.slot_mapping, torch.full((pad,), spare_slot, dtype=torch.int64, device=md.slot_mapping.device)]
    )

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.randn(pad, *x.shape[1:], device=x.device)])

    out = TritonAttentionBackend().forward(
        padded(step.query), padded(step.key), padded(step.value), step.kv_cache, md, 0.25, None
    )
    torch.testing.assert_close(out[:n], expected, **TOLERANCE[torch.float32])
    assert torch.count_nonzero(out[n:]) == 0
    assert step.kv_cache[:, step.spare_block].isnan().all()


def test_one_backend_serves_successive_steps_of_different_shapes() -> None:
    """Routing derived for one step (does it hold decodes?) must not leak into the next."""
    backend = TritonAttentionBackend()
    steps = (((0, 5), (2, 3)), MIXED, ((40, 1), (3, 1)), ((4, 6),))
    for seed, seqs in enumerate(steps):
        step = make_step(seqs, seed=seed)
        expected, _ = reference_attention(step, 0.25, 4)
        out = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, 4)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_output_is_contiguous_for_strided_query_views() -> None:
    """Queries usually arrive as a column slice of one fused QKV projection."""
    step = make_step(MIXED, seed=3)
    num_tokens, num_heads, head_dim = step.query.shape
    fused = torch.cat([step.query.flatten(1), step.key.flatten(1)], dim=1)
    query = fused[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    expected, _ = reference_attention(step, 0.25, None)
    out = TritonAttentionBackend().forward(
        query, step.key, step.value, step.kv_cache, step.metadata, 0.25, None
    )
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_a_large_decode_batch_starts_its_longest_sequences_first(monkeypatch) -> None:
    from pagedllm.layers.attention import triton_backend, triton_decode

    orders = []

    def spy(*args, order=None, **kwargs):
        orders.append(order)
        return triton_decode.paged_decode_attention(*args, order=order, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_decode_attention", spy)
    lengths = torch.randint(0, 40, (triton_decode.LONGEST_FIRST_MIN_SEQS + 6,),
                            generator=torch.Generator().manual_seed(5)).tolist()
    step = make_step(tuple((n, 1) for n in lengths) + ((3, 5),), seed=6)
    expected, _ = reference_attention(step, 0.25, None)
    backend = TritonAttentionBackend()
    for _ in range(2):  # two layers of one step share the order
        out = backend.forward(step.query, step.key, step.value, step.kv_cache.clone(),
                              step.metadata, 0.25, None)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert orders[0] is orders[1]
    started = [step.metadata.seq_lens_cpu[b] for b in orders[0].tolist()]
    assert started == sorted(step.metadata.seq_lens_cpu, reverse=True)

    monkeypatch.setenv(triton_decode.LONGEST_FIRST_ENV, "0")
    step = make_step(tuple((n, 1) for n in lengths), seed=7)
    backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, None)
    assert orders[-1] is None


@pytest.mark.parametrize("seqs", [MIXED, DECODES_ONLY], ids=["mixed", "decodes-only"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "fused-ops-off"])
@pytest.mark.parametrize("window", [None, 6])
def test_rotary_applied_by_the_backend_matches_the_reference(window, fused, seqs, monkeypatch,
                                                              request) -> None:
    """Unrotated q and k with ``rotary=(cos, sin)``: the Triton backend rotates them in the
    cache-write kernel, or for a step of decodes alone in the decode kernel (with
    PAGEDLLM_FUSED_OPS=0, by the torch rope before the plain write); output and cache agree
    with the reference backend's rope."""
    from pagedllm.layers import triton_ops
    from pagedllm.layers.attention import triton_backend
    from pagedllm.layers.attention.torch_ref import TorchReferenceBackend
    from pagedllm.layers.rotary import RotaryEmbedding

    fused_calls = []
    original = triton_backend.rotate_and_write_kv
    monkeypatch.setattr(triton_backend, "rotate_and_write_kv",
                        lambda *a, **kw: fused_calls.append(1) or original(*a, **kw))
    if not fused:
        monkeypatch.setenv(triton_ops.FUSED_OPS_ENV, "0")
    triton_ops.fused_ops_enabled.cache_clear()
    request.addfinalizer(triton_ops.fused_ops_enabled.cache_clear)  # later tests read it afresh

    step = make_step(seqs, num_heads=4, num_kv_heads=2, head_dim=16, seed=8)
    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}).to(step.query.device)
    positions = torch.arange(step.query.shape[0], device=step.query.device) * 7 % 41
    rotary = rope(positions, step.query.dtype)
    want_cache = step.kv_cache.clone()
    want = TorchReferenceBackend().forward(
        step.query, step.key, step.value, want_cache, step.metadata, 0.25, window, rotary=rotary
    )
    got = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, window, rotary=rotary
    )
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    torch.testing.assert_close(step.kv_cache.nan_to_num(7.0), want_cache.nan_to_num(7.0),
                               rtol=1e-6, atol=1e-6)
    assert len(fused_calls) == (1 if fused and seqs is MIXED else 0)


FRESH = ((0, 11), (0, 5), (0, 1), (0, 8))


@pytest.mark.parametrize("setting", ["math", "auto"])
def test_fresh_prompts_through_torch_fused_attention_match_the_reference(setting, monkeypatch) -> None:
    """PAGEDLLM_DENSE_PREFILL: a step of fresh prompts attends through torch's fused
    attention (grouped queries, rope applied by the backend) and still fills the cache;
    output and cache agree with the reference backend's."""
    from pagedllm.layers.attention import dense_prefill
    from pagedllm.layers.attention.torch_ref import TorchReferenceBackend
    from pagedllm.layers.rotary import RotaryEmbedding

    monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", setting)
    monkeypatch.setattr(dense_prefill, "MIN_TOKENS", 8)
    calls = []
    original = dense_prefill.dense_prefill
    monkeypatch.setattr(dense_prefill, "dense_prefill", lambda *a: calls.append(1) or original(*a))
    step = make_step(FRESH, num_heads=4, num_kv_heads=2, head_dim=16, seed=9)
    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}).to(step.query.device)
    positions = torch.cat([torch.arange(n) for _, n in FRESH]).to(step.query.device)
    rotary = rope(positions, step.query.dtype)
    want_cache = step.kv_cache.clone()
    want = TorchReferenceBackend().forward(
        step.query, step.key, step.value, want_cache, step.metadata, 0.25, None, rotary=rotary)
    got = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, None, rotary=rotary)
    assert calls == [1]
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    torch.testing.assert_close(step.kv_cache.nan_to_num(7.0), want_cache.nan_to_num(7.0),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_fresh_half_precision_prompts_through_torch_fused_attention(dtype, monkeypatch) -> None:
    """In fp16 and bf16 (on a GPU, the cuDNN and FlashAttention kernels' dtypes) the fused
    path agrees with the float32 reference."""
    from pagedllm.layers.attention import dense_prefill

    monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "auto")
    monkeypatch.setattr(dense_prefill, "MIN_TOKENS", 8)
    step = make_step(FRESH, num_heads=8, num_kv_heads=2, head_dim=64, seed=10, dtype=dtype)
    assert dense_prefill.applies(step.query, step.kv_cache, step.metadata, None, None)
    expected, expected_cache = reference_attention(step, 0.125, None)
    out = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.125, None)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    assert torch.equal(step.kv_cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))


def test_torch_fused_attention_takes_only_steps_of_fresh_long_prompts(monkeypatch) -> None:
    """Context from the cache, a window or a soft cap keep a step on the Triton kernels,
    and so do prompts under MIN_TOKENS; an unknown setting is refused by name."""
    from pagedllm.layers.attention import dense_prefill

    monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "auto")
    monkeypatch.setattr(dense_prefill, "MIN_TOKENS", 8)
    fresh, mixed = make_step(FRESH), make_step(MIXED)

    def applies(step, window=None, cap=None):
        return dense_prefill.applies(step.query, step.kv_cache, step.metadata, window, cap)

    assert applies(fresh)
    assert not applies(mixed) and not applies(fresh, window=6) and not applies(fresh, cap=30.0)
    monkeypatch.setattr(dense_prefill, "MIN_TOKENS", 12)
    assert not applies(fresh)
    monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "off")
    monkeypatch.setattr(dense_prefill, "MIN_TOKENS", 8)
    assert not applies(fresh)
    monkeypatch.setenv("PAGEDLLM_DENSE_PREFILL", "fastest")
    with pytest.raises(ValueError, match="PAGEDLLM_DENSE_PREFILL='fastest'.*cudnn"):
        dense_prefill._setting()
