"""The grouped GEMM behind ``triton_moe.py`` (imported only when a CUDA tensor needs it).

One launch multiplies every expert's rows: a program owns row block ``m``, ``BLOCK_M``
slots of the expert-sorted list (all routed to the one expert ``block_expert[m]``; a
negative id marks a block past the end, which does nothing), and column block ``n``,
``BLOCK_N`` output columns. The grid is one-dimensional, ``num_blocks * cdiv(N, BLOCK_N)``
programs taken in groups of ``GROUP_M`` row blocks: within a group the row block varies
fastest, then the column block, so programs running together share an expert's weight
columns and the group's activation rows in L2. A slot is a flat ``token * top_k + choice``
index; pad slots (``>= num_slots``) are masked. Rows of ``a`` are read at
``slot // A_DIV`` and results written at row ``slot`` of ``c``. Offsets are computed in
int64; accumulation is float32.

With ``W8A8`` "fp8" the operands are float8_e4m3fn, with "int8" int8 (their products
summed in int32, exact, within a ``BLOCK_K`` step): ``a``'s rows with float32 scales
``a_scale[row, g]`` and the experts' weights with ``b_scale[e, n // group_n, g]``, one per
group ``g`` of ``group_k`` inputs (per channel: ``group_n`` 1, ``group_k`` the whole K).
Each ``BLOCK_K`` step lies in one group (``BLOCK_K`` divides ``group_k``, or there is one
group) and its product is scaled by its row's and its column's scales before it is added.

With ``INT_BITS`` (4 or 8) the experts' weights are packed integers (``int_weights``'
stored layout, ``[E, N, K / (32 / INT_BITS)]`` int32) with scales in ``b_scale`` and zero
points in ``b_zero`` (``[E, N, groups]``, one stride), dequantized tile by tile in
registers (``_int_matmul_kernels.int_weight_tile``: rounded once to the activation dtype,
the reference's weights) and multiplied with the unquantized rows; ``BLOCK_K`` divides K
and ``INT_GROUP``, so no input is masked. ``HAS_PERM``: act-order experts read input
column ``perm[e, k]`` for stored column ``k``. With ``codebook_ptr`` (bitsandbytes' 16
values; None otherwise) each weight is ``codebook[q] * scale`` and ``b_zero`` is not read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.layers._int_matmul_kernels import int_weight_tile


# Slot and block counts change with every batch size: not specialised on, so one compiled
# kernel serves every batch.
@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_slots_ptr, block_expert_ptr,
    a_scale_ptr, b_scale_ptr, b_zero_ptr, perm_ptr, codebook_ptr,
    num_slots, num_blocks, N, K, group_n, group_k,
    stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn,
    stride_pe,
    A_DIV: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    DOT_F32: tl.constexpr,
    W8A8: tl.constexpr,
    INT_BITS: tl.constexpr,
    INT_GROUP: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``c[slot, n] = (a[slot // A_DIV] @ b[e, n]^T)``; with ``GATED`` b holds ``2N`` rows
    and ``c = silu(gate) * up`` of its halves; with ``WEIGHTED`` each row is multiplied by
    ``weights[slot]``. ``DOT_F32``: products of float32 operands at full precision (no
    TF32), for float32 models and under the interpreter (whose bfloat16 dot is wrong)."""
    pid = tl.program_id(0)
    programs_per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // programs_per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % programs_per_group) % group_rows
    pid_n = (pid % programs_per_group) // group_rows
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(sorted_slots_ptr + offs_m).to(tl.int64)
        row_ok = slots < num_slots
        a_rows = tl.where(row_ok, slots // A_DIV, 0)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        n_ok = offs_n < N
        b_base = b_ptr + expert * stride_be
        a_scales = a_scale_ptr + a_rows * stride_asm
        b_scales = b_scale_ptr + expert * stride_bse + (offs_n // group_n) * stride_bsn
        b_scales_up = b_scale_ptr + expert * stride_bse + ((offs_n + N) // group_n) * stride_bsn
        if INT_BITS > 0:  # packed rows; columns past N read the last row, never stored
            n_rows = tl.minimum(offs_n, N - 1)
            q_rows = b_base + n_rows[:, None] * stride_bn
            q_rows_up = q_rows + N * stride_bn
            int_scales = b_scale_ptr + expert * stride_bse
            int_zeros = b_zero_ptr + expert * stride_bse
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            if HAS_PERM:
                columns = tl.load(perm_ptr + expert * stride_pe + offs_k)
            else:
                columns = offs_k
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + columns[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b_mask = k_ok[:, None] & n_ok[None, :]
            if INT_BITS > 0:
                b = tl.trans(int_weight_tile(q_rows, int_scales, int_zeros, n_rows, stride_bsn,
                                             k0, INT_BITS, INT_GROUP, BLOCK_N, BLOCK_K, True,
                                             a_ptr.dtype.element_ty, codebook_ptr))
            else:
                b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_k[:, None],
                            mask=b_mask, other=0.0)
            if DOT_F32:
                a = a.to(tl.float32)
                part = tl.dot(a, b.to(tl.float32), input_precision="ieee")
            elif W8A8 == "int8":
                part = tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
            else:
                part = tl.dot(a, b)
            if W8A8 != "":
                group = k0 // group_k
                a_s = tl.load(a_scales + group, mask=row_ok, other=0.0)[:, None]
                part = part * a_s * tl.load(b_scales + group, mask=n_ok, other=0.0)[None, :]
            acc += part
            if GATED:
                if INT_BITS > 0:
                    b_up = tl.trans(int_weight_tile(q_rows_up, int_scales, int_zeros,
                                                    n_rows + N, stride_bsn, k0, INT_BITS,
                                                    INT_GROUP, BLOCK_N, BLOCK_K, True,
                                                    a_ptr.dtype.element_ty, codebook_ptr))
                else:
                    b_up = tl.load(b_base + (offs_n[None, :] + N) * stride_bn + offs_k[:, None],
                                   mask=b_mask, other=0.0)
                if DOT_F32:
                    part = tl.dot(a, b_up.to(tl.float32), input_precision="ieee")
                elif W8A8 == "int8":
                    part = tl.dot(a, b_up, out_dtype=tl.int32).to(tl.float32)
                else:
                    part = tl.dot(a, b_up)
                if W8A8 != "":
                    part = part * a_s * tl.load(b_scales_up + group, mask=n_ok,
                                                other=0.0)[None, :]
                acc_up += part
        if GATED:
            # Gate and up rounded to the activation dtype first, as the torch path does.
            gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
            up = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
            silu = (gate * tl.sigmoid(gate)).to(c_ptr.dtype.element_ty).to(tl.float32)
            acc = silu * up
        if WEIGHTED:
            weight = tl.load(weights_ptr + slots, mask=row_ok, other=0.0)
            acc = acc * weight[:, None]
        tl.store(c_ptr + slots[:, None] * stride_cm + offs_n[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
