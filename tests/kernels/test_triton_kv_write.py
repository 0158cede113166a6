"""The Triton KV-cache write against the slots the metadata names."""

from __future__ import annotations

import torch

from pagedllm.layers.attention.triton_kv_write import write_kv_cache
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
