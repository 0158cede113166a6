"""INT8 W8A8 products of many rows on the tensor cores: a Triton GEMM of int8 rows (quantized
per token, ``pagedllm.quantization.int8``) by int8 weights with one float32 scale per output
row. Each tile's sums are exact int32; the epilogue scales them once in float32 and rounds
to the output dtype::

    out[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n]  (+ bias[n])

the values of ``torch._int_mm`` followed by the same scaling. Programs that share a weight
tile run next to each other (the row tiles of one column tile), so a decode batch of
several row tiles reads each weight once from memory.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.layers._triton_ops_kernels import gemm_output_tile, store_scaled_tile
from pagedllm.layers.launch_math import cdiv


class Int8Tile(NamedTuple):
    """Launch shape of ``int8_matmul``."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit(do_not_specialize=["M"])
def _int8_matmul_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, out_ptr,
    M, N, K, stride_am, stride_bn, stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Program ``p`` owns row tile ``p % cdiv(M, BLOCK_M)`` of column tile
    ``p // cdiv(M, BLOCK_M)``; ``a_scale`` and ``b_scale`` hold one float32 a row."""
    row_tiles = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % row_tiles
    pid_n = pid // row_tiles
    m, n, m_valid, n_valid, a_rows, b_cols = gemm_output_tile(
        pid_m, pid_n, M, N, a_ptr, stride_am, b_ptr, stride_bn, BLOCK_M, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_valid = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0)
        b = tl.load(b_cols + kk[:, None], mask=k_valid[:, None] & n_valid[None, :], other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
    store_scaled_tile(acc.to(tl.float32), m, n, m_valid, n_valid, a_scale_ptr, b_scale_ptr,
                      bias_ptr, out_ptr, stride_om, HAS_BIAS)


def int8_matmul_tile(rows: int, n: int, k: int) -> Int8Tile:
    """The tile for ``[rows, k] x [k, n]``, from ``scripts/gemv_quant_sweep.py
    --int8-gemm-rows 64,256`` on an H200 (Llama-3.1-8B's projections, docs/benchmarks.md):
    wide outputs (gate/up) 64 x 128 up to 64 rows, else 128 x 256 (256 rows: 71.3 us, bf16
    90.3); a long K (down) 64 x 128 x 256 (52.8, bf16 47.4); the rest 128 x 64 (qkv 20.3,
    bf16 22.1; o_proj 17.2, bf16 16.6)."""
    if n >= 16384:
        return Int8Tile(64, 128, 128, 4, 4) if rows <= 64 else Int8Tile(128, 256, 128, 8, 3)
    if k > 8192:
        return Int8Tile(64, 128, 256, 4, 3)
    return Int8Tile(128, 64, 128, 4, 4)


def row_scaled_output(op: str, dtype: torch.dtype, a: torch.Tensor, a_scale: torch.Tensor,
                      b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
                      ) -> torch.Tensor:
    """The empty ``[M, N]`` output, in ``out_dtype``, of a W8A8 GEMM (``op`` names the one
    asked) of ``a [M, K]`` by ``b [N, K]``; ValueError unless both are ``dtype``,
    contiguous along ``K``, with one scale a row each."""
    if a.dtype != dtype or b.dtype != dtype:
        raise ValueError(f"{op} takes {dtype} operands, got {a.dtype} and {b.dtype}.")
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"{op}: a and b must be contiguous along K.")
    if a_scale.numel() != a.shape[0] or b_scale.numel() != b.shape[0]:
        raise ValueError(f"{op} takes one scale a row: {a_scale.numel()} for "
                         f"{a.shape[0]} rows of a, {b_scale.numel()} for {b.shape[0]} of b.")
    return torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)


def int8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                b_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                tile: Int8Tile | None = None) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype`` for int8 ``a [M, K]`` with float32 ``a_scale`` (one a
    row) and int8 ``b [N, K]`` with float32 ``b_scale`` (one a row): the module
    docstring's product, ``tile`` or ``int8_matmul_tile``'s."""
    out = row_scaled_output("int8_matmul", torch.int8, a, a_scale, b, b_scale, out_dtype)
    (rows, k), n = a.shape, b.shape[0]
    if rows == 0:
        return out
    tile = tile or int8_matmul_tile(rows, n, k)
    grid = (cdiv(rows, tile.block_m) * cdiv(n, tile.block_n),)
    _int8_matmul_kernel[grid](
        a, a_scale.float().contiguous(), b, b_scale.float().contiguous(),
        bias if bias is not None else out, out, rows, n, k, a.stride(0), b.stride(0),
        out.stride(0), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        HAS_BIAS=bias is not None, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
