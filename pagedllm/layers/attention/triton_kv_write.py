"""Triton kernel that scatters a step's new keys and values into the paged KV cache.

One program per new token copies its ``[num_kv_heads, head_dim]`` key and value rows into
cache slot ``slot_mapping[t]``::

    key[t]   [Hkv, D] --> key_cache[slot // block_size, slot % block_size]   [Hkv, D]
    value[t] [Hkv, D] --> value_cache[slot // block_size, slot % block_size] [Hkv, D]

A negative slot (-1) marks a padding token (a step padded to a captured batch size): its
program writes nothing. Values are cast to the cache's dtype on store. Offsets into the
cache are computed in int64, so caches past 2**31 elements are addressed correctly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.attention.triton_common import unit_last_stride


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]

    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    v_dst = value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    tl.store(
        k_dst + h[:, None] * stride_kc_head + d[None, :],
        k.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + h[:, None] * stride_vc_head + d[None, :],
        v.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key/value: [n, Hkv, D]`` at ``slot_mapping: [n]`` (int, -1 = skip).

    ``key_cache/value_cache: [num_blocks, block_size, Hkv, D]`` (the two halves of one
    layer's ``kv_cache``); each must have a unit stride along ``D``, as must ``key/value``.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} differs from key shape {tuple(key.shape)}.")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping holds {slot_mapping.shape[0]} slots for {num_tokens} tokens."
        )
    key, value = unit_last_stride(key), unit_last_stride(value)
    _, block_size, cache_heads, cache_dim = key_cache.shape
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        raise ValueError(
            f"KV cache holds [{cache_heads} heads, {cache_dim} dims] per slot but the keys are "
            f"[{num_kv_heads}, {head_dim}]."
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("KV cache must be contiguous along head_dim.")
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )

