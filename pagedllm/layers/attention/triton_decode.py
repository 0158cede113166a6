"""Triton decode attention over the paged KV cache, with a split-K (flash-decoding) path.

A decode is one query per sequence (query length 1) at position ``seq_len - 1``. One
program owns one sequence, one KV head and one partition of the context, and computes
the ``G = num_heads // num_kv_heads`` query heads of that KV head together, so each K/V
tile is read once for all of them (GQA/MQA)::

    grid (num_kv_heads, B, num_splits)      program (h, r, s) serves sequence order[r]
    partition_b = max(cdiv(cdiv(seq_len_b, num_splits), BLOCK_N), 1) * BLOCK_N   (tokens)
    partition s covers keys [s * partition_b, min((s + 1) * partition_b, seq_len_b))
        clipped to the sliding window: the partitions that hold keys are
        first_b = window_start_b // partition_b  up to  cdiv(seq_len_b, partition_b)

Each sequence cuts its own context into at most ``num_splits`` partitions of whole
``BLOCK_N`` tiles, so a short context beside a long one, or under a loose ``max_seq_len``,
is still spread over the splits. The programs of partitions that hold no key return at
once.

With one split, or one partition holding keys, the program normalises and writes the
output directly (a context of no keys: zeros). Otherwise each writes its unnormalised
partial ``acc`` with its running max ``m`` and sum ``l`` (base-2 units) and counts itself
in on an arrival counter of its (sequence, KV head); the program that arrives last merges
the partials (no second launch)::

    M = max_s m_s      out = sum_s 2^(m_s - M) * acc_s  /  sum_s 2^(m_s - M) * l_s

The counters (``triton_ops.arrival_counters``) are zero between launches: the merging
program resets its counter, and launches on a stream do not overlap.

With ``new_kv`` (the rope and the cache write riding on the attention launch) the
queries and the step's keys arrive unrotated: every program rotates its query heads, and
the program whose partition holds the sequence's last position (the new token's) rotates
that token's key and caches it with its value before its loop reads them back::

    without new_kv:  rotate_and_write_kv (rope q, k; cache k, v)  ->  decode attention
    with new_kv:     decode attention (rope q; the last partition ropes and caches k, v)

An FP8 cache's values are slot-major (``kv_quant.paged_kv_views``): a tile's values load
as whole pages (``triton_common.slot_major_values``), so tiles start on a page and hold
whole pages (``BLOCK_N >= page``), and the tensor cores read them along the slots, the
dimension the products sum over.

``order`` (optional, a permutation of the batch) sets which sequences the GPU starts
first: the longest first keeps a large batch of mixed lengths from ending on a few long
programs that started late (a program's time grows with its context). Without it,
``order[r] = r``.

Splitting pays when ``B * num_kv_heads`` programs leave the GPU's multiprocessors idle
(small batches, long contexts); ``plan_decode_splits`` chooses. In a mixed batch the
programs of sequences whose query length is not 1 exit at once, so the launch can take the
whole batch. The grid depends only on ``B``, the head counts and ``max_seq_len`` (any upper
bound of the lengths will do), so a launch can be captured in a CUDA graph; the partitions
themselves are sized on the device from each ``seq_len_b``.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.layers.attention.backend import SumsScales
from pagedllm.layers.attention.kv_quant import cache_scales
from pagedllm.layers.attention.triton_common import (
    LOG2_E,
    check_paged_inputs,
    slot_major_values,
    soft_cap,
    soft_cap_constexpr,
    to_cache,
    unit_last_stride,
    uses_fp16_dot,
    uses_ieee_dot,
    values_slot_major,
    widen_e4m3_staged,
    widens_staged,
)
from pagedllm.layers._triton_ops_kernels import (
    follow_previous_kernel,
    rotate_half_whole,
    scaled_sums,
)
from pagedllm.layers.launch_math import cdiv, next_power_of_2
from pagedllm.layers.pdl import launch_options
from pagedllm.layers.triton_ops import arrival_counters
from pagedllm.switches import integer, switch

MIN_PARTITION_TOKENS = 256
MAX_SPLITS = 64


# Programs per multiprocessor a split-K decode plans for (``PAGEDLLM_DECODE_PROGRAMS_PER_SM``).
DECODE_PROGRAMS_PER_SM = integer("PAGEDLLM_DECODE_PROGRAMS_PER_SM", 2, 1, 64)


@triton.jit(do_not_specialize=["num_actual_tokens"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    counters_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    order_ptr,
    new_key_ptr,
    new_value_ptr,
    cos_ptr,
    sin_ptr,
    slot_mapping_ptr,
    row_scale_ptr,
    q_col_scale_ptr,
    k_col_scale_ptr,
    v_col_scale_ptr,
    num_actual_tokens,
    qk_scale,
    k_scale,
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_nkt,
    stride_nkh,
    stride_nvt,
    stride_nvh,
    stride_ct,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE_H: tl.constexpr,
    MERGE_S: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    ROPE_AND_CACHE: tl.constexpr,
    SUMS: tl.constexpr,
    HALF: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FP16_DOT: tl.constexpr,
    WIDEN_STAGED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    V_SLOT_MAJOR: tl.constexpr,
    PDL: tl.constexpr,
):
    follow_previous_kernel(PDL)
    kv_head = tl.program_id(0)
    if HAS_ORDER:
        seq = tl.load(order_ptr + tl.program_id(1))
    else:
        seq = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)  # issued beside the query range, not after it
    if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:
        return
    kv_lo = 0  # the first key any partition reads
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    if SPLIT:
        # The grid's third dimension is num_splits; whole tiles, so only the last is ragged.
        partition = tl.maximum(tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N), 1) * BLOCK_N
        first_part = kv_lo // partition
        # The partitions holding keys (one, empty, for a context of none: it writes zeros).
        num_parts = tl.maximum(tl.cdiv(seq_len, partition) - first_part, 1)
        if (split < first_part) | (split >= first_part + num_parts):
            return
        kv_start = tl.maximum(split * partition, kv_lo)
        kv_end = tl.minimum(split * partition + partition, seq_len)
        holds_last_key = (kv_end == seq_len) & (seq_len > 0)
    else:
        kv_start = kv_lo
        kv_end = seq_len
        holds_last_key = seq_len > 0

    g = tl.arange(0, BLOCK_G)
    g_valid = g < QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + g
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q_heads = q_ptr + q_row.to(tl.int64) * stride_qt + head[:, None] * stride_qh
    q_mask = g_valid[:, None] & d_valid[None, :]
    if ROPE_AND_CACHE:
        rope = q_row.to(tl.int64) * stride_ct + d % HALF
        c = tl.load(cos_ptr + rope, mask=d_valid, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + rope, mask=d_valid, other=0.0).to(tl.float32)
        row_scale = 1.0
        if SUMS:
            row_scale = tl.load(row_scale_ptr + q_row)
        q = rotate_half_whole(q_heads, d[None, :], c, sn, q_mask, HALF, row_scale,
                              q_col_scale_ptr + head[:, None] * HEAD_DIM, SUMS)
        q = q.to(q_ptr.dtype.element_ty)
        if holds_last_key & (q_row < num_actual_tokens):
            _cache_new_token(
                new_key_ptr + q_row.to(tl.int64) * stride_nkt + kv_head * stride_nkh,
                new_value_ptr + q_row.to(tl.int64) * stride_nvt + kv_head * stride_nvh,
                k_cache_ptr + kv_head.to(tl.int64) * stride_kh,
                v_cache_ptr + kv_head.to(tl.int64) * stride_vh,
                tl.load(slot_mapping_ptr + q_row).to(tl.int64),
                stride_kb, stride_ks, stride_vb, stride_vs,
                d, d_valid, c, sn, k_scale, v_scale, HALF, PAGE_SIZE,
                PAGE_SIZE if V_SLOT_MAJOR else 1,
                row_scale, k_col_scale_ptr + kv_head * HEAD_DIM,
                v_col_scale_ptr + kv_head * HEAD_DIM, SUMS,
            )
    else:
        q = tl.load(q_heads + d[None, :], mask=q_mask, other=0.0)
    if FP16_DOT:
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    loop_start = kv_start
    if V_SLOT_MAJOR:  # tiles of whole pages: a window's first tile starts on its page
        loop_start = kv_start // PAGE_SIZE * PAGE_SIZE
    # Every tile holds at least one key (start < kv_end), so m stays finite inside the loop.
    for start in range(loop_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_valid = n < kv_end
        if V_SLOT_MAJOR and USE_WINDOW:
            n_valid &= n >= kv_start
        page = n.to(tl.uint32)  # n >= 0: unsigned division and remainder are shifts and masks
        block = tl.load(table + page // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
        kv_rows = block * stride_kb + (page % PAGE_SIZE).to(tl.int64) * stride_ks
        k = tl.load(
            k_head + kv_rows[None, :] + d[:, None],
            mask=n_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        if WIDEN_STAGED:
            k = widen_e4m3_staged(k)
        if IEEE_DOT:
            s = tl.dot(q, k.to(q.dtype), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        s = s * qk_scale
        if SOFTCAP > 0:
            s = soft_cap(s, SOFTCAP)
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_SLOT_MAJOR:
            v = slot_major_values(v_head, table, start, kv_end, stride_vb, d, d_valid,
                                   BLOCK_N, BLOCK_D, PAGE_SIZE)
        else:
            v = tl.load(  # the caches share strides (check_paged_inputs)
                v_head + kv_rows[:, None] + d[None, :],
                mask=n_valid[:, None] & d_valid[None, :],
                other=0.0,
            )
        if WIDEN_STAGED:
            v = widen_e4m3_staged(v)
        if IEEE_DOT:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc * v_scale  # values are read as stored; the partials carry the scale

    mask = g_valid[:, None] & d_valid[None, :]
    out_heads = out_ptr + q_row.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
    if not SPLIT:
        _store_normalised(out_heads, acc, l_i, mask)
    elif num_parts == 1:
        _store_normalised(out_heads, acc, l_i, mask)
    else:
        # Partials of (sequence, head, partition) rows, contiguous as the grid lays them
        # out; offsets from the grid, so no per-step size or stride specialises the kernel.
        num_splits = tl.num_programs(2)
        seq_rows = seq.to(tl.int64) * (tl.num_programs(0) * QUERIES_PER_KV) * num_splits
        rows = seq_rows + head * num_splits + split
        tl.store(part_acc_ptr + rows[:, None] * HEAD_DIM + d[None, :], acc, mask=mask)
        tl.store(part_max_ptr + rows, m_i, mask=g_valid)
        tl.store(part_sum_ptr + rows, l_i, mask=g_valid)
        # Every thread's stores are issued before one thread releases them with the count.
        tl.debug_barrier()
        counter = counters_ptr + seq * tl.num_programs(0) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_parts - 1:
            tl.store(counter, 0)
            _merge_partitions(
                out_ptr + q_row.to(tl.int64) * stride_ot, stride_oh,
                part_acc_ptr + seq_rows * HEAD_DIM, part_max_ptr + seq_rows, part_sum_ptr + seq_rows,
                num_splits, kv_head * QUERIES_PER_KV,
                first_part, first_part + num_parts,
                QUERIES_PER_KV, MERGE_H, HEAD_DIM, BLOCK_D, MERGE_S,
            )


@triton.jit
def _store_normalised(out_ptrs, acc, l, mask):
    """``acc / l`` into ``out_ptrs`` (zeros where nothing was seen, ``l = 0``)."""
    l = tl.where(l == 0.0, 1.0, l)
    tl.store(out_ptrs, (acc / l[:, None]).to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _cache_new_token(
    key_ptr, value_ptr, k_head_cache_ptr, v_head_cache_ptr, slot,
    stride_kb, stride_ks, stride_vb, stride_vs,
    d, d_valid, c, s, k_scale, v_scale,
    HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    VALUE_D_STRIDE: tl.constexpr,
    row_scale,
    k_col_scale_ptr,
    v_col_scale_ptr,
    SUMS: tl.constexpr,
):
    """One KV head of a new token into ``slot`` (skipped when negative): its key rotated
    (rounded to the activation dtype, then stored as the cache's, ``to_cache``, as
    ``rotate_and_write_kv``) and its value. The barrier after the stores makes them visible
    to the whole program, whose last tile reads them back. ``SUMS``: the key and value are
    an FP8 product's sums, scaled here first (``rotate_half_whole``, ``scaled_sums``)."""
    if slot >= 0:
        block = slot // PAGE_SIZE
        in_block = slot % PAGE_SIZE
        dtype = key_ptr.dtype.element_ty
        k = rotate_half_whole(key_ptr, d, c, s, d_valid, HALF, row_scale, k_col_scale_ptr,
                              SUMS).to(dtype)
        tl.store(k_head_cache_ptr + block * stride_kb + in_block * stride_ks + d,
                 to_cache(k, k_head_cache_ptr, k_scale), mask=d_valid)
        v = tl.load(value_ptr + d, mask=d_valid)
        if SUMS:
            v = scaled_sums(v.to(tl.float32), row_scale, v_col_scale_ptr, d, d_valid,
                            dtype).to(dtype)
        tl.store(v_head_cache_ptr + block * stride_vb + in_block * stride_vs + d * VALUE_D_STRIDE,
                 to_cache(v, v_head_cache_ptr, v_scale), mask=d_valid)
    tl.debug_barrier()


