"""The Triton kernel behind ``int_matmul.py`` (imported only when a kernel launches).

One kernel serves prompt steps, large decode batches and small ones: each program
multiplies a ``BLOCK_M x BLOCK_N`` output tile over one ``K / SPLIT`` slice of the inputs,
dequantizing its ``BLOCK_N x BLOCK_K`` weight tiles in registers (``int_weight_tile``, which
the small-batch kernel of ``_triton_ops_kernels`` shares: each packed word is loaded once
and unpacked there; the scale and zero point of the tile's group once per row). With
``SPLIT > 1`` (small batches, few output tiles) the slices' float32 partial sums go to a
``[SPLIT, M, N]`` buffer that the caller adds up in a fixed order.
"""

from __future__ import annotations

import triton
import triton.language as tl

cdiv = triton.cdiv


@triton.jit
def int_weight_tile(q_rows, scales_ptr, zeros_ptr, n_rows, stride_sn, k0,
                    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, ROUND: tl.constexpr, dtype: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weights ``(q - zero) * scale`` of inputs ``k0`` onwards
    (one group: ``BLOCK_K`` divides ``GROUP``) from the packed rows at ``q_rows``: float32,
    or rounded once to ``dtype`` with ``ROUND``. Each packed word is loaded once, then
    repeated in registers once per value it holds (``tl.interleave``, which keeps the
    copies in the thread that loaded it: no exchange between threads; twice as fast on an
    H200 as unpacking into a third dimension and reshaping), and each copy shifted to its
    value, in ``k`` order. Tiles of 16 inputs unpack through the reshape: the interleaved
    form gave wrong products there on an H200 (Triton 3.6), though right under the
    interpreter."""
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    DOUBLINGS: tl.constexpr = 3 if BITS == 4 else 2  # log2(PER_WORD): 4 or 8 bits
    word = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    q = tl.load(q_rows + word[None, :])
    if BLOCK_K >= 32:
        for _ in tl.static_range(DOUBLINGS):
            q = tl.interleave(q, q)
        shifts = (tl.arange(0, BLOCK_K) % PER_WORD) * BITS
        q = (q >> shifts[None, :]) & MASK
    else:
        shifts = tl.arange(0, PER_WORD) * BITS
        q = tl.reshape((q[:, :, None] >> shifts[None, None, :]) & MASK, [BLOCK_N, BLOCK_K])
    group = k0 // GROUP
    scale = tl.load(scales_ptr + n_rows * stride_sn + group).to(tl.float32)
    zero = tl.load(zeros_ptr + n_rows * stride_sn + group).to(tl.float32)
    # The bits of 2^23 + q as a float32: exact, and cheaper than an int-to-float conversion.
    centred = (q | 0x4B000000).to(tl.float32, bitcast=True) - (zero + 8388608.0)[:, None]
    w = centred * scale[:, None]
    if ROUND:
        w = w.to(dtype)
    return w


@triton.jit
def int_row_products(q_rows, scales_ptr, zeros_ptr, n_rows, stride_sn, k0, x, one_bits,
                     BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """``sum_k (q[n, k] - zero[n]) * scale[n] * x[k]`` over inputs ``k0 .. k0 + BLOCK_K``
    (one group: ``BLOCK_K`` divides ``GROUP``) for one row ``x`` (``[1, BLOCK_K]``,
    float32): ``[BLOCK_N]`` float32, from the packed rows at ``q_rows``.

    Three instructions a weight: each (interleaved, as ``int_weight_tile`` does) copy of a
    word is shifted so its value lands in the top ``BITS`` bits of a float32 mantissa, one
    ``and``/``or`` with ``one_bits`` (the bits of 1.0, in a register) makes the float
    ``v = 1 + q / 2^BITS`` (exact), and a multiply-add takes it. The zero point and the
    scale come once per row and tile: ``sum (q - zero) x = 2^BITS (sum v x - sum x) -
    zero sum x``. Both sums carry ``sum |x|`` at float32's precision and the difference is
    scaled by 2^BITS, so the result is within about 2^(BITS + 1 - 24) ``sum |x|`` of the
    exact one (a few times the error of summing ``(q - zero) x`` directly): far under the
    output's rounding."""
    PER_WORD: tl.constexpr = 32 // BITS
    DOUBLINGS: tl.constexpr = 3 if BITS == 4 else 2  # log2(PER_WORD): 4 or 8 bits
    FIELD: tl.constexpr = 23 - BITS  # the value's lowest bit in the mantissa
    word = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    q = tl.load(q_rows + word[None, :]).to(tl.uint32, bitcast=True)
    for _ in tl.static_range(DOUBLINGS):
        q = tl.interleave(q, q)
    # One shift per copy (left or right: a constant for each register) brings the value
    # at bits BITS * j to bits FIELD .. 22.
    left = FIELD - (tl.arange(0, BLOCK_K) % PER_WORD) * BITS
    up = tl.maximum(left, 0).to(tl.uint32)[None, :]
    down = tl.maximum(-left, 0).to(tl.uint32)[None, :]
    moved = tl.where(left[None, :] >= 0, q << up, q >> down)
    field: tl.constexpr = ((1 << BITS) - 1) << FIELD
    v = ((moved & field) | one_bits).to(tl.float32, bitcast=True)
    sum_vx = tl.sum(v * x, 1)
    sum_x = tl.sum(x, 1)
    group = k0 // GROUP
    scale = tl.load(scales_ptr + n_rows * stride_sn + group).to(tl.float32)
    zero = tl.load(zeros_ptr + n_rows * stride_sn + group).to(tl.float32)
    return scale * ((sum_vx - sum_x) * (1 << BITS) - zero * sum_x)


@triton.jit
def int_matmul_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, out_ptr,
    M, N, k_per_split, stride_xm, stride_qn, stride_sn, stride_om, stride_os,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """``out[m, n] = sum_k x[m, perm[k]] * (q[n, k] - zeros[n, k // GROUP]) *
    scales[n, k // GROUP] (+ bias[n])`` over this program's slice of ``k``.

    ``USE_DOT``: tensor-core tiles of ``BLOCK_M`` (>= 16) rows; else ``BLOCK_M == 1`` and
    the products accumulate lane-wise in float32, summed once at the end. The caller
    guarantees the tiling: ``BLOCK_K`` divides ``GROUP`` and ``k_per_split``,
    so a weight tile lies in one group and no ``k`` is masked. Rows past ``M`` and columns
    past ``N`` read the last valid ones and are never stored. Each dequantized weight is
    ``(q - zero) * scale`` in float32 rounded once to ``x``'s dtype, as the torch
    reference rounds it; products accumulate in float32. ``PARTIAL``: store the float32
    sums at ``out + split * stride_os`` (no bias, no rounding).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_rows = tl.minimum(m, M - 1).to(tl.int64)
    n_rows = tl.minimum(n, N - 1).to(tl.int64)
    x_rows = x_ptr + m_rows[:, None] * stride_xm
    q_rows = qweight_ptr + n_rows[:, None] * stride_qn
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        lanes = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if HAS_PERM:
            columns = tl.load(perm_ptr + k)
        else:
            columns = k
        x = tl.load(x_rows + columns[None, :])
        w = int_weight_tile(q_rows, scales_ptr, zeros_ptr, n_rows, stride_sn, k0, BITS, GROUP,
                            BLOCK_N, BLOCK_K, True, x.dtype)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            lanes += w.to(tl.float32) * x.to(tl.float32)
    if not USE_DOT:
        acc = tl.sum(lanes, 1)[None, :]
    mask = (m < M)[:, None] & (n < N)[None, :]
    if PARTIAL:
        offsets = split.to(tl.int64) * stride_os + m_rows[:, None] * stride_om + n[None, :]
        tl.store(out_ptr + offsets, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_rows).to(tl.float32)[None, :]
        tl.store(out_ptr + m_rows[:, None] * stride_om + n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def int_dequantize_kernel(
    qweight_ptr, scales_ptr, zeros_ptr, out_ptr, N, stride_qn, stride_sn, stride_on,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[n, k] = (q[n, k] - zeros[n, k // GROUP]) * scales[n, k // GROUP]`` for one
    ``BLOCK_N x BLOCK_K`` tile, in float32 rounded once to ``out``'s dtype (the kernel
    above's and the torch reference's rounding). ``BLOCK_K`` divides ``GROUP``."""
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = tl.minimum(n, N - 1).to(tl.int64)
    w = int_weight_tile(qweight_ptr + n_rows[:, None] * stride_qn, scales_ptr, zeros_ptr, n_rows,
                        stride_sn, k0, BITS, GROUP, BLOCK_N, BLOCK_K, False, tl.float32)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + n_rows[:, None] * stride_on + k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(n < N)[:, None])
