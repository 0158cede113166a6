"""Small pieces shared by the Triton attention kernels and their launchers.

Units used by every kernel: positions and lengths count tokens; ``qk_scale`` is the
softmax scale times ``log2(e)`` (times ``k_scale`` for an FP8 cache), so scores live in
base-2 exponent units and the kernels use ``exp2``; a running max of ``-inf`` means "no
key seen yet".

An FP8 cache (float8_e4m3fn, ``kv_quant.py``): every write goes through ``to_cache``
(divide by the layer's scale, clamp to +-448, round to nearest); reads cast the stored
values up to the queries' dtype (exact) and apply the scales outside the products:
``k_scale`` in ``qk_scale``, ``v_scale`` on the output. Launchers pass the scales through
``kv_quant.cache_scales``, so a cache of another dtype sees 1.0 (a no-op).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from pagedllm.layers.attention.kv_quant import values_slot_major
from pagedllm.switches import choice

LOG2_E = 1.0 / math.log(2.0)
FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn


@triton.jit
def soft_cap(s, SOFTCAP: tl.constexpr):
    """Scores in log2 units (times ``log2(e)``) through ``cap * tanh(s / cap)``, with
    ``SOFTCAP = cap * log2(e)`` (the same cap in natural units); tanh as
    ``2 * sigmoid(2y) - 1`` in float32."""
    y = s.to(tl.float32) / SOFTCAP
    return SOFTCAP * (2.0 * tl.sigmoid(2.0 * y) - 1.0)


def soft_cap_constexpr(logits_soft_cap: float | None) -> float:
    """The kernels' ``SOFTCAP`` for a cap in natural units (0.0: no cap)."""
    return float(logits_soft_cap) * LOG2_E if logits_soft_cap else 0.0


@triton.jit
def to_cache(x, cache_ptr, scale):
    """``x`` as ``cache_ptr``'s element type stores it: for float8_e4m3fn
    ``round(clamp(x / scale, -448, 448))`` in float32 (an IEEE division, as torch's), NaN
    stored as 0, so an FP8 cache holds finite values only; for any other type ``x`` cast
    (``scale`` unused)."""
    cache_dtype = cache_ptr.dtype.element_ty
    if cache_dtype == tl.float8e4nv:
        y = tl.math.div_rn(x.to(tl.float32), scale)
        y = tl.where(y != y, 0.0, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
        return y.to(cache_dtype)
    else:
        return x.to(cache_dtype)


@triton.jit
def slot_major_values(v_head, table, start, kv_end, stride_vb, d, d_valid,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_D]`` value tile of keys ``start ..`` (``start`` a multiple of
    ``PAGE_SIZE``, ``BLOCK_N`` whole pages) from a slot-major cache: each page's slots are
    contiguous per ``d``, so they load as 16-byte vectors, whole pages at a time. Pages
    past ``kv_end`` read as zeros; the slots past ``kv_end`` in its last page are read as
    stored, finite (an FP8 cache holds finite values only, ``kv_quant``), and weighted
    zero by the caller."""
    pg = start // PAGE_SIZE + tl.arange(0, BLOCK_N // PAGE_SIZE)
    slot = tl.arange(0, PAGE_SIZE)
    held = pg * PAGE_SIZE < kv_end
    blk = tl.load(table + pg, mask=held, other=0).to(tl.int64)
    v = tl.load(
        v_head + (blk * stride_vb)[:, None, None] + slot[None, :, None]
        + (d * PAGE_SIZE)[None, None, :],
        mask=held[:, None, None] & d_valid[None, None, :],
        other=0.0,
    )
    return tl.reshape(v, [BLOCK_N, BLOCK_D])


@triton.jit
def find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query tile ``tile`` of a varlen batch.

    Sequence ``b`` owns tiles ``qsl[b] // BLOCK_Q + b`` up to (excluding)
    ``qsl[b + 1] // BLOCK_Q + b + 1``: at least ``ceil(query_len / BLOCK_Q)`` tiles, the
    surplus one exits at once. The whole batch needs at most ``T // BLOCK_Q + B`` tiles,
    a bound known on the host without reading ``query_start_loc``.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs  # a tensor even when num_seqs == 1 arrives as a constant
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dimension is contiguous, else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def check_kv_rows(rows: torch.Tensor, min_rows: int, num_kv_heads: int, head_dim: int,
                  name: str, dtype: torch.dtype | None = None) -> None:
    """Raise ValueError unless ``rows`` holds keys and values as contiguous rows
    (``[2, >= min_rows, num_kv_heads, head_dim]``, unit stride along ``head_dim``, of
    ``dtype`` when given): the KV write's ``fresh`` and prefill's ``new_kv``."""
    if (rows.dim() != 4 or rows.shape[0] != 2 or rows.shape[1] < min_rows
            or tuple(rows.shape[2:]) != (num_kv_heads, head_dim) or rows.stride(-1) != 1
            or (dtype is not None and rows.dtype != dtype)):
        raise ValueError(f"{name} must be [2, >= {min_rows}, {num_kv_heads}, {head_dim}]"
                         f"{'' if dtype is None else f' in {dtype}'} with a unit stride along "
                         f"head_dim, got {tuple(rows.shape)} in {rows.dtype}.")


def check_paged_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Raise ValueError unless ``query: [T, H, D]`` fits caches ``[blocks, block_size, Hkv, D]``
    that share their strides (the attention kernels address a key and its value with one
    offset), or whose values are slot-major (``kv_quant.paged_kv_views``), block strides
    shared."""
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, heads, head_dim], got shape {tuple(query.shape)}.")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}."
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} differs from the cache's {key_cache.shape[3]}.")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of the cache's num_kv_heads={num_kv_heads}."
        )
    if key_cache.stride(-1) != 1:
        raise ValueError("key_cache must be contiguous along head_dim.")
    if key_cache.stride()[0] != value_cache.stride()[0]:
        raise ValueError("key_cache and value_cache must share their block stride (the two "
                         f"halves of one cache tensor), got {key_cache.stride()} and "
                         f"{value_cache.stride()}.")
    if value_cache.stride() != key_cache.stride() and not values_slot_major(value_cache):
        raise ValueError("value_cache must share key_cache's strides or be slot-major "
                         f"(paged_kv_views), got {key_cache.stride()} and {value_cache.stride()}.")


