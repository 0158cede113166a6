"""Triton varlen attention over paged context: prefill chunks, prefix-cache hits, any query length.

Each sequence's new queries attend causally to all of its context in the paged cache: the
tokens cached by earlier steps (earlier chunks, prefix-cache hits) and its own new tokens,
which the KV write has already stored. Flash-attention style: one program owns a tile of
queries for one KV head and streams the sequence's keys/values through an online softmax,
``BLOCK_N`` tokens at a time, gathered through the block table::

    program (tile, kv_head):   rows r = 0 .. BLOCK_M-1 of the tile
        query  q_off + r // G    (G = num_heads // num_kv_heads query heads per KV head)
        head   kv_head * G + r % G
    keys  n = kv_start .. kv_end-1 in steps of BLOCK_N
        slot of n = block_tables[seq, n // block_size] * block_size + n % block_size

Packing the G query heads of a KV head into one tile (GQA/MQA) reads each K/V tile once
for all of them. Query ``i`` of a sequence sits at absolute position
``seq_len - query_len + i`` and sees key ``j`` iff ``j <= pos`` and, with a sliding
window ``w``, ``j > pos - w``. Keys past the last query of the tile, and keys before the
window of its first query, are never loaded.

A step's own keys and values may also come as contiguous rows (``new_kv: [2, T, Hkv, D]``,
written by the KV write beside the cache, ``triton_kv_write``): then each program reads
the sequence's cached context (``0 .. context_len``, visible to every query) from the
pages and its new keys from those rows, which load straight into the products. Over an
FP8 cache that skips the widening of every tile between shared memory and the tensor
cores (the rows are already in the products' dtype); the values are the same. A long
prompt chunk's cached context may be widened into more rows after the new ones
(``plan_context_rows``, ``widen_context_rows``, opt-in): once a step, where each of its
query tiles would widen every FP8 context tile again (or look up every page).

The grid is ``(T // BLOCK_Q + B, num_kv_heads)``; a program finds its sequence by a
binary search over ``query_start_loc`` (see ``find_sequence``), so the launch depends only
on host integers and is safe to capture in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.layers.attention.kv_quant import cache_scales
from pagedllm.layers.attention.triton_common import (
    LOG2_E,
    check_kv_rows,
    check_paged_inputs,
    find_sequence,
    slot_major_values,
    soft_cap,
    soft_cap_constexpr,
    unit_last_stride,
    uses_fp16_dot,
    uses_ieee_dot,
    values_slot_major,
)
from pagedllm.layers.launch_math import next_power_of_2
from pagedllm.switches import choice, switch


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_head,
    v_head,
    table,
    row_shift,
    lo,
    hi,
    kv_end,
    pos,
    window,
    qk_scale,
    stride_kb,
    stride_ks,
    d,
    d_valid,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    V_SLOT_MAJOR: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr,
):
    """Online-softmax update over key tiles ``[lo, hi)``. Unless ``MASKED``, every key of
    every tile is visible to every row (the caller proves it), so no mask is computed.
    ``SOFTCAP`` > 0 caps the scaled scores (``triton_common.soft_cap``). ``PAGED``: key
    ``n`` sits in the cache's pages through ``table``; else in row ``n + row_shift`` of
    contiguous rows ``stride_ks`` apart (``table``, ``stride_kb`` and ``V_SLOT_MAJOR``
    unused).

    ``qk_scale`` > 0, so the row maximum of the raw scores, scaled, is that of the scaled
    scores: each score is then scaled and shifted in one multiply-add, and the products
    with V accumulate into the rescaled ``acc`` inside the dot."""
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        if MASKED:
            n_valid = n < kv_end
        if PAGED:
            page = n.to(tl.uint32)  # n >= 0: unsigned division and remainder are shifts and masks
            if MASKED:
                block = tl.load(table + page // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
            else:
                block = tl.load(table + page // PAGE_SIZE).to(tl.int64)
            kv_rows = block * stride_kb + (page % PAGE_SIZE).to(tl.int64) * stride_ks
        else:
            kv_rows = (n + row_shift).to(tl.int64) * stride_ks
        k_ptrs = k_head + kv_rows[None, :] + d[:, None]
        if MASKED:
            k = tl.load(k_ptrs, mask=n_valid[None, :] & d_valid[:, None], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_valid[:, None], other=0.0)
        if V_SLOT_MAJOR and PAGED:  # the block strides are shared (checked)
            v = slot_major_values(v_head, table, start, kv_end, stride_kb, d, d_valid,
                                  BLOCK_N, BLOCK_D, PAGE_SIZE)
        else:
            v_ptrs = v_head + kv_rows[:, None] + d[None, :]  # the caches share strides (checked)
            if MASKED:
                v = tl.load(v_ptrs, mask=n_valid[:, None] & d_valid[None, :], other=0.0)
            elif EVEN_D:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
        if IEEE_DOT:
            s = tl.dot(q, k.to(q.dtype), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        if SOFTCAP > 0:
            s = soft_cap(s * qk_scale, SOFTCAP)
            s_scale = 1.0
        else:
            s_scale = qk_scale
        if MASKED:
            allowed = n_valid[None, :] & (n[None, :] <= pos[:, None])
            if USE_WINDOW:
                allowed = allowed & (n[None, :] > pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
            # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
            m_shift = m_new
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s * s_scale - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if IEEE_DOT:
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_context(
    acc, l_i, m_i, q, k_src, v_src, table, row_shift, context_len, pos, window, qk_scale,
    stride_kb, stride_row, d, d_valid,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    IEEE_DOT: tl.constexpr, SOFTCAP: tl.constexpr, V_SLOT_MAJOR: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
):
    """``_attend_tiles`` over a sequence's cached context ``[0, context_len)``, visible to
    every row (no window): whole tiles unmasked, the last one masked."""
    context_full = context_len // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_src, v_src, table, row_shift, 0, context_full, context_len, pos,
        window, qk_scale, stride_kb, stride_row, d, d_valid,
        PAGE_SIZE, BLOCK_N, False, False, EVEN_D, IEEE_DOT, SOFTCAP, V_SLOT_MAJOR, BLOCK_D,
        PAGED,
    )
    return _attend_tiles(
        acc, l_i, m_i, q, k_src, v_src, table, row_shift, context_full, context_len,
        context_len, pos, window, qk_scale, stride_kb, stride_row, d, d_valid,
        PAGE_SIZE, BLOCK_N, True, False, EVEN_D, IEEE_DOT, SOFTCAP, V_SLOT_MAJOR, BLOCK_D,
        PAGED,
    )


# ``num_seqs`` changes every step; specialising on its value (== 1, divisible by 16) would
# compile new variants in the middle of a run.
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    qk_scale,
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vh,
    stride_bt,
    new_kv_ptr,
    stride_n2,
    stride_nt,
    stride_nh,
    context_rows_ptr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SKIP_DECODES: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FP16_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,
    V_SLOT_MAJOR: tl.constexpr,
    NEW_KV: tl.constexpr,
    CONTEXT_ROWS: tl.constexpr,
):
    if LONGEST_FIRST:
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_off = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_off >= q_len:
        return
    if SKIP_DECODES:
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    if seq_len < q_len:  # marked as taken elsewhere (``paged_prefill_attention``)
        return
    context_len = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    q_idx = q_off + r // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + r % QUERIES_PER_KV
    row_valid = (r < BLOCK_Q * QUERIES_PER_KV) & (q_idx < q_len)
    pos = context_len + q_idx
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if FP16_DOT:
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    # Key tiles start at multiples of BLOCK_N. Those wholly inside [full_lo, full_hi) are
    # visible to every row of the tile (before the first row's position, and inside the
    # last row's window) and skip the mask; the ragged edges run masked.
    first_pos = context_len + q_off
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    if NEW_KV:  # no window (the launcher's rule): the context is visible to every row
        k_new = new_kv_ptr + kv_head.to(tl.int64) * stride_nh
        context_row = -1  # the context's first row, or -1: its pages
        if CONTEXT_ROWS:
            context_row = tl.load(context_rows_ptr + seq)
        if context_row >= 0:
            acc, l_i, m_i = _attend_context(
                acc, l_i, m_i, q, k_new, k_new + stride_n2, table, context_row, context_len,
                pos, window, qk_scale, 0, stride_nt, d, d_valid,
                PAGE_SIZE, BLOCK_N, BLOCK_D == HEAD_DIM, IEEE_DOT, SOFTCAP, False, BLOCK_D,
                False,
            )
        else:
            acc, l_i, m_i = _attend_context(
                acc, l_i, m_i, q, k_head, v_head, table, 0, context_len, pos, window,
                qk_scale, stride_kb, stride_ks, d, d_valid,
                PAGE_SIZE, BLOCK_N, BLOCK_D == HEAD_DIM, IEEE_DOT, SOFTCAP, V_SLOT_MAJOR,
                BLOCK_D, True,
            )
        # The new keys: key n (n >= context_len) in row q_start + n - context_len.
        row_shift = q_start - context_len
        new_full = context_len + (q_off + 1) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_new, k_new + stride_n2, table, row_shift, context_len, new_full,
            kv_end, pos, window, qk_scale, 0, stride_nt, d, d_valid,
            PAGE_SIZE, BLOCK_N, False, False, BLOCK_D == HEAD_DIM, IEEE_DOT, SOFTCAP, False,
            BLOCK_D, False,
        )
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_new, k_new + stride_n2, table, row_shift, new_full, kv_end,
            kv_end, pos, window, qk_scale, 0, stride_nt, d, d_valid,
            PAGE_SIZE, BLOCK_N, True, False, BLOCK_D == HEAD_DIM, IEEE_DOT, SOFTCAP, False,
            BLOCK_D, False,
        )
    else:
        full_hi = (first_pos + 1) // BLOCK_N * BLOCK_N
        if USE_WINDOW:
            kv_start = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
            full_lo = tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N
            full_lo = tl.minimum(full_lo, full_hi)
            acc, l_i, m_i = _attend_tiles(
                acc, l_i, m_i, q, k_head, v_head, table, 0, kv_start, full_lo, kv_end, pos,
                window, qk_scale, stride_kb, stride_ks, d, d_valid,
                PAGE_SIZE, BLOCK_N, True, USE_WINDOW, BLOCK_D == HEAD_DIM, IEEE_DOT, SOFTCAP,
                V_SLOT_MAJOR, BLOCK_D, True,
            )
        else:
            full_lo = 0
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_head, v_head, table, 0, full_lo, full_hi, kv_end, pos, window,
            qk_scale, stride_kb, stride_ks, d, d_valid,
            PAGE_SIZE, BLOCK_N, False, USE_WINDOW, BLOCK_D == HEAD_DIM, IEEE_DOT, SOFTCAP,
            V_SLOT_MAJOR, BLOCK_D, True,
        )
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_head, v_head, table, 0, tl.maximum(full_hi, full_lo), kv_end,
            kv_end, pos, window, qk_scale, stride_kb, stride_ks, d, d_valid,
            PAGE_SIZE, BLOCK_N, True, USE_WINDOW, BLOCK_D == HEAD_DIM, IEEE_DOT, SOFTCAP,
            V_SLOT_MAJOR, BLOCK_D, True,
        )

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None] * v_scale
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


PREFILL_LONGEST_FIRST = switch("PAGEDLLM_PREFILL_LONGEST_FIRST", False)
# Which caches' prompt steps read their new keys from contiguous rows (the module
# docstring): "fp8" (FP8 caches only), "all", or "off".
PREFILL_NEW_KV = choice("PAGEDLLM_PREFILL_NEW_KV", ("fp8", "all", "off"), "fp8")


def products_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype the attention products take their inputs in (``uses_fp16_dot``)."""
    return torch.float16 if uses_fp16_dot(query_dtype, cache_dtype) else query_dtype


