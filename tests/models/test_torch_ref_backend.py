"""The torch reference backend against a per-sequence, per-head attention written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.layers.attention.kv_quant import paged_kv_views
from pagedllm.layers.attention.torch_ref import TorchReferenceBackend
from tests.utils import make_attention_metadata, make_kv_caches

BLOCK_SIZE = 8
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
# (cached tokens, new tokens): a fresh prefill, a chunk on top of cached context, decodes.
SEQS = ((0, 11), (9, 4), (17, 1), (0, 1), (30, 1))
NUM_BLOCKS = 32
SPARE_BLOCK = 5  # never given to a sequence


def naive_attention(q, k, v, scale, window):
    """q: [q_len, H, D] at the last positions of k/v: [seq_len, Hkv, D]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            keys, values = k[lo:pos + 1, h // group], v[lo:pos + 1, h // group]
            weights = torch.softmax(keys @ q[i, h] * scale, dim=0)
            out[i, h] = weights @ values
    return out


def _batch(seed: int = 0, seqs=SEQS):
    """Random q/k/v for ``seqs`` in shuffled blocks of a NaN-filled cache; the context of
    each sequence is already written, as earlier steps would have left it."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    order.remove(SPARE_BLOCK)
    cache = make_kv_caches(1, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)[0]
    tables, full_k, full_v, queries = [], [], [], []
    for cached, new in seqs:
        seq_len = cached + new
        table = [order.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        for pos in range(cached):  # context written by earlier steps
            cache[0, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k[pos]
            cache[1, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v[pos]
        tables.append(table)
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(new, NUM_HEADS, HEAD_DIM, generator=gen))
    metadata = make_attention_metadata(
        tables, [c + n for c, n in seqs], [n for _, n in seqs], BLOCK_SIZE
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs)])
    return cache, metadata, torch.cat(queries), new_k, new_v, full_k, full_v, queries


@pytest.mark.parametrize("window", [None, 3, 12])
def test_mixed_prefill_chunk_and_decode_batch_matches_naive_attention(window) -> None:
    cache, metadata, q, k, v, full_k, full_v, queries = _batch()
    scale = 1 / math.sqrt(HEAD_DIM)
    out = TorchReferenceBackend().forward(q, k, v, cache, metadata, scale, window)

    assert out.shape == q.shape
    expected = torch.cat([
        naive_attention(qs, ks, vs, scale, window)
        for qs, ks, vs in zip(queries, full_k, full_v)
    ])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_new_keys_and_values_land_in_their_slots() -> None:
    cache, metadata, q, k, v, *_ = _batch()
    TorchReferenceBackend().forward(q, k, v, cache, metadata, 0.25, None)
    flat_k = cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM)
    flat_v = cache[1].view(-1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat_k[metadata.slot_mapping], k, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[metadata.slot_mapping], v, rtol=0, atol=0)


def test_padding_rows_past_num_actual_tokens_are_not_cached_or_attended() -> None:
    """A runner may pad a step (fixed shapes for graph capture): the tail is inert."""
    cache, metadata, q, k, v, *_ = _batch()
    n = q.shape[0]
    expected = TorchReferenceBackend().forward(q, k, v, cache.clone(), metadata, 0.25, None)

    pad = 3
    spare_slot = SPARE_BLOCK * BLOCK_SIZE
    metadata.slot_mapping = torch.cat(
        [metadata.slot_mapping, torch.full((pad,), spare_slot, dtype=torch.int64)]
    )
    q_pad = torch.cat([q, torch.randn(pad, NUM_HEADS, HEAD_DIM)])
    k_pad = torch.cat([k, torch.randn(pad, NUM_KV_HEADS, HEAD_DIM)])
    v_pad = torch.cat([v, torch.randn(pad, NUM_KV_HEADS, HEAD_DIM)])
    out = TorchReferenceBackend().forward(q_pad, k_pad, v_pad, cache, metadata, 0.25, None)

    torch.testing.assert_close(out[:n], expected, rtol=0, atol=0)
    assert torch.count_nonzero(out[n:]) == 0
    assert cache[:, SPARE_BLOCK].isnan().all()


def test_one_backend_serves_successive_steps_of_different_shapes() -> None:
    """Index tensors derived for one step must not leak into the next."""
    backend = TorchReferenceBackend()
    for seed, seqs in enumerate((SEQS, ((3, 2), (0, 6)), ((40, 1),))):
        cache, metadata, q, k, v, full_k, full_v, queries = _batch(seed, seqs)
        out = backend.forward(q, k, v, cache, metadata, 0.25, 4)
        expected = torch.cat([
            naive_attention(qs, ks, vs, 0.25, 4) for qs, ks, vs in zip(queries, full_k, full_v)
        ])
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# -- an FP8 KV cache (--kv-cache-dtype fp8) ------------------------------------------------
FP8 = torch.float8_e4m3fn


def _fp8_cache(keys: torch.Tensor, values: torch.Tensor, k_scale: float,
               v_scale: float) -> torch.Tensor:
    """An FP8 cache holding ``keys`` and ``values`` (``[blocks, page, Hkv, D]`` each) where
    ``paged_kv_views`` puts them; 448 for NaN (an FP8 cache holds finite values only)."""
    cache = torch.empty((2, *keys.shape), dtype=FP8)
    for view, x, scale in zip(paged_kv_views(cache), (keys, values), (k_scale, v_scale)):
        view.copy_(_e4m3(x.nan_to_num(448.0 * scale), scale))
    return cache


def _e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache of ``scale`` stores for ``x``: x / scale clamped to +-448, rounded."""
    return (x / scale).clamp(-448.0, 448.0).to(FP8)


@pytest.mark.parametrize("window", [None, 5])
def test_fp8_cache_attends_over_quantize_dequantized_keys_and_values(window) -> None:
    """Context and new tokens alike are read back as e4m3(x / scale) * scale; keys large
    enough to saturate at 448 are clamped, not NaN. Equal, bit for bit, to the same
    attention over a float32 cache holding those values, and close to attention by hand."""
    k_scale, v_scale = 0.03, 0.07
    cache32, metadata, q, k, v, full_k, full_v, queries = _batch(seed=3)
    k, full_k = k * 10, [x * 10 for x in full_k]  # |k| / k_scale reaches past 448
    assert max(x.abs().max() for x in full_k) / k_scale > 448
    cache = _fp8_cache(cache32[0] * 10, cache32[1], k_scale, v_scale)
    out = TorchReferenceBackend().forward(q, k, v, cache, metadata, 0.25, window,
                                          k_scale=k_scale, v_scale=v_scale)

    deq_k = [_e4m3(x, k_scale).float() * k_scale for x in full_k]
    deq_v = [_e4m3(x, v_scale).float() * v_scale for x in full_v]
    expected = torch.cat([naive_attention(qs, ks, vs, 0.25, window)
                          for qs, ks, vs in zip(queries, deq_k, deq_v)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    exact_cache = torch.empty(cache.shape)
    for exact, stored, scale in zip(paged_kv_views(exact_cache), paged_kv_views(cache),
                                    (k_scale, v_scale)):
        exact.copy_(stored.float() * scale)
    new = torch.tensor([c for c, _ in SEQS])
    exact = TorchReferenceBackend().forward(
        q, torch.cat([x[c:] for x, c in zip(deq_k, new)]), torch.cat([x[c:] for x, c in zip(deq_v, new)]),
        exact_cache, metadata, 0.25, window)
    assert torch.equal(out, exact)


def test_fp8_cache_holds_the_quantized_bytes_at_the_new_slots_only() -> None:
    cache32, metadata, q, k, v, *_ = _batch(seed=4)
    cache = _fp8_cache(cache32[0], cache32[1], 1.0, 1.0)  # the context; 448 where unwritten
    before = cache.clone()
    TorchReferenceBackend().forward(q, k, v, cache, metadata, 0.25, None, k_scale=0.5, v_scale=0.25)
    slots = metadata.slot_mapping
    at = (slots // BLOCK_SIZE, slots % BLOCK_SIZE)
    keys, values = paged_kv_views(cache.view(torch.uint8))
    assert torch.equal(keys[at], _e4m3(k, 0.5).view(torch.uint8))
    assert torch.equal(values[at], _e4m3(v, 0.25).view(torch.uint8))
    untouched = torch.ones(keys.shape[:2], dtype=torch.bool)
    untouched[at] = False
    for now, then in zip((keys, values), paged_kv_views(before.view(torch.uint8))):
        assert torch.equal(now[untouched], then[untouched])