FP8_KV_DOT_ENV = "PAGEDLLM_FP8_KV_DOT"
FP8_KV_WIDEN_ENV = "PAGEDLLM_FP8_KV_WIDEN"


def widens_staged(fp16_dot: bool) -> bool:
    """Whether a decode launch whose products run in float16 over an FP8 cache
    (``fp16_dot``) widens the keys and values before its products (``widen_e4m3_staged``)
    rather than at their operand loads: ``PAGEDLLM_FP8_KV_WIDEN=staged`` (default
    ``operand``, until timed on a GPU), never under Triton's interpreter, which runs no
    inline assembly. A value the switch does not take is refused wherever it applies."""
    staged = choice(FP8_KV_WIDEN_ENV, ("operand", "staged"), "operand") == "staged"
    return staged and fp16_dot and os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def widen_e4m3_staged(x):
    """e4m3 ``x`` widened to float16 (exactly) by the conversion instruction, in an
    operation the compiler may not move. Widened by ``x.to(tl.float16)``, an FP8 tile that
    feeds ``tl.dot`` is widened where the product loads it from shared memory, and both of
    the product's operands take a four-wide layout that ``ldmatrix`` cannot load: the
    other operand (the loop-invariant queries, or the probabilities) then goes through
    shared memory and register moves at every iteration. Widened here, the tile is float16
    before the product, which stages it in shared memory and loads both operands with
    ``ldmatrix`` (the decode loop's machine code: docs/benchmarks.md)."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.float16,
        is_pure=False, pack=4)


def uses_fp16_dot(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the attention products run in float16 instead of the query's bfloat16: over
    an FP8 cache, where e4m3 values widen to float16 in one conversion (to bfloat16 it
    takes a second) and exactly, bf16 queries of normal magnitude are exact in float16, and
    the probabilities keep three more mantissa bits. ``PAGEDLLM_FP8_KV_DOT=bf16`` turns it
    off (to compare)."""
    return (query_dtype == torch.bfloat16 and cache_dtype == torch.float8_e4m3fn
            and choice(FP8_KV_DOT_ENV, ("fp16", "bf16"), "fp16") == "fp16")


def uses_ieee_dot(dtype: torch.dtype) -> bool:
    """fp32 inputs keep full precision in ``tl.dot`` (no TF32 rounding on tensor cores)."""
    return dtype == torch.float32
