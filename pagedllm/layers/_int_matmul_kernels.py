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

import os

import triton
import triton.language as tl

from pagedllm.layers.launch_math import cdiv  # noqa: F401 - host helper for launches

# Paired half-precision arithmetic is PTX (inline assembly), which the interpreter cannot
# run: under TRITON_INTERPRET weight tiles take the float32 path, which gives the same
# weights bit for bit.
PAIRED_HALVES = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


# Two 4-bit weights in bfloat16 or float16 (``paired_weight_tile``): $2 the shifted word,
# $3 the pair B + zero, $4 the pair of scales; B's bits are the lop3's last constant.
_PAIR_ASM_BF16 = tl.constexpr(
    "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA; "
    "sub.rn.bf16x2 t, t, $3; mul.rn.bf16x2 t, t, $4; mov.b32 {$0, $1}, t; }")
_PAIR_ASM_F16 = tl.constexpr(
    "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA; "
    "sub.rn.f16x2 t, t, $3; mul.rn.f16x2 t, t, $4; mov.b32 {$0, $1}, t; }")


@triton.jit
def slot_shift(column, BITS: tl.constexpr):
    """The bit offset of the value of ``column`` (within its word's run) in a stored word:
    4-bit words keep values ``2p`` and ``2p + 1`` in slots ``p`` and ``p + 4``
    (``int_weights.stored_slots``), 8-bit words keep their values in order."""
    if BITS == 4:
        return ((column // 2) + 4 * (column % 2)) * 4
    else:
        return column * BITS


@triton.jit
def paired_weight_tile(q, scale, zero, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       dtype: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` 4-bit weights ``(q - zero) * scale`` in ``dtype``
    (bfloat16 or float16, as ``scale``) from the packed words ``q`` (``[BLOCK_N, BLOCK_K /
    8]``), two weights per instruction: a word shifted by ``4p`` holds values ``2p`` and
    ``2p + 1`` in bits 0-3 and 16-19 (the stored slots); one ``lop3`` makes them the
    half-precision numbers ``B + q`` (``B`` = 128 in bfloat16, 1024 in float16, whose
    last mantissa bits are 0), one paired subtraction of ``B + zero`` leaves ``q - zero``
    (exact), one paired multiplication rounds ``(q - zero) * scale`` once: the float32
    path's weights exactly."""
    q = q.to(tl.uint32, bitcast=True)
    q = tl.interleave(q, q)
    q = tl.interleave(q, q)  # [BLOCK_N, BLOCK_K / 2]: copy p of each word at 4j + p
    pairs = q >> ((tl.arange(0, BLOCK_K // 2) % 4) * 4).to(tl.uint32)[None, :]
    scale_bits = scale.to(tl.uint16, bitcast=True).to(tl.uint32)
    BF16: tl.constexpr = dtype == tl.bfloat16
    BASE: tl.constexpr = 0x4300 if BF16 else 0x6400  # the bits of B
    base_zero = BASE | zero.to(tl.uint32)  # the bits of B + zero
    base_zeros = ((base_zero << 16) | base_zero)[:, None]
    scales = ((scale_bits << 16) | scale_bits)[:, None]
    low, high = tl.inline_asm_elementwise(
        _PAIR_ASM_BF16 if BF16 else _PAIR_ASM_F16, "=h,=h,r,r,r", [pairs, base_zeros, scales],
        dtype=(dtype.value, dtype.value), is_pure=True, pack=1)
    return tl.interleave(low, high)


@triton.jit
def int_weight_tile(q_rows, scales_ptr, zeros_ptr, n_rows, stride_sn, k0,
                    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, ROUND: tl.constexpr, dtype: tl.constexpr,
                    codebook_ptr=None):
    """The ``[BLOCK_N, BLOCK_K]`` weights ``(q - zero) * scale`` of inputs ``k0`` onwards
    (one group: ``BLOCK_K`` divides ``GROUP``) from the packed rows at ``q_rows``: float32,
    or rounded once to ``dtype`` with ``ROUND``. With ``codebook_ptr`` (the 16 float32
    values of a 4-bit codebook; ``zeros_ptr`` is not read) each weight is
    ``codebook[q] * scale``, the float32 product rounded once. Each packed word is loaded once, then
    repeated in registers once per value it holds (``tl.interleave``, which keeps the
    copies in the thread that loaded it: no exchange between threads; twice as fast on an
    H200 as unpacking into a third dimension and reshaping), and each copy shifted to its
    value's slot, in ``k`` order. Tiles of 16 inputs unpack through the reshape: the
    interleaved form gave wrong products there on an H200 (Triton 3.6), though right
    under the interpreter. Rounded 4-bit tiles of 32 inputs or more in bfloat16 or
    float16 (scales in the same dtype) are made two weights at a time
    (``paired_weight_tile``), on the GPU."""
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    DOUBLINGS: tl.constexpr = 3 if BITS == 4 else 2  # log2(PER_WORD): 4 or 8 bits
    word = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    q = tl.load(q_rows + word[None, :])
    group = k0 // GROUP
    scale = tl.load(scales_ptr + n_rows * stride_sn + group)
    if codebook_ptr is None:
        zero = tl.load(zeros_ptr + n_rows * stride_sn + group)
        PAIRED: tl.constexpr = (PAIRED_HALVES and ROUND and BITS == 4 and BLOCK_K >= 32
                                and (dtype == tl.bfloat16 or dtype == tl.float16)
                                and scales_ptr.dtype.element_ty == dtype)
        if PAIRED:
            return paired_weight_tile(q, scale, zero, BLOCK_N, BLOCK_K, dtype)
    if BLOCK_K >= 32:
        for _ in tl.static_range(DOUBLINGS):
            q = tl.interleave(q, q)
        shifts = slot_shift(tl.arange(0, BLOCK_K) % PER_WORD, BITS)
        q = (q >> shifts[None, :]) & MASK
    else:
        shifts = slot_shift(tl.arange(0, PER_WORD), BITS)
        q = tl.reshape((q[:, :, None] >> shifts[None, None, :]) & MASK, [BLOCK_N, BLOCK_K])
    if codebook_ptr is None:
        # The bits of 2^23 + q as a float32: exact, and cheaper than an int-to-float
        # conversion.
        numbers = ((q | 0x4B000000).to(tl.float32, bitcast=True)
                   - (zero.to(tl.float32) + 8388608.0)[:, None])
    else:
        numbers = tl.load(codebook_ptr + q)
    w = numbers * scale.to(tl.float32)[:, None]
    if ROUND:
        w = w.to(dtype)
    return w


@triton.jit
def int_row_tile(q_rows, scales_ptr, zeros_ptr, n_rows, stride_sn, k0, BITS: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """What ``int_row_products`` multiplies for inputs ``k0 .. k0 + BLOCK_K`` (one group)
    of the rows at ``q_rows``: their packed words (``[BLOCK_N, BLOCK_K * BITS / 32]``
    uint32) and their group's scales and zero points (``[BLOCK_N]``, as stored)."""
    PER_WORD: tl.constexpr = 32 // BITS
    word = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    q = tl.load(q_rows + word[None, :]).to(tl.uint32, bitcast=True)
    group = k0 // GROUP
    scale = tl.load(scales_ptr + n_rows * stride_sn + group)
    zero = tl.load(zeros_ptr + n_rows * stride_sn + group)
    return q, scale, zero


@triton.jit
def int_row_products(q, scale, zero, x, one_bits, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``sum_k (q[n, k] - zero[n]) * scale[n] * x[k]`` over one tile of ``BLOCK_K`` inputs
    (one group) for one row ``x`` (``[1, BLOCK_K]``, float32): ``[BLOCK_N]`` float32, from
    the tile's packed words, scales and zero points (``int_row_tile``).

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
    for _ in tl.static_range(DOUBLINGS):
        q = tl.interleave(q, q)
    # One shift per copy (left or right: a constant for each register) brings the value
    # at bits BITS * j to bits FIELD .. 22.
    left = FIELD - slot_shift(tl.arange(0, BLOCK_K) % PER_WORD, BITS)
    up = tl.maximum(left, 0).to(tl.uint32)[None, :]
    down = tl.maximum(-left, 0).to(tl.uint32)[None, :]
    moved = tl.where(left[None, :] >= 0, q << up, q >> down)
    field: tl.constexpr = ((1 << BITS) - 1) << FIELD
    v = ((moved & field) | one_bits).to(tl.float32, bitcast=True)
    sum_vx = tl.sum(v * x, 1)
    sum_x = tl.sum(x, 1)
    return scale.to(tl.float32) * ((sum_vx - sum_x) * (1 << BITS) - zero.to(tl.float32) * sum_x)


@triton.jit
def int_matmul_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, codebook_ptr, out_ptr,
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
    scales[n, k // GROUP] (+ bias[n])`` over this program's slice of ``k``
    (``codebook[q[n, k]]`` for ``q - zero`` with a ``codebook_ptr``, None otherwise).

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
                            BLOCK_N, BLOCK_K, True, x.dtype, codebook_ptr)
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
    qweight_ptr, scales_ptr, zeros_ptr, codebook_ptr, out_ptr, N, stride_qn, stride_sn,
    stride_on,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[n, k] = (q[n, k] - zeros[n, k // GROUP]) * scales[n, k // GROUP]`` for one
    ``BLOCK_N x BLOCK_K`` tile, in float32 rounded once to ``out``'s dtype (the kernel
    above's and the torch reference's rounding; ``codebook[q]`` for ``q - zero`` with a
    ``codebook_ptr``). ``BLOCK_K`` divides ``GROUP``."""
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = tl.minimum(n, N - 1).to(tl.int64)
    w = int_weight_tile(qweight_ptr + n_rows[:, None] * stride_qn, scales_ptr, zeros_ptr, n_rows,
                        stride_sn, k0, BITS, GROUP, BLOCK_N, BLOCK_K, True,
                        out_ptr.dtype.element_ty, codebook_ptr)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + n_rows[:, None] * stride_on + k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(n < N)[:, None])