def new_kv_rows_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype,
                      sliding_window: int | None) -> torch.dtype | None:
    """The dtype of the contiguous new-key rows a prompt step should write for
    ``paged_prefill_attention``'s ``new_kv`` (``PREFILL_NEW_KV``), or None where it reads
    every key from the pages (a sliding window; a cache the setting leaves out)."""
    if sliding_window is not None or PREFILL_NEW_KV == "off":
        return None
    if PREFILL_NEW_KV == "fp8" and cache_dtype != torch.float8_e4m3fn:
        return None
    return products_dtype(query_dtype, cache_dtype)


# Whether prompt chunks whose step keeps new-key rows (``new_kv_rows_dtype``) have their
# cached context widened into rows too (``plan_context_rows``): off until timed in the
# engine (docs/benchmarks.md).
PREFILL_CONTEXT_ROWS = switch("PAGEDLLM_PREFILL_CONTEXT_ROWS", False)
if PREFILL_CONTEXT_ROWS and PREFILL_NEW_KV == "off":
    raise ValueError("PAGEDLLM_PREFILL_CONTEXT_ROWS=1 widens contexts into the new-key rows, "
                     "which PAGEDLLM_PREFILL_NEW_KV=off turns off: set one of them otherwise.")
# A prompt chunk of at least this many new tokens over a cached context (earlier chunks,
# prefix-cache hits) has that context widened into rows once a step; shorter ones (a
# speculative verify, a short chunk) read it from the pages, each query tile once.
CONTEXT_ROWS_MIN_QUERY = 256
# At most this many context tokens a step are widened (4 KiB a token for 8 KV heads of
# 128 in float16: 128 MiB, transient); the sequences past it read their pages.
CONTEXT_ROWS_MAX_TOKENS = 32768


