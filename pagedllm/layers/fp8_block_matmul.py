"""The product of block-wise FP8 weights with inputs quantized per token and group: Triton
kernels on GPUs with FP8 tensor cores (compute capability 8.9 and up), one that quantizes
the inputs (``quantize_groups_fp8``, the bytes of ``quantization.fp8.quantize_groups``)
and one that multiplies (``block_fp8_matmul``).

Operands, as ``pagedllm.quantization.fp8.fp8_block_linear`` prepares them::

    a        [M, K] float8_e4m3fn     a_scale [M, cdiv(K, GROUP_K)] float32
    b        [N, K] float8_e4m3fn     b_scale [cdiv(N, GROUP_N), cdiv(K, GROUP_K)] float32
    out[m, n] = sum_g a_scale[m, g] * b_scale[n // GROUP_N, g]
                      * sum_{k in group g} a[m, k] * b[n, k]      (+ bias[n])

Each program owns a ``BLOCK_M x BLOCK_N`` output tile and walks ``K`` one scale group
(``BLOCK_K = GROUP_K`` columns) a step: the group's FP8 product on the tensor cores in
float32, scaled by the rows' and the columns' scales, added to the float32 sum. A column
tile may straddle weight blocks (each column reads its own block's scale). Decode batches
(up to ``SPLIT_ROWS`` rows) have too few output tiles to keep every SM reading weights, so
their groups are split into ``SPLIT`` slices: each program writes its slice's float32
partial sums, added in slice order afterwards (the result does not depend on timing). The
tiles (``block_fp8_tile``) follow the row count and the SM count, not yet tuned on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers._triton_ops_kernels import fp8_row_scale, gemm_output_tile, to_fp8
from pagedllm.layers.launch_math import cdiv, next_power_of_2
from pagedllm.layers.triton_ops import _sm_count, sum_split_partials

# Products of at most this many rows split K (decode batches).
SPLIT_ROWS = 16


@triton.jit
def _quantize_groups_kernel(x_ptr, out_ptr, scale_ptr, K, stride_xm, GROUPS,
                            GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Group ``program_id(1)`` of row ``program_id(0)``: its float32 scale (largest
    magnitude / 448) into ``scale[row, group]`` (rows of ``GROUPS``) and its values in
    float8_e4m3fn into ``out`` (contiguous rows of ``K``)."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    k = group * GROUP + i
    valid = (i < GROUP) & (k < K)
    x = tl.load(x_ptr + row * stride_xm + k, mask=valid, other=0.0).to(tl.float32)
    scale = fp8_row_scale(tl.max(tl.abs(x), 0), scale_ptr, False)
    tl.store(out_ptr + row * K + k, to_fp8(x, scale), mask=valid)
    tl.store(scale_ptr + row * GROUPS + group, scale)


def quantize_groups_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantization.fp8.quantize_groups`` in one launch: ``x [M, K]`` -> (float8_e4m3fn
    ``[M, K]``, float32 scales ``[M, cdiv(K, group)]``), the same values."""
    rows, cols = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    groups = cdiv(cols, group)
    out = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows:
        block = next_power_of_2(group)
        _quantize_groups_kernel[(rows, groups)](x, out, scale, cols, x.stride(0), groups,
                                                GROUP=group, BLOCK=block,
                                                num_warps=4 if block >= 512 else 1)
    return out, scale


@triton.jit(do_not_specialize=["M"])
def _block_fp8_matmul_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, bias_ptr,
    M, N, K, groups_per_split,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_om,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    """Output tile ``(program_id(0), program_id(1))`` over scale groups
    ``[program_id(2) * groups_per_split, ...)``; with ``PARTIAL`` its float32 sums go to
    slice ``program_id(2)`` of ``out`` (``[SPLIT, M, N]``, no bias), else the tile itself
    (with the bias, in ``out``'s dtype)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    m, n, m_valid, n_valid, a_rows, b_cols = gemm_output_tile(
        pid_m, pid_n, M, N, a_ptr, stride_am, b_ptr, stride_bn, BLOCK_M, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    a_scales = a_scale_ptr + m.to(tl.int64) * stride_asm
    b_scales = b_scale_ptr + (n // GROUP_N).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = split * groups_per_split
    for g in range(first, tl.minimum(first + groups_per_split, tl.cdiv(K, BLOCK_K))):
        kk = g * BLOCK_K + k
        k_valid = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_cols + kk[:, None], mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        a_s = tl.load(a_scales + g, mask=m_valid, other=0.0)
        b_s = tl.load(b_scales + g, mask=n_valid, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    if PARTIAL:
        out_ptr += split.to(tl.int64) * M * N
    out = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


def block_fp8_tile(rows: int, n: int, groups: int, sm_count: int
                   ) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, SPLIT, num_warps, num_stages)`` for ``rows x n`` outputs over
    ``groups`` scale groups: the smallest row tile of 16 to 128 that holds the rows, 128
    columns; decode batches (``SPLIT_ROWS`` rows or fewer) take 64 columns and split the
    groups until the tiles times the slices reach about two programs per SM, keeping at
    least two groups a slice."""
    block_m = min(128, max(16, next_power_of_2(rows)))
    if rows > SPLIT_ROWS:
        return block_m, 128, 1, 8 if block_m == 128 else 4, 3
    tiles = cdiv(n, 64)
    split = max(1, min(cdiv(2 * sm_count, tiles), groups // 2))
    return block_m, 64, split, 4, 4


def block_fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                     b_scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype``: the scaled product of the module docstring, with
    ``block = (GROUP_N, GROUP_K)`` the weight's block; ``GROUP_K`` must be a power of two
    of at least 32 (one ``tl.dot`` step per scale group; an FP8 dot sums 32 inputs at
    least)."""
    group_n, group_k = block
    if group_k < 32 or group_k & (group_k - 1):
        raise ValueError(f"block-wise FP8 on the GPU needs a block width that is a power of "
                         f"two of at least 32, got {group_k}.")
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("block_fp8_matmul: a and b must be contiguous along K.")
    rows, k = a.shape
    n = b.shape[0]
    if rows == 0:
        return torch.empty(rows, n, dtype=out_dtype, device=a.device)
    groups = cdiv(k, group_k)
    block_m, block_n, split, num_warps, num_stages = block_fp8_tile(
        rows, n, groups, _sm_count(a.device))
    groups_per_split = cdiv(groups, split)
    split = cdiv(groups, groups_per_split)  # no slice without a group
    partial = split > 1
    out = torch.empty((split, rows, n) if partial else (rows, n),
                      dtype=torch.float32 if partial else out_dtype, device=a.device)
    _block_fp8_matmul_kernel[(cdiv(rows, block_m), cdiv(n, block_n), split)](
        a, a_scale, b, b_scale, out, bias if bias is not None and not partial else out,
        rows, n, k, groups_per_split,
        a.stride(0), a_scale.stride(0), b.stride(0), b_scale.stride(0), n,
        GROUP_N=group_n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=group_k,
        HAS_BIAS=bias is not None and not partial, PARTIAL=partial,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not partial:
        return out
    return sum_split_partials(out, bias, out_dtype)
