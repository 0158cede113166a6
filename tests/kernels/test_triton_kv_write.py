"""The Triton KV-cache write against the slots the metadata names."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.attention.triton_kv_write import rotate_and_write_kv, write_kv_cache
from tests.kernels.paged_batch import make_step, reference_attention

SEQS = ((0, 7), (5, 4), (12, 1), (3, 1))


def _flat(cache: torch.Tensor, half: int) -> torch.Tensor:
    return cache[half].reshape(-1, *cache.shape[-2:])


def test_new_keys_and_values_land_in_their_slots_and_nowhere_else() -> None:
    step = make_step(SEQS, num_heads=4, num_kv_heads=2, head_dim=24, block_size=4)
    before = step.kv_cache.clone()
    write_kv_cache(step.key, step.value, step.kv_cache[0], step.kv_cache[1], step.metadata.slot_mapping)

    slots = step.metadata.slot_mapping
    assert torch.equal(_flat(step.kv_cache, 0)[slots], step.key)
    assert torch.equal(_flat(step.kv_cache, 1)[slots], step.value)
    untouched = torch.ones(_flat(before, 0).shape[0], dtype=torch.bool, device=slots.device)
    untouched[slots] = False
    for half in (0, 1):
        assert torch.equal(
            _flat(step.kv_cache, half)[untouched].nan_to_num(7.0),
            _flat(before, half)[untouched].nan_to_num(7.0),
        )


def test_write_matches_the_reference_backend_cache() -> None:
    step = make_step(SEQS, num_heads=2, num_kv_heads=1, block_size=8, seed=3)
    _, expected = reference_attention(step, 0.25, None)
    write_kv_cache(step.key, step.value, step.kv_cache[0], step.kv_cache[1], step.metadata.slot_mapping)
    assert torch.equal(step.kv_cache.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_slot_minus_one_marks_padding_that_is_not_written() -> None:
    step = make_step(SEQS)
    before = step.kv_cache.clone()
    slots = step.metadata.slot_mapping.clone()
    slots[1::2] = -1
    write_kv_cache(step.key, step.value, step.kv_cache[0], step.kv_cache[1], slots)

    kept = slots >= 0
    assert torch.equal(_flat(step.kv_cache, 0)[slots[kept]], step.key[kept])
    skipped = step.metadata.slot_mapping[~kept]
    assert _flat(step.kv_cache, 0)[skipped].isnan().all()
    assert _flat(step.kv_cache, 1)[skipped].isnan().all()
    assert torch.equal(
        step.kv_cache.isnan().sum(), before.isnan().sum() - 2 * kept.sum() * step.key[0].numel()
    )


def test_values_are_cast_to_the_cache_dtype() -> None:
    step = make_step(SEQS)
    cache = step.kv_cache.to(torch.float16)
    write_kv_cache(step.key, step.value, cache[0], cache[1], step.metadata.slot_mapping)
    slots = step.metadata.slot_mapping
    assert torch.equal(_flat(cache, 0)[slots], step.key.to(torch.float16))
    assert torch.equal(_flat(cache, 1)[slots], step.value.to(torch.float16))


def test_strided_key_and_value_views_are_written_correctly() -> None:
    """Keys and values usually arrive as column slices of one fused QKV projection."""
    step = make_step(SEQS, num_kv_heads=2, head_dim=16)
    num_tokens = step.key.shape[0]
    fused = torch.cat([step.key.flatten(1), step.value.flatten(1)], dim=1)
    key = fused[:, :32].view(num_tokens, 2, 16)
    value = fused[:, 32:].view(num_tokens, 2, 16)
    write_kv_cache(key, value, step.kv_cache[0], step.kv_cache[1], step.metadata.slot_mapping)
    slots = step.metadata.slot_mapping
    assert torch.equal(_flat(step.kv_cache, 0)[slots], step.key)
    assert torch.equal(_flat(step.kv_cache, 1)[slots], step.value)


def _rotary(step, head_dim, seed=9):
    from pagedllm.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0}).to(step.query.device)
    positions = torch.randint(0, 500, (step.query.shape[0],), generator=torch.Generator().manual_seed(seed))
    return rope(positions.to(step.query.device), step.query.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotate_and_write_equals_the_rotary_kernel_then_the_write(dtype) -> None:
    """Queries and keys as strided slices of one qkv row, GQA, a padding slot and a padded
    token past num_actual_tokens: every value bit-identical to the two-kernel path."""
    from pagedllm.layers.triton_ops import rotary

    step = make_step(SEQS, num_heads=4, num_kv_heads=2, head_dim=24, block_size=4, seed=5, dtype=dtype)
    num_tokens = step.query.shape[0]
    qkv = torch.cat([step.query.flatten(1), step.key.flatten(1), step.value.flatten(1)], dim=1)
    q, k, v = qkv[:, :96].view(-1, 4, 24), qkv[:, 96:144].view(-1, 2, 24), qkv[:, 144:].view(-1, 2, 24)
    cos, sin = _rotary(step, 24)
    slots = step.metadata.slot_mapping.clone()
    slots[2] = -1
    n = num_tokens - 1  # the last token is padding

    want_cache = step.kv_cache.clone()
    want_q = rotary(q, cos, sin)
    write_kv_cache(rotary(k, cos, sin)[:n], v[:n], want_cache[0], want_cache[1], slots[:n])
    got_q = rotate_and_write_kv(q, k, v, cos, sin, step.kv_cache[0], step.kv_cache[1], slots, n)
    assert torch.equal(got_q, want_q)
    assert torch.equal(step.kv_cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))


def test_rotate_and_write_rejects_cos_of_the_wrong_shape() -> None:
    step = make_step(SEQS, num_heads=2, num_kv_heads=1, head_dim=16)
    cos, sin = _rotary(step, 16)
    with pytest.raises(ValueError, match="head_dim // 2"):
        rotate_and_write_kv(step.query, step.key, step.value, cos[:, :4], sin[:, :4],
                            step.kv_cache[0], step.kv_cache[1], step.metadata.slot_mapping, 3)