@dataclass(frozen=True)
class ContextRows:
    """Where a step's widened contexts lie in ``new_kv``'s rows (``plan_context_rows``).

    ``rows_needed``: the rows ``new_kv`` must hold (the step's tokens, then the contexts).
    ``starts: [num_seqs]`` int32: the row of each sequence's first context key, -1 where
    it reads its context from the pages. ``seqs``, ``lens``, ``firsts``: ``[S]`` int32, the
    widened sequences, their context lengths and first rows. ``longest``: the largest of
    ``lens``."""

    rows_needed: int
    starts: torch.Tensor
    seqs: torch.Tensor
    lens: torch.Tensor
    firsts: torch.Tensor
    longest: int


def widens_contexts() -> bool:
    """Whether a step that keeps new-key rows also widens long chunks' contexts
    (``PREFILL_CONTEXT_ROWS``)."""
    return PREFILL_CONTEXT_ROWS


def plan_context_rows(query_start_loc: list[int], seq_lens: list[int], num_tokens: int,
                      device: torch.device) -> ContextRows | None:
    """The rows of the contexts to widen this step (host lists of the batch, as
    ``AttentionMetadata``'s ``*_cpu``), after its ``num_tokens`` rows; None where no
    sequence qualifies (``CONTEXT_ROWS_MIN_QUERY``, ``CONTEXT_ROWS_MAX_TOKENS``)."""
    starts = [-1] * len(seq_lens)
    seqs, lens, firsts = [], [], []
    row = num_tokens
    for b, seq_len in enumerate(seq_lens):
        query_len = query_start_loc[b + 1] - query_start_loc[b]
        context_len = seq_len - query_len
        if (query_len < CONTEXT_ROWS_MIN_QUERY or context_len <= 0
                or row + context_len - num_tokens > CONTEXT_ROWS_MAX_TOKENS):
            continue
        starts[b] = row
        seqs.append(b)
        lens.append(context_len)
        firsts.append(row)
        row += context_len
    if not seqs:
        return None
    packed = torch.tensor(starts + seqs + lens + firsts, dtype=torch.int32)
    if device.type == "cuda":  # staged through pinned memory: no wait for the stream
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    b, s = len(seq_lens), len(seqs)
    return ContextRows(row, packed[:b], packed[b:b + s], packed[b + s:b + 2 * s],
                       packed[b + 2 * s:], max(lens))


