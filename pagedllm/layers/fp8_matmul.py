"""FP8 W8A8 products of decode batches on the tensor cores, ``K`` split over programs: a
Triton GEMM of float8_e4m3fn rows (quantized per token, ``pagedllm.quantization.fp8``) by
float8_e4m3fn weights with one float32 scale per output row::

    out[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n]  (+ bias[n])

For the narrow outputs of a decode batch (o_proj and down of Llama-3.1-8B at up to 192
rows: ``quantization.fp8.split_k_product``) cuBLASLt's kernels leave most SMs idle (one
program per 128 x 128 output tile: 32 of them for a 4,096-wide output of 128 rows). Here ``SPLIT`` programs share each output tile, each summing one
slice of ``K``; each stores its float32 sums, and the tile's last program to arrive adds
the slices in slice order (the result does not depend on which came last), scales, adds
the bias and rounds to the output dtype, in the same launch.

Sums accumulate in float32 a ``BLOCK_K`` step at a time: the tensor cores keep about 14 bits
of a sum within one chain of FP8 products, and each step's sum is added to the float32
total, as cuBLAS's FP8 products do without fast accumulation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.layers._triton_ops_kernels import gemm_output_tile, store_scaled_tile
from pagedllm.layers.int8_matmul import row_scaled_output
from pagedllm.layers.launch_math import cdiv
from pagedllm.layers.triton_ops import arrival_counters


class Fp8Tile(NamedTuple):
    """Launch shape of ``fp8_matmul``: ``split`` slices of ``K``, each a whole number of
    ``block_k`` steps; ``swap``: each step multiplies ``b``'s tile by ``a``'s (the
    ``block_n`` weight rows the tensor cores' wide side, ``block_m`` input rows the
    narrow one), for batches of a few rows."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split: int = 1
    swap: bool = False


@triton.jit(do_not_specialize=["M"])
def _fp8_matmul_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, stride_am, stride_bn, stride_om, k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP: tl.constexpr,
):
    """Program ``(p, s)`` sums slice ``s`` (``k_per_split`` inputs) of output tile ``p``: row
    tile ``p % cdiv(M, BLOCK_M)`` of column tile ``p // cdiv(M, BLOCK_M)`` (the row tiles of
    one column tile side by side, so a weight tile is read from memory once). ``SPLIT > 1``:
    the slices' float32 sums go to ``partial [SPLIT, M, N]`` and ``counter[p]`` counts
    arrivals; the last program resets it and finishes the tile."""
    row_tiles = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = pid % row_tiles
    pid_n = pid // row_tiles
    m, n, m_valid, n_valid, a_rows, b_cols = gemm_output_tile(
        pid_m, pid_n, M, N, a_ptr, stride_am, b_ptr, stride_bn, BLOCK_M, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        kk = k0 + k
        k_valid = (kk < K) | EVEN_K  # EVEN_K: BLOCK_K divides K, no step is ragged
        if SWAP:  # each tile loaded in the shape the product takes it (so it is pipelined)
            b = tl.load(tl.trans(b_cols) + kk[None, :],
                        mask=n_valid[:, None] & k_valid[None, :], other=0.0)
            a = tl.load(tl.trans(a_rows) + kk[:, None],
                        mask=k_valid[:, None] & m_valid[None, :], other=0.0)
            acc = tl.dot(b, a, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            a = tl.load(a_rows + kk[None, :], mask=m_valid[:, None] & k_valid[None, :],
                        other=0.0)
            b = tl.load(b_cols + kk[:, None], mask=k_valid[:, None] & n_valid[None, :],
                        other=0.0)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    if SWAP:
        acc = tl.trans(acc)
    valid = m_valid[:, None] & n_valid[None, :]
    if SPLIT > 1:
        slot = partial_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(slot + split * M * N, acc, mask=valid)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.store(counter_ptr + pid, 0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, SPLIT):
                acc += tl.load(slot + s * M * N, mask=valid, other=0.0, cache_modifier=".cg")
            store_scaled_tile(acc, m, n, m_valid, n_valid, a_scale_ptr, b_scale_ptr, bias_ptr,
                              out_ptr, stride_om, HAS_BIAS)
    else:
        store_scaled_tile(acc, m, n, m_valid, n_valid, a_scale_ptr, b_scale_ptr, bias_ptr,
                          out_ptr, stride_om, HAS_BIAS)


# Batches of up to this many rows take the swapped tile.
SWAP_ROWS = 16


def fp8_matmul_tile(rows: int, n: int, k: int) -> Fp8Tile:
    """The tile for ``[rows, k] x [k, n]``: 64 x 64 output tiles of 128-deep steps, 4 warps,
    4 stages, ``K`` in four slices where that keeps the launch within two programs per SM of
    an H200 (132), else in two (each slice at least four steps, else whole). From
    ``scripts/gemv_quant_sweep.py --fp8-gemm-rows`` on an H200, Llama-3.1-8B's o_proj and
    down at 64-176 rows (docs/benchmarks.md, "FP8 products of 129-224 rows"). Up to
    ``SWAP_ROWS`` rows the swapped tile, 64 weight rows by 16 input rows over 256-deep
    steps, ``K`` in two where the tiles alone would not give each SM a program (an H100's
    o_proj and down at 16 rows: 10.4 and 25.9 us against the 64-row tile's 11.3 and 27.5;
    "4-bit steps of 9-64 and 257-512 rows")."""
    if rows <= SWAP_ROWS and k % 256 == 0:
        split = 2 if cdiv(n, 64) * 2 <= 132 and (k // 256) % 2 == 0 else 1
        return Fp8Tile(16, 64, 256, 4, 4, split, swap=True)
    block_m, block_n, block_k = 64, 64, 128
    tiles = cdiv(rows, block_m) * cdiv(n, block_n)
    steps = cdiv(k, block_k)
    split = next((s for s in ((4, 2) if tiles * 4 <= 264 else (2,))
                  if steps % s == 0 and steps // s >= 4), 1)
    return Fp8Tile(block_m, block_n, block_k, 4, 4, split)


def fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype,
               tile: Fp8Tile | None = None) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype`` for float8_e4m3fn ``a [M, K]`` with float32 ``a_scale`` (one
    a row) and float8_e4m3fn ``b [N, K]`` with float32 ``b_scale`` (one a row): the module
    docstring's product, ``tile`` or ``fp8_matmul_tile``'s."""
    out = row_scaled_output("fp8_matmul", torch.float8_e4m3fn, a, a_scale, b, b_scale,
                            out_dtype)
    (rows, k), n = a.shape, b.shape[0]
    if rows == 0:
        return out
    tile = tile or fp8_matmul_tile(rows, n, k)
    steps = cdiv(k, tile.block_k)
    if steps % tile.split:
        raise ValueError(f"tile {tile}: SPLIT must divide the {steps} steps of K={k}.")
    tiles = cdiv(rows, tile.block_m) * cdiv(n, tile.block_n)
    partial = out
    if tile.split > 1:
        partial = torch.empty((tile.split, rows, n), dtype=torch.float32, device=a.device)
    _fp8_matmul_kernel[(tiles, tile.split)](
        a, a_scale.float().contiguous(), b, b_scale.float().contiguous(),
        bias if bias is not None else out, out, partial, arrival_counters(a.device, tiles),
        rows, n, k, a.stride(0), b.stride(0), out.stride(0), steps // tile.split * tile.block_k,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        HAS_BIAS=bias is not None, EVEN_K=k % tile.block_k == 0, SPLIT=tile.split,
        SWAP=tile.swap, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