@triton.jit
def _merge_partitions(
    out_row_ptr, stride_oh,
    acc_ptr, max_ptr, sum_ptr, num_splits,
    first_head, first_part, end_part,
    HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_S: tl.constexpr,
):
    """``out[first_head : first_head + HEADS]`` of one sequence from its partials (rows
    ``head * num_splits + partition``) in partitions ``[first_part, end_part)``, ``MERGE_S``
    partitions per chunk, merged online (the chunk's max joins the running max). Every
    partition of that range holds a key, so its ``acc`` was written: it is loaded beside
    ``m`` and ``l``, not after them. Loads bypass L1: other programs wrote them."""
    h = tl.arange(0, BLOCK_H)
    head = first_head + h
    h_valid = h < HEADS
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    s_in_chunk = tl.arange(0, MERGE_S)
    m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_H], tl.float32)
    acc_run = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s0 in range(first_part, end_part, MERGE_S):
        s = s0 + s_in_chunk
        valid = h_valid[:, None] & (s < end_part)[None, :]
        ml = head[:, None] * num_splits + s[None, :]
        m = tl.load(max_ptr + ml, mask=valid, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(sum_ptr + ml, mask=valid, other=0.0, cache_modifier=".cg")
        acc = tl.load(
            acc_ptr + (ml * HEAD_DIM)[:, :, None] + d[None, None, :],
            mask=valid[:, :, None] & d_valid[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_run, tl.max(m, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet
        alpha = tl.exp2(m_run - m_safe)
        w = tl.exp2(m - m_safe[:, None])
        l_run = l_run * alpha + tl.sum(w * l, 1)
        acc_run = acc_run * alpha[:, None] + tl.sum(acc * w[:, :, None], 1)
        m_run = m_new
    l_run = tl.where(l_run == 0.0, 1.0, l_run)
    out = acc_run / l_run[:, None]
    tl.store(
        out_row_ptr + head[:, None] * stride_oh + d[None, :],
        out.to(out_row_ptr.dtype.element_ty),
        mask=h_valid[:, None] & d_valid[None, :],
    )


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """``num_splits`` of a decode launch: the grid's third dimension.

    As many splits as keep ``DECODE_PROGRAMS_PER_SM`` programs per multiprocessor in one
    wave (rounded down: one program past a wave costs a second wave), at least one, with at
    most one split per ``MIN_PARTITION_TOKENS`` of ``max_seq_len`` and at most
    ``MAX_SPLITS``. The kernel sizes each sequence's partitions from its own length (at
    least one ``BLOCK_N`` tile each), so under a loose ``max_seq_len`` a short context uses
    fewer of the splits. Two per multiprocessor (``PAGEDLLM_DECODE_PROGRAMS_PER_SM``
    overrides it) is what the split tile's shared memory holds at once on an H200
    (docs/benchmarks.md: long contexts).
    """
    programs = num_seqs * num_kv_heads
    wanted = DECODE_PROGRAMS_PER_SM * num_sms // max(programs, 1)
    return max(1, min(wanted, -(-max_seq_len // MIN_PARTITION_TOKENS), MAX_SPLITS))


LONGEST_FIRST_ENV = "PAGEDLLM_DECODE_LONGEST_FIRST"
LONGEST_FIRST_MIN_SEQS = 64


def wants_longest_first(num_seqs: int) -> bool:
    """Whether a decode launch of ``num_seqs`` sequences should start the longest first:
    batches of at least ``LONGEST_FIRST_MIN_SEQS`` (several waves of programs), unless
    ``PAGEDLLM_DECODE_LONGEST_FIRST=0``."""
    return num_seqs >= LONGEST_FIRST_MIN_SEQS and switch(LONGEST_FIRST_ENV, True)


@triton.jit(do_not_specialize=["num_seqs"])
def _longest_first_kernel(seq_lens_ptr, order_ptr, num_seqs, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """``order[rank_i] = i`` with ``rank_i`` the number of sequences that come before ``i``:
    longer ones, and equally long ones of smaller index (a stable descending sort)."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_valid = i < num_seqs
    len_i = tl.load(seq_lens_ptr + i, mask=i_valid, other=0)
    rank = tl.zeros([BLOCK_I], tl.int32)
    for j0 in range(0, num_seqs, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        len_j = tl.load(seq_lens_ptr + j, mask=j < num_seqs, other=-1)
        before = (len_j[None, :] > len_i[:, None]) | (
            (len_j[None, :] == len_i[:, None]) & (j[None, :] < i[:, None])
        )
        rank += tl.sum(before.to(tl.int32), 1)
    tl.store(order_ptr + rank, i, mask=i_valid)


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """int32 ``[B]``: the sequence indices by decreasing ``seq_lens`` (ties in index order).

    One small kernel on the device, so a CUDA graph recomputes the order on every replay
    (torch's sort cannot be captured in a graph); ``B * B`` comparisons, spread over
    ``B / 64`` programs.
    """
    num_seqs = seq_lens.shape[0]
    order = torch.empty(num_seqs, dtype=torch.int32, device=seq_lens.device)
    if num_seqs:
        _longest_first_kernel[(cdiv(num_seqs, 64),)](
            seq_lens, order, num_seqs, BLOCK_I=64, BLOCK_J=64, num_warps=4
        )
    return order


def decode_tile_config(head_dim: int, device: torch.device, split: bool,
                       fp8_cache: bool = False, max_seq_len: int | None = None
                       ) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` for the decode kernel (``fp8_cache``: the cache
    holds FP8 values; ``max_seq_len``: a bound of the launch's contexts, None if unknown):
    on CUDA with head_dim up to 128, 64 keys, 4 warps, 2 stages for one pass over a bf16 or
    fp16 cache; 64 keys, 2 warps, 2 stages for one pass over an FP8 cache whose contexts
    are all within ``SHORT_DECODE_CONTEXT``, and on an H100 for any one pass over an FP8
    cache; 128 keys, 4 warps, 2 stages for split partitions and for longer passes over an
    FP8 cache elsewhere; 32 keys for wider heads. The choices come from whole workloads on
    an H200 and an H100, not from one shape alone (the tiles, the sweeps and the workloads
    that decided them: docs/benchmarks.md, "Decode tiles by cache dtype", "short contexts",
    "short decodes on two warps" and "an H100's FP8 decode tile").

    For such measurements ``PAGEDLLM_DECODE_TILE`` / ``PAGEDLLM_DECODE_SPLIT_TILE``
    (``"BLOCK_N,num_warps,num_stages"``) override the one-pass / split choice on CUDA.
    """
    if device.type != "cuda":
        return 16, 4, 1
    override = _tile_override(DECODE_SPLIT_TILE_ENV if split else DECODE_TILE_ENV)
    if override is not None:
        return override
    if head_dim > 128:
        return 32, 4, 2
    long_fp8 = fp8_cache and (max_seq_len is None or max_seq_len > SHORT_DECODE_CONTEXT)
    if split or (long_fp8 and not _h100(device)):
        return 128, 4, 2
    return (64, 2, 2) if fp8_cache else (64, 4, 2)


@functools.cache
def _h100(device: torch.device) -> bool:
    """Whether ``device`` is an H100 (same multiprocessors as an H200, 70% of its memory
    bandwidth), where the FP8 cache's one-pass decode reads fastest in 64-key tiles."""
    return torch.cuda.is_available() and "H100" in torch.cuda.get_device_name(device)


# Contexts up to this many tokens take a one-pass FP8 tile of 64 keys:
# with a few tiles a context, the 128-key tile's half-empty last one and its fewer
# programs in flight cost more than its longer loop saves.
SHORT_DECODE_CONTEXT = 512


def short_decode_context(head_dim: int, device: torch.device, fp8_cache: bool) -> int | None:
    """The context bound at or below which a one-pass decode launch takes another tile
    than an unbounded one (``decode_tile_config``), or None where the tile is the same.
    A CUDA graph that replays decodes of contexts within the bound must be captured under
    it to launch that tile."""
    short = decode_tile_config(head_dim, device, False, fp8_cache, SHORT_DECODE_CONTEXT)
    return SHORT_DECODE_CONTEXT if short != decode_tile_config(head_dim, device, False,
                                                               fp8_cache) else None


DECODE_TILE_ENV = "PAGEDLLM_DECODE_TILE"
DECODE_SPLIT_TILE_ENV = "PAGEDLLM_DECODE_SPLIT_TILE"
DECODE_MAX_REGISTERS_ENV = "PAGEDLLM_DECODE_MAX_REGISTERS"
# The registers a thread of a decode launch on CUDA may take (ptxas' ``maxnreg``; from
# ``PAGEDLLM_DECODE_MAX_REGISTERS``, 32-255), or None for the compiler's own count. Fewer
# registers a thread let more programs share a multiprocessor; below the kernel's need the
# compiler spills to local memory.
MAX_REGISTERS = integer(DECODE_MAX_REGISTERS_ENV, None, 32, 255)


@functools.cache
def _tile_override(name: str) -> tuple[int, int, int] | None:
    """``(BLOCK_N, num_warps, num_stages)`` from the environment variable ``name``."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        block_n, num_warps, num_stages = (int(v) for v in value.split(","))
    except ValueError:
        raise ValueError(f"{name}={value!r}: give three integers, BLOCK_N,num_warps,num_stages "
                         "(e.g. 64,4,2).") from None
    if block_n < 16 or block_n & (block_n - 1) or num_warps not in (1, 2, 4, 8, 16) or num_stages < 1:
        raise ValueError(f"{name}={value!r}: BLOCK_N must be a power of two >= 16, num_warps "
                         "one of 1, 2, 4, 8, 16 and num_stages >= 1.")
    return block_n, num_warps, num_stages


class NewKV(NamedTuple):
    """A step's new tokens for ``paged_decode_attention`` to rotate and cache (those of
    its query-length-1 sequences; other rows are left alone):
    ``key/value: [T, Hkv, D]`` (keys unrotated), ``slot_mapping: [T]`` (-1 = skip),
    ``cos/sin: [T, D // 2]`` (rotate-half rope, as ``RotaryEmbedding.apply``) and
    ``num_actual_tokens`` (rows from there on are padding: neither rotated into the cache
    nor cached). ``sums``: the query, key and value hold an FP8 product's sums, which the
    launch scales as it reads them (before the rope)."""

    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    num_actual_tokens: int
    sums: SumsScales | None = None


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    *,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    order: torch.Tensor | None = None,
    new_kv: NewKV | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logits_soft_cap: float | None = None,
) -> None:
    """Attention of every query-length-1 sequence of the batch into ``out``.

    Arguments as in ``paged_prefill_attention``; rows of other sequences are left
    untouched. ``max_seq_len`` bounds every ``seq_lens[b]`` and serves only to plan the
    splits. ``num_splits`` forces the number of partitions each context is cut into
    (default: ``plan_decode_splits``). ``order`` (int32 ``[B]``, a permutation of the
    sequences) is the order their programs start in, e.g. ``longest_first(seq_lens)``.
    With ``new_kv``, ``query`` is unrotated and the step's keys and values are cached by
    this launch (see the module docstring). ``k_scale`` / ``v_scale``: the layer's scales
    of an FP8 cache (ignored for another dtype).
    """
    check_paged_inputs(query, key_cache, value_cache)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}.")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}.")
    query = unit_last_stride(query)
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous along head_dim.")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = plan_decode_splits(
            num_seqs, num_kv_heads, max_seq_len, _multiprocessor_count(query.device)
        )
    split = num_splits > 1
    default_n, num_warps, num_stages = decode_tile_config(
        head_dim, query.device, split, fp8_cache=key_cache.element_size() == 1,
        max_seq_len=max_seq_len)
    block_n = block_n or default_n
    slot_major = values_slot_major(value_cache)
    if slot_major:  # tiles of whole pages
        block_n = max(block_n, key_cache.shape[1])
    block_d = max(16, next_power_of_2(head_dim))
    k_scale, v_scale = cache_scales(key_cache, k_scale, v_scale)
    fp16_dot = uses_fp16_dot(query.dtype, key_cache.dtype)
    if new_kv is not None:
        new_key, new_value = unit_last_stride(new_kv.key), unit_last_stride(new_kv.value)
        cos, sin = new_kv.cos, new_kv.sin
        if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
            cos, sin = cos.contiguous(), sin.contiguous()
        if head_dim % 2 or tuple(cos.shape) != (query.shape[0], head_dim // 2) or sin.shape != cos.shape:
            raise ValueError(f"cos and sin must be [tokens, head_dim // 2] = [{query.shape[0]}, "
                             f"{head_dim // 2}], got {tuple(cos.shape)} and {tuple(sin.shape)}.")
        if new_key.shape != (query.shape[0], num_kv_heads, head_dim) or new_value.shape != new_key.shape:
            raise ValueError(f"new keys {tuple(new_key.shape)} and values {tuple(new_value.shape)} "
                             f"must be [{query.shape[0]}, {num_kv_heads}, {head_dim}].")
        if new_kv.slot_mapping.shape[0] < new_kv.num_actual_tokens:
            raise ValueError(f"slot_mapping holds {new_kv.slot_mapping.shape[0]} slots for "
                             f"{new_kv.num_actual_tokens} tokens.")
        sums = _qkv_scale_args(new_kv.sums, query.shape[0], num_heads, num_kv_heads, head_dim)
        rope_args = (new_key, new_value, cos, sin, new_kv.slot_mapping,
                     *(sums or (query,) * 4), new_kv.num_actual_tokens)
        rope_strides = (new_key.stride(0), new_key.stride(1), new_value.stride(0),
                        new_value.stride(1), cos.stride(0))
    else:
        sums = None
        rope_args = (query, query, query, query, seq_lens, *(query,) * 4, 0)  # unused
        rope_strides = (0, 0, 0, 0, 0)
    if split:
        part_acc = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        counters = arrival_counters(query.device, num_seqs * num_kv_heads)
    else:
        part_acc = part_max = part_sum = out  # unused: the kernel writes ``out`` directly
        counters = seq_lens
    _decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        part_acc,
        part_max,
        part_sum,
        counters,
        block_tables,
        seq_lens,
        query_start_loc,
        order if order is not None else seq_lens,
        *rope_args,
        scale * LOG2_E * k_scale,
        k_scale,
        v_scale,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        *rope_strides,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=key_cache.shape[1],
        BLOCK_G=max(16, next_power_of_2(queries_per_kv)),
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        SPLIT=split,
        MERGE_H=next_power_of_2(queries_per_kv),
        MERGE_S=_merge_chunk(queries_per_kv, block_d),
        HAS_ORDER=order is not None,
        ROPE_AND_CACHE=new_kv is not None,
        SUMS=sums is not None,
        HALF=head_dim // 2,
        IEEE_DOT=uses_ieee_dot(query.dtype),
        FP16_DOT=fp16_dot,
        WIDEN_STAGED=widens_staged(fp16_dot),
        SOFTCAP=soft_cap_constexpr(logits_soft_cap),
        V_SLOT_MAJOR=slot_major,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(query.device),
        **_register_cap(query.device),
    )


def _qkv_scale_args(sums: SumsScales | None, tokens: int, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, ...] | None:
    """``sums``' four float32 tensors, contiguous and checked against the step's shapes."""
    if sums is None:
        return None
    sizes = (tokens, num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    args = tuple(t.reshape(-1) for t in sums)
    if any(t.dtype != torch.float32 or t.numel() != size for t, size in zip(args, sizes)):
        raise ValueError(f"sums scales: float32 of {sizes} values (row, q, k, v), got "
                         f"{[(t.dtype, t.numel()) for t in args]}.")
    return tuple(t.contiguous() for t in args)


def _register_cap(device: torch.device) -> dict:
    """``maxnreg`` for a launch on ``device`` when ``MAX_REGISTERS`` sets one."""
    cap = MAX_REGISTERS if device.type == "cuda" else None
    return {} if cap is None else {"maxnreg": cap}


def _merge_chunk(queries_per_kv: int, block_d: int) -> int:
    """Partitions merged per chunk: about 8k float32 values of ``acc`` at a time. It does
    not follow the step's split count, which would compile a kernel variant per count."""
    heads = next_power_of_2(queries_per_kv)
    return max(1, min(MAX_SPLITS, 8192 // (heads * block_d)))