@triton.jit
def _widen_context_kernel(
    k_cache_ptr, v_cache_ptr, block_tables_ptr, seqs_ptr, lens_ptr, firsts_ptr, rows_ptr,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt, stride_r2, stride_rt, stride_rh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """Page ``program_id(1)`` of widened sequence ``program_id(0)``'s context, KV head
    ``program_id(2)``: its keys and values (``[PAGE_SIZE, D]`` each, whole runs of the
    page in either layout: an FP8 cache's values are slot-major) into their rows, cast to
    the rows' dtype (an FP8 value widens exactly)."""
    i = tl.program_id(0)
    page = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    length = tl.load(lens_ptr + i)
    if page * PAGE_SIZE >= length:
        return
    seq = tl.load(seqs_ptr + i).to(tl.int64)
    block = tl.load(block_tables_ptr + seq * stride_bt + page).to(tl.int64)
    slot = tl.arange(0, PAGE_SIZE)
    d = tl.arange(0, BLOCK_D)
    mask = (page * PAGE_SIZE + slot < length)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + block * stride_kb + h * stride_kh + slot[:, None] * stride_ks
                + d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_cache_ptr + block * stride_vb + h * stride_vh + slot[:, None] * stride_vs
                + d[None, :] * stride_vd, mask=mask)
    row = tl.load(firsts_ptr + i).to(tl.int64) + page * PAGE_SIZE + slot
    dst = rows_ptr + row[:, None] * stride_rt + h * stride_rh + d[None, :]
    tl.store(dst, k.to(rows_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_r2, v.to(rows_ptr.dtype.element_ty), mask=mask)


def widen_context_rows(key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, plan: ContextRows,
                       new_kv: torch.Tensor) -> None:
    """Copy the cached keys and values of ``plan``'s sequences into ``new_kv``'s rows
    (``[2, >= plan.rows_needed, Hkv, D]``, unit stride along ``D``), as
    ``paged_prefill_attention``'s ``context_rows`` reads them."""
    _, page_size, num_kv_heads, head_dim = key_cache.shape
    check_kv_rows(new_kv, plan.rows_needed, num_kv_heads, head_dim, "new_kv")
    grid = (plan.seqs.shape[0], triton.cdiv(plan.longest, page_size), num_kv_heads)
    _widen_context_kernel[grid](
        key_cache, value_cache, block_tables, plan.seqs, plan.lens, plan.firsts, new_kv,
        *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        new_kv.stride(0), new_kv.stride(1), new_kv.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), PAGE_SIZE=page_size,
        num_warps=4 if page_size * head_dim >= 2048 else 1,
    )


