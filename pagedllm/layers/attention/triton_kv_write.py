"""Triton kernel that scatters a step's new keys and values into the paged KV cache.

One program per new token copies its ``[num_kv_heads, head_dim]`` key and value rows into
cache slot ``slot_mapping[t]``::

    key[t]   [Hkv, D] --> key_cache[slot // block_size, slot % block_size]   [Hkv, D]
    value[t] [Hkv, D] --> value_cache[slot // block_size, slot % block_size] [Hkv, D]
                          (strided along D when the values are slot-major)

A negative slot (-1) marks a padding token (a step padded to a captured batch size): its
program writes nothing. Values are cast to the cache's dtype on store (an FP8 cache:
divided by ``k_scale`` / ``v_scale`` and clamped first, ``triton_common.to_cache``).
Offsets into the cache are computed in int64, so caches past 2**31 elements are addressed
correctly.

``rotate_and_write_kv`` does the same for keys that still need their rotary embedding, in
the same launch: it rotates the step's queries and keys (rotate-half, as
``triton_ops.rotary``) and writes the rotated keys, one kernel where the model would
otherwise run two (rotary, then the write).

Both may also copy each token's key and value, as the cache holds them, into ``fresh:
[2, n, Hkv, D]`` (keys, then values; row ``t`` for token ``t``, padding slots too), in the
dtype the attention products run in: for an FP8 cache the stored e4m3 values widened
exactly, not scaled. Prefill attention then reads a step's own keys from those contiguous
rows instead of gathering them from the pages (``triton_prefill``: the same values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers._triton_ops_kernels import follow_previous_kernel, rotate_half
from pagedllm.layers.attention.kv_quant import cache_scales, values_slot_major
from pagedllm.layers.attention.triton_common import check_kv_rows, to_cache, unit_last_stride
from pagedllm.layers.launch_math import next_power_of_2
from pagedllm.layers.pdl import launch_options


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
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
    stride_vc_dim,
    fresh_ptr,
    stride_f2,
    stride_ft,
    stride_fh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WRITE_FRESH: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_cached = to_cache(k, key_cache_ptr, k_scale)
    v_cached = to_cache(v, value_cache_ptr, v_scale)
    if WRITE_FRESH:
        f_dst = fresh_ptr + token * stride_ft + h[:, None] * stride_fh + d[None, :]
        tl.store(f_dst, k_cached.to(fresh_ptr.dtype.element_ty), mask=mask)
        tl.store(f_dst + stride_f2, v_cached.to(fresh_ptr.dtype.element_ty), mask=mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    k_dst = key_cache_ptr + (slot // PAGE_SIZE) * stride_kc_block + (slot % PAGE_SIZE) * stride_kc_slot
    v_dst = value_cache_ptr + (slot // PAGE_SIZE) * stride_vc_block + (slot % PAGE_SIZE) * stride_vc_slot
    tl.store(k_dst + h[:, None] * stride_kc_head + d[None, :], k_cached, mask=mask)
    tl.store(v_dst + h[:, None] * stride_vc_head + d[None, :] * stride_vc_dim, v_cached, mask=mask)


@triton.jit(do_not_specialize=["num_actual_tokens"])
def _rotate_and_write_kv_kernel(
    query_ptr,
    key_ptr,
    value_ptr,
    cos_ptr,
    sin_ptr,
    query_out_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_actual_tokens,
    k_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_qot,
    stride_qoh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    fresh_ptr,
    stride_f2,
    stride_ft,
    stride_fh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PDL: tl.constexpr,
    WRITE_FRESH: tl.constexpr,
):
    """One token: its query heads rotated into ``query_out`` (every token, padding too, so
    the attention reads defined values), then, for a real token with a slot, its key heads
    rotated and its value heads copied into the cache. Rotated values are rounded to the
    activation dtype before the cast to the cache's, as the rotary kernel followed by the
    write would."""
    follow_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_valid = d < HALF
    c = tl.load(cos_ptr + token * stride_ct + d, mask=d_valid, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + token * stride_ct + d, mask=d_valid, other=0.0).to(tl.float32)[None, :]
    dtype = query_out_ptr.dtype.element_ty

    qh = tl.arange(0, BLOCK_QH)
    q_mask = (qh < NUM_HEADS)[:, None] & d_valid[None, :]
    q1, q2 = rotate_half(query_ptr + token * stride_qt + qh[:, None] * stride_qh + d[None, :], c, s, q_mask, HALF)
    q_dst = query_out_ptr + token * stride_qot + qh[:, None] * stride_qoh + d[None, :]
    tl.store(q_dst, q1.to(dtype), mask=q_mask)
    tl.store(q_dst + HALF, q2.to(dtype), mask=q_mask)

    if token >= num_actual_tokens:
        return
    h = tl.arange(0, BLOCK_H)
    kv_mask = (h < NUM_KV_HEADS)[:, None] & d_valid[None, :]
    k1, k2 = rotate_half(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], c, s, kv_mask, HALF)
    k1 = to_cache(k1.to(dtype), key_cache_ptr, k_scale)
    k2 = to_cache(k2.to(dtype), key_cache_ptr, k_scale)
    v_src = value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :]
    v1 = to_cache(tl.load(v_src, mask=kv_mask), value_cache_ptr, v_scale)
    v2 = to_cache(tl.load(v_src + HALF, mask=kv_mask), value_cache_ptr, v_scale)
    if WRITE_FRESH:
        f_dtype = fresh_ptr.dtype.element_ty
        f_dst = fresh_ptr + token * stride_ft + h[:, None] * stride_fh + d[None, :]
        tl.store(f_dst, k1.to(f_dtype), mask=kv_mask)
        tl.store(f_dst + HALF, k2.to(f_dtype), mask=kv_mask)
        tl.store(f_dst + stride_f2, v1.to(f_dtype), mask=kv_mask)
        tl.store(f_dst + stride_f2 + HALF, v2.to(f_dtype), mask=kv_mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    k_dst = (key_cache_ptr + (slot // PAGE_SIZE) * stride_kc_block + (slot % PAGE_SIZE) * stride_kc_slot
             + h[:, None] * stride_kc_head + d[None, :])
    tl.store(k_dst, k1, mask=kv_mask)
    tl.store(k_dst + HALF, k2, mask=kv_mask)
    v_dst = (value_cache_ptr + (slot // PAGE_SIZE) * stride_vc_block + (slot % PAGE_SIZE) * stride_vc_slot
             + h[:, None] * stride_vc_head + d[None, :] * stride_vc_dim)
    tl.store(v_dst, v1, mask=kv_mask)
    tl.store(v_dst + HALF * stride_vc_dim, v2, mask=kv_mask)


def _cache_block_size(key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int,
                      head_dim: int) -> int:
    """The caches' block size; raises ValueError unless they hold ``[num_kv_heads, head_dim]``
    per slot, keys contiguous along ``head_dim``, values too or slot-major
    (``kv_quant.paged_kv_views``)."""
    _, block_size, cache_heads, cache_dim = key_cache.shape
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        raise ValueError(
            f"KV cache holds [{cache_heads} heads, {cache_dim} dims] per slot but the keys are "
            f"[{num_kv_heads}, {head_dim}]."
        )
    values_ok = value_cache.stride(-1) == 1 or values_slot_major(value_cache)
    if key_cache.stride(-1) != 1 or not values_ok:
        raise ValueError("KV cache must be contiguous along head_dim (values: or slot-major).")
    return block_size


def _fresh_args(fresh: torch.Tensor | None, key: torch.Tensor, num_tokens: int) -> tuple:
    """The kernels' ``fresh_ptr, stride_f2, stride_ft, stride_fh`` (``key`` stands in when
    there is none: the kernel then never touches it); ``fresh`` checked by
    ``check_kv_rows``."""
    if fresh is None:
        return key, 0, 0, 0
    check_kv_rows(fresh, num_tokens, key.shape[1], key.shape[2], "fresh")
    return fresh, fresh.stride(0), fresh.stride(1), fresh.stride(2)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fresh: torch.Tensor | None = None,
) -> None:
    """Store ``key/value: [n, Hkv, D]`` at ``slot_mapping: [n]`` (int, -1 = skip).

    ``key_cache/value_cache: [num_blocks, block_size, Hkv, D]`` (the two halves of one
    layer's ``kv_cache``, ``kv_quant.paged_kv_views``): keys with a unit stride along
    ``D``, values too or slot-major; ``key/value`` with a unit stride along ``D``.
    ``k_scale`` / ``v_scale``: the layer's scales, used only by an FP8 cache. ``fresh``:
    also the cached values of every row, as ``fresh[0]`` (keys) and ``fresh[1]`` (values),
    in ``fresh``'s dtype (the module docstring).
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
    block_size = _cache_block_size(key_cache, value_cache, num_kv_heads, head_dim)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *cache_scales(key_cache, k_scale, v_scale),
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
        value_cache.stride(3),
        *_fresh_args(fresh, key, num_tokens),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        PAGE_SIZE=block_size,
        WRITE_FRESH=fresh is not None,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def rotate_and_write_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_actual_tokens: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fresh: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate ``query: [T, H, D]`` and ``key: [T, Hkv, D]`` by ``cos, sin: [T, D // 2]``
    (rotate-half) and store the first ``num_actual_tokens`` rotated keys and their
    ``value`` rows at ``slot_mapping`` (-1 = skip); returns the rotated queries, a new
    ``[T, H, D]`` tensor in ``query``'s dtype. Arguments otherwise as ``write_kv_cache``
    (an FP8 cache stores the rotated keys rounded to ``query``'s dtype, then quantized;
    ``fresh`` gets the first ``num_actual_tokens`` rows).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape != value.shape or key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)} must share tokens and head_dim.")
    if head_dim % 2 or tuple(cos.shape) != (num_tokens, head_dim // 2) or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must be [tokens, head_dim // 2] = [{num_tokens}, {head_dim // 2}], "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}.")
    if slot_mapping.shape[0] < num_actual_tokens:
        raise ValueError(f"slot_mapping holds {slot_mapping.shape[0]} slots for {num_actual_tokens} tokens.")
    block_size = _cache_block_size(key_cache, value_cache, num_kv_heads, head_dim)
    query, key, value = unit_last_stride(query), unit_last_stride(key), unit_last_stride(value)
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    _rotate_and_write_kv_kernel[(num_tokens,)](
        query, key, value, cos, sin, out, key_cache, value_cache, slot_mapping, num_actual_tokens,
        *cache_scales(key_cache, k_scale, v_scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), cos.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), value_cache.stride(3),
        *_fresh_args(fresh, key, num_actual_tokens),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        BLOCK_QH=next_power_of_2(num_heads),
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(head_dim // 2),
        PAGE_SIZE=block_size,
        WRITE_FRESH=fresh is not None,
        num_warps=4,
        **launch_options(query.device),
    )
    return out