def prefill_tile_config(
    max_query_len: int, queries_per_kv: int, head_dim: int, device: torch.device
) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a launch.

    ``BLOCK_M`` rows hold ``BLOCK_M // queries_per_kv`` queries; short query lengths get
    small tiles so a decode-sized sequence does not waste a large one.
    """
    min_m = max(16, next_power_of_2(queries_per_kv))
    rows = max_query_len * queries_per_kv
    if device.type != "cuda":
        return max(min_m, min(32, next_power_of_2(rows))), 16, 4, 1
    # From a sweep on an H200 (``scripts/check_kernels_gpu.py --sweep``): for head_dim 128,
    # bf16, 64 x 64 tiles on 4 warps led (295 TFLOP/s on 4 x 2048 causal prompts).
    block_m = max(min_m, min(64, next_power_of_2(rows)))
    if head_dim <= 128:
        return block_m, 64, 4, 2
    return block_m, 32, 4, 2


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    *,
    num_tokens: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    skip_decodes: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logits_soft_cap: float | None = None,
    longest_first: bool | None = None,
    new_kv: torch.Tensor | None = None,
    context_rows: torch.Tensor | None = None,
) -> None:
    """Attention of the first ``num_tokens`` rows of ``query: [T, H, D]`` into ``out``.

    ``key_cache/value_cache: [num_blocks, block_size, Hkv, D]`` already hold every
    sequence's context and new tokens. ``seq_lens: [B]``, ``query_start_loc: [B + 1]``,
    ``block_tables: [B, max_blocks]`` (int32) describe the batch as in
    ``AttentionMetadata``; ``max_query_len`` may be any upper bound of the query lengths.
    With ``skip_decodes`` sequences of query length 1 are left untouched in ``out`` (the
    decode kernel computes them). ``k_scale`` / ``v_scale``: the layer's scales of an FP8
    cache (ignored for another dtype). ``logits_soft_cap``: scaled scores become
    ``cap * tanh(s / cap)`` before the softmax (Gemma 2). ``longest_first`` (default
    ``PREFILL_LONGEST_FIRST``): tiles start from the last one, so a causal prompt's
    longest rows run first and the launch does not end on them. ``new_kv: [2, >= T, Hkv,
    D]``: the step's keys (``[0]``) and values (``[1]``) as the cache holds them, row ``t``
    for query row ``t``, in ``products_dtype`` (``write_kv_cache``'s ``fresh``); the new
    keys are then read there (no sliding window). ``context_rows: [B]`` int32 (with
    ``new_kv``): the row of ``new_kv`` where each sequence's cached context starts
    (``widen_context_rows``), -1 where it is read from the pages. A sequence whose
    ``seq_lens`` entry is below its query length (0) is skipped: its rows of ``out`` are
    left untouched (the backend marks so the prompts ``dense_prefill`` takes).
    """
    check_paged_inputs(query, key_cache, value_cache)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}.")
    query = unit_last_stride(query)
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous along head_dim.")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    default_m, default_n, num_warps, num_stages = prefill_tile_config(
        max_query_len, queries_per_kv, head_dim, query.device
    )
    block_m = block_m or default_m
    block_n = block_n or default_n
    slot_major = values_slot_major(value_cache)
    if slot_major:  # tiles of whole pages
        block_n = max(block_n, key_cache.shape[1])
    if block_m < queries_per_kv:
        raise ValueError(
            f"block_m={block_m} must hold all {queries_per_kv} query heads of a KV head."
        )
    block_q = block_m // queries_per_kv
    k_scale, v_scale = cache_scales(key_cache, k_scale, v_scale)
    if new_kv is not None:
        if sliding_window is not None:
            raise ValueError("new_kv cannot be used with a sliding window.")
        check_kv_rows(new_kv, num_tokens, num_kv_heads, head_dim, "new_kv",
                      products_dtype(query.dtype, key_cache.dtype))
    if context_rows is not None and (new_kv is None or context_rows.dtype != torch.int32
                                     or context_rows.shape != (num_seqs,)):
        raise ValueError(f"context_rows must be [{num_seqs}] int32 beside new_kv.")
    if longest_first is None:
        longest_first = PREFILL_LONGEST_FIRST
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        scale * LOG2_E * k_scale,
        v_scale,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(2),
        block_tables.stride(0),
        query if new_kv is None else new_kv,
        *((0, 0, 0) if new_kv is None else new_kv.stride()[:3]),
        seq_lens if context_rows is None else context_rows,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        PAGE_SIZE=key_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        SKIP_DECODES=skip_decodes,
        IEEE_DOT=uses_ieee_dot(query.dtype),
        FP16_DOT=uses_fp16_dot(query.dtype, key_cache.dtype),
        SOFTCAP=soft_cap_constexpr(logits_soft_cap),
        LONGEST_FIRST=longest_first,
        V_SLOT_MAJOR=slot_major,
        NEW_KV=new_kv is not None,
        CONTEXT_ROWS=context_rows is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
