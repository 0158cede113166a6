"""Products with integer weights (W4A16, W8A16; the stored layout of
``pagedllm.quantization.int_weights``): a Triton kernel on CUDA, the torch reference
elsewhere.

``int_linear`` sends a CUDA half-precision input whose projection's shape tiles
(``int_matmul_config``) to a kernel, and everything else to the reference, which
dequantizes the whole weight and multiplies (exact, and the fallback for shapes that do
not tile). By the step's rows:

* on a Hopper GPU, 4-bit weights with zero points, every step of up to
  ``WGMMA_MAX_ROWS`` rows (decode batches, short prompts): ``int4_wgmma``, a Gluon kernel
  whose weight tiles, made in registers, are ``wgmma``'s register operand while the
  previous tile's product runs, ``K`` split for the smaller batches (``_int_wgmma_kernel``;
  ``wgmma_config``);
* elsewhere, decode batches of up to ``gemv_max_rows`` rows: the small-batch product of
  ``triton_ops`` (the layers call it, with the SiLU and the norm riding on it);
* elsewhere, up to 16 rows: ``int_matmul`` with 16-row tiles and ``K`` split into
  ``SPLIT`` slices (split-K), so a narrow output still spreads over every SM; the float32
  partial sums are added in a fixed order (the result does not depend on timing);
* elsewhere, 17 to 64 rows, and 65 to ``DEQUANTIZE_ROWS`` rows of a wide output
  (``WIDE_OUTPUT`` columns or more: an MLP's gate/up): ``int_matmul`` with 64- or 128-row
  output tiles, the weight dequantized in registers as it streams in, ``K`` split when
  the output tiles alone would leave SMs idle;
* more rows (prompts, and elsewhere the larger decode batches; ``dequantizes``):
  ``int_dequantize`` writes the weight in the activation dtype once, and BLAS multiplies.

Codebook weights (bitsandbytes' NF4 and FP4: ``codebook[q] * scale``, no zero points) take
the same kernels, with the codebook's 16 values read in place of ``q - zero``, except the
small-batch product (its lane-wise sums need ``q - zero``): their small batches take
``int_matmul``'s split-K tiles.

Act-order weights carry ``perm``: the kernel reads input column ``perm[k]`` for stored
column ``k`` (the activation is gathered in the kernel; the weight never is).
``PAGEDLLM_INT_TILE="BLOCK_M,BLOCK_N,BLOCK_K,SPLIT,num_warps,num_stages"`` overrides the
tiles (when they tile the shape), to measure candidates on whole workloads.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

from pagedllm.layers.triton_ops import _sm_count, is_hopper, sum_split_partials, use_fused_ops
from pagedllm.quantization.int_weights import int_linear_reference
from pagedllm.switches import switch

INT_TILE_ENV = "PAGEDLLM_INT_TILE"
# Batches of at most this many rows take the split-K tiles.
SMALL_BATCH_ROWS = 16
# Steps of more rows (and of more than 64 rows into a narrower output) dequantize the
# weight once (a kernel) and multiply with BLAS: ``int_matmul`` re-reads and
# re-dequantizes each weight tile for every block of rows, which from there costs more
# than one pass that writes the weight in the model's dtype (``scripts/gemv_quant_sweep.py
# --int-gemm-rows`` on an H200, Llama-3.1-8B; docs/benchmarks.md).
DEQUANTIZE_ROWS = 128
WIDE_OUTPUT = 16384
_BLOCK_KS = (128, 64, 32, 16)


@dataclass(frozen=True)
class IntTile:
    """Launch shape of ``int_matmul``: output tiles of ``block_m x block_n``, ``block_k``
    inputs per step, ``split`` slices of ``K`` (1: no split-K). ``block_m`` 1: one row,
    lane-wise products with no tensor cores (else at least 16)."""

    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int
    num_stages: int


def dequantizes(rows: int, n: int) -> bool:
    """Whether a step of ``rows`` rows into ``n`` outputs dequantizes the weight once and
    multiplies with BLAS (else ``int_matmul`` or the small-batch kernel)."""
    return rows > DEQUANTIZE_ROWS or (rows > 64 and n < WIDE_OUTPUT)


@functools.cache
def int_matmul_config(rows: int, n: int, k: int, group_size: int,
                      sm_count: int = 132) -> IntTile | None:
    """The tile for ``rows x k @ k x n`` with groups of ``group_size`` (-1: per channel),
    or None when the shape does not tile: ``BLOCK_K`` (16 to 128) must divide both ``k``
    and the group size. Small batches split ``K`` until the output tiles times the slices
    reach about two programs per SM."""
    group = k if group_size == -1 else group_size
    override = os.environ.get(INT_TILE_ENV, "").strip()
    if override:
        tile = _parse_tile(override)
        if k % tile.block_k or group % tile.block_k or (k // tile.block_k) % tile.split:
            return None
        return tile
    if rows <= SMALL_BATCH_ROWS:
        block_k = next((b for b in _BLOCK_KS[1:] if k % b == 0 and group % b == 0), None)
        if block_k is None:
            return None
        block_n = 128
        steps = k // block_k
        wanted = max(1, (2 * sm_count) // -(-n // block_n))
        split = max(s for s in range(1, min(wanted, steps) + 1) if steps % s == 0)
        return IntTile(16, block_n, block_k, split, num_warps=4, num_stages=4)
    # Larger batches (``scripts/gemv_quant_sweep.py --int-gemm-rows`` on an H200, Llama-3.1-8B
    # in groups of 128): 64 x 64 tiles over 128-input steps (qkv at 64 rows 40.5 us against
    # 74.8 for 64 x 128 x 64), the wide gate/up 64 x 128, and 128 x 128 with 8 warps from
    # 65 rows on (223.6 against 254.5 at 256 rows); K split while the output tiles alone
    # give fewer than two programs per SM (down: 64 tiles at 64 rows).
    block_k = next((b for b in _BLOCK_KS if k % b == 0 and group % b == 0), None)
    if block_k is None:
        return None
    if n >= WIDE_OUTPUT and rows > 64:
        block_k = 64 if block_k == 128 else block_k
        tile = IntTile(128, 128, block_k, 1, num_warps=8, num_stages=4)
    elif n >= WIDE_OUTPUT:
        tile = IntTile(64, 128, block_k, 1, num_warps=4, num_stages=3)
    else:
        tile = IntTile(64, 64, block_k, 1, num_warps=4, num_stages=4 if rows <= 64 else 3)
    steps = k // tile.block_k
    programs = -(-rows // tile.block_m) * -(-n // tile.block_n)
    wanted = max(1, (2 * sm_count) // programs)
    split = max(s for s in range(1, min(wanted, steps) + 1)
                if steps % s == 0 and (s == 1 or steps >= 4 * s))  # K of under 4 steps: whole
    return replace(tile, split=split)


def _parse_tile(value: str) -> IntTile:
    try:
        fields = [int(v) for v in value.split(",")]
        tile = IntTile(*fields)
    except (TypeError, ValueError):
        raise ValueError(f"{INT_TILE_ENV}={value!r}: give BLOCK_M,BLOCK_N,BLOCK_K,SPLIT,"
                         "num_warps,num_stages (e.g. 16,64,128,4,4,3).") from None
    if (min(tile.block_n, tile.block_k) < 16 or tile.block_m not in (1, 16, 32, 64, 128)
            or tile.split < 1):
        raise ValueError(f"{INT_TILE_ENV}={value!r}: BLOCK_M is 1 or 16 to 128, the other "
                         "blocks powers of two >= 16, and SPLIT >= 1.")
    return tile


def int_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, tile: IntTile, *, bits: int, group_size: int,
               bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
               codebook: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias) -> [M, N]`` in ``x``'s dtype with ``W`` in the stored
    layout (``qweight [N, K / (32 / bits)]``, ``scales``, ``zeros [N, groups]``, or a
    ``codebook`` and no zeros), on the kernel with ``tile`` (from ``int_matmul_config``; it
    must tile the shape)."""
    from pagedllm.layers import _int_matmul_kernels as kernels

    rows, in_features = x.shape
    out_features = qweight.shape[0]
    group = in_features if group_size == -1 else group_size
    if in_features % tile.block_k or group % tile.block_k or (
            (in_features // tile.block_k) % tile.split):
        raise ValueError(f"tile {tile} does not tile K={in_features} in groups of {group}.")
    if tile.block_m == 1 and rows > 1:
        raise ValueError(f"tile {tile}: the lane-wise tile (block_m 1) serves one row.")
    if x.stride(-1) != 1:
        x = x.contiguous()
    zeros = _zeros_or_scales(scales, zeros, codebook)
    if scales.stride() != zeros.stride() or scales.stride(-1) != 1 or qweight.stride(-1) != 1:
        raise ValueError("scales and zeros must be contiguous [N, groups] tensors of one "
                         "shape, qweight row-major.")
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    partial = tile.split > 1
    target = (torch.empty((tile.split, rows, out_features), dtype=torch.float32,
                          device=x.device) if partial else out)
    grid = (kernels.cdiv(rows, tile.block_m), kernels.cdiv(out_features, tile.block_n),
            tile.split)
    kernels.int_matmul_kernel[grid](
        x, qweight, scales, zeros, perm if perm is not None else qweight,
        bias if bias is not None else scales, codebook, target,
        rows, out_features, in_features // tile.split,
        x.stride(0), qweight.stride(0), scales.stride(0), target.stride(-2),
        target.stride(0) if partial else 0,
        BITS=bits, GROUP=group, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        PARTIAL=partial, USE_DOT=tile.block_m > 1, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    if not partial:
        return out
    return sum_split_partials(target, bias, x.dtype)


def _zeros_or_scales(scales: torch.Tensor, zeros: torch.Tensor | None,
                     codebook: torch.Tensor | None) -> torch.Tensor:
    """The zero points a kernel is given: ``scales`` in their place for a codebook (the
    kernels read none then)."""
    if (zeros is None) != (codebook is not None):
        raise ValueError("integer weights take zero points or a codebook, one of the two.")
    return scales if zeros is None else zeros


def int_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, *,
                   bits: int, group_size: int, in_features: int,
                   dtype: torch.dtype, codebook: torch.Tensor | None = None) -> torch.Tensor:
    """The ``[N, in_features]`` weights in ``dtype``, in the stored column order, from one
    kernel; ``in_features`` and the group size must be multiples of 16."""
    from pagedllm.layers import _int_matmul_kernels as kernels

    group = in_features if group_size == -1 else group_size
    block_k = next(b for b in _BLOCK_KS if in_features % b == 0 and group % b == 0)
    out = torch.empty((qweight.shape[0], in_features), dtype=dtype, device=qweight.device)
    block_n = 64
    grid = (kernels.cdiv(qweight.shape[0], block_n), in_features // block_k)
    kernels.int_dequantize_kernel[grid](
        qweight, scales, _zeros_or_scales(scales, zeros, codebook), codebook, out,
        qweight.shape[0], qweight.stride(0), scales.stride(0),
        out.stride(0), BITS=bits, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out


INT_WGMMA_ENV = "PAGEDLLM_INT_WGMMA"
# Steps of more rows (prompts) dequantize once and multiply with BLAS: at 2,048 rows that
# beats the kernel on every Llama-3.1-8B projection, at 512 the kernel wins on every one
# (1,024 untimed; docs/benchmarks.md).
WGMMA_MAX_ROWS = 512
# Outputs this wide or wider take 256-row tiles beyond 128 rows: their 64-output tiles
# alone nearly fill an H100's SMs once. Beyond 256 rows every output takes them.
WGMMA_WIDE_OUTPUT = 6144
# Steps of up to this many rows take tiles of 8 to 64 rows with K split (``small_wgmma_tile``).
WGMMA_SPLIT_ROWS = 64
# A step whose last tile of rows would hold this many rows past the batch or more is
# copied into whole tiles first (``int4_wgmma``).
WGMMA_PAD_ROWS = 16


@dataclass(frozen=True)
class WgmmaTile:
    """Launch shape of ``int4_wgmma``: ``block_m x block_n`` output tiles (``block_n`` is
    16 outputs a warp: ``16 * num_warps``), ``block_k`` inputs a step, ``stages`` activation
    tiles and ``word_stages`` tiles of packed words in flight (the words come from memory,
    the activations mostly from L2); ``paired``: weights made two at a time in half
    precision (else in float32; the same weights); ``split``: slices of ``K`` summed apart
    (split-K, 1: none), added in a fixed order."""

    block_m: int = 128
    block_n: int = 64
    block_k: int = 64
    stages: int = 4
    num_warps: int = 4
    paired: bool = True
    word_stages: int = 4
    split: int = 1


def wgmma_config(rows: int, n: int, k: int, group_size: int, bits: int,
                 device: torch.device) -> WgmmaTile | None:
    """The ``int4_wgmma`` tile for a step of ``rows`` rows, or None where it does not serve:
    a Hopper GPU, 4-bit weights with zero points, ``K`` and the group in whole steps of
    ``block_k`` inputs, 1 to ``WGMMA_MAX_ROWS`` rows (``PAGEDLLM_INT_WGMMA=0`` turns it
    off). The tiles are the fastest of ``scripts/gemv_quant_sweep.py --int-gemm-rows`` on
    Llama-3.1-8B's projections (docs/benchmarks.md): up to ``WGMMA_SPLIT_ROWS`` rows,
    ``small_wgmma_tile``'s; then 128-row tiles by 64 outputs over 128-input steps, except
    beyond 128 rows into ``WGMMA_WIDE_OUTPUT`` or more outputs (qkv, an MLP's gate/up) and
    beyond 256 rows into any: 256-row tiles over 64-input steps. Steps of 64 inputs where
    128 do not divide ``K`` or the group."""
    group = k if group_size == -1 else group_size
    if (bits != 4 or not 0 < rows <= WGMMA_MAX_ROWS or k % 64 or group % 64
            or not is_hopper(device) or not switch(INT_WGMMA_ENV, True)):
        return None
    if rows <= WGMMA_SPLIT_ROWS:
        return small_wgmma_tile(rows, n, k, group, _sm_count(device))
    if rows > 256 or (rows > 128 and n >= WGMMA_WIDE_OUTPUT):
        tile = WgmmaTile(block_m=256, block_k=64, stages=3)
    else:
        tile = WgmmaTile(block_m=128, block_k=128, stages=3)
    return tile if k % tile.block_k == 0 and group % tile.block_k == 0 else replace(
        tile, block_k=64)


@functools.cache
def small_wgmma_tile(rows: int, n: int, k: int, group: int, sm_count: int) -> WgmmaTile:
    """The ``int4_wgmma`` tile of a decode batch of 1 to ``WGMMA_SPLIT_ROWS`` rows (``K``
    and ``group`` multiples of 64): the batch in one tile of 8 to 64 rows (``wgmma``'s
    ``N``: 8 is its narrowest) over 128-input steps where they divide ``K`` and the group.
    An output of fewer than two tiles an SM has ``K`` split until the output tiles times the
    slices reach about four programs an SM, two steps a slice at least (the kernel adds the
    slices; wider outputs run fastest whole)."""
    block_k = 128 if k % 128 == 0 and group % 128 == 0 else 64
    steps = k // block_k
    column_tiles = -(-n // 64)
    wanted = 1 if column_tiles >= 2 * sm_count else -(-4 * sm_count // column_tiles)
    split = max(s for s in range(1, max(1, min(wanted, steps // 2)) + 1) if steps % s == 0)
    return WgmmaTile(block_m=max(8, 1 << (rows - 1).bit_length()), block_k=block_k, stages=4,
                     split=split)


SPLIT_LOCKS = 1 << 16  # counters for every (row tile, output tile) of a split launch


@functools.cache
def split_locks(device: torch.device) -> torch.Tensor:
    """The counters of ``int4_wgmma``'s split tiles on ``device``: zeros between launches
    (a tile's last slice sets its counter back), so one buffer serves every launch of a
    stream, CUDA graphs included."""
    return torch.zeros(SPLIT_LOCKS, dtype=torch.int32, device=device)


def int4_wgmma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, tile: WgmmaTile, *, group_size: int,
               bias: torch.Tensor | None = None,
               perm: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias) -> [M, N]`` in ``x``'s dtype, 4-bit ``W`` with zero points
    in the stored layout, on the Hopper kernel of ``_int_wgmma_kernel``; a split tile's
    float32 slices added by the last of them to finish, in slice order. Act-order weights'
    ``perm``: the stored column ``k`` multiplies input ``perm[k]`` (the inputs gathered in
    one copy). A batch whose last tile of rows would hold ``WGMMA_PAD_ROWS`` or more rows
    past it is copied (or gathered) into whole tiles first."""
    from pagedllm.layers import _int_wgmma_kernel as kernels

    rows, in_features = x.shape
    out_features = qweight.shape[0]
    group = in_features if group_size == -1 else group_size
    if in_features % (tile.block_k * tile.split) or group % tile.block_k:
        raise ValueError(f"tile {tile} does not tile K={in_features} in groups of {group}.")
    if tile.block_n != 16 * tile.num_warps:
        raise ValueError(f"tile {tile}: block_n must be 16 outputs a warp.")
    padded = -(-rows // tile.block_m) * tile.block_m
    if padded - rows >= WGMMA_PAD_ROWS:
        # Rows past the batch would reach TMA as out-of-bounds rows, which it fills far
        # slower than it copies rows: the batch is copied into whole tiles of rows instead
        # (those past it hold whatever the buffer held; their results are not stored).
        staged = x.new_empty(padded, in_features)
        if perm is None:
            staged[:rows] = x
        else:
            torch.index_select(x, 1, perm, out=staged[:rows])
        x = staged
    elif perm is not None:
        x = torch.index_select(x, 1, perm)
    elif x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()  # TMA reads 16-byte aligned rows
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (-(-rows // tile.block_m), -(-out_features // tile.block_n), tile.split)
    partials, locks = out, out
    if tile.split > 1:
        partials = torch.empty((tile.split, rows, out_features), dtype=torch.float32,
                               device=x.device)
        locks = split_locks(x.device)
        if grid[0] * grid[1] > locks.numel():
            raise ValueError(f"tile {tile}: {grid[0] * grid[1]} tiles to split, over the "
                             f"{locks.numel()} counters.")
    kernels.int4_wgmma_kernel[grid](
        kernels.activation_descriptor(x, tile.block_m, tile.block_k),
        kernels.word_descriptor(qweight, tile.block_n, tile.block_k), scales, zeros,
        bias if bias is not None else scales, out, partials, locks, rows, out_features,
        in_features, scales.stride(0), out.stride(0), GROUP=group, BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, STAGES=tile.stages,
        WORD_STAGES=tile.word_stages, SPLIT=tile.split, HAS_BIAS=bias is not None,
        PAIRED=tile.paired and scales.dtype == x.dtype, num_warps=tile.num_warps,
    )
    return out


def int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, *, bits: int, group_size: int, in_features: int,
               bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
               codebook: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x [..., in_features]``: the kernel for CUDA half-precision
    inputs whose shape tiles, the torch reference otherwise."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if use_fused_ops(x) and x.dtype in (torch.float16, torch.bfloat16):
        rows = x2.shape[0]
        bucket = SMALL_BATCH_ROWS if rows <= SMALL_BATCH_ROWS else min(
            128, 1 << (rows - 1).bit_length())
        wgmma = (wgmma_config(rows, qweight.shape[0], in_features, group_size, bits, x.device)
                 if zeros is not None and codebook is None else None)
        if wgmma is not None:
            out = int4_wgmma(x2, qweight, scales, zeros, wgmma, group_size=group_size,
                             bias=bias, perm=perm)
            return out.reshape(*shape[:-1], out.shape[-1])
        tile = int_matmul_config(bucket, qweight.shape[0], in_features, group_size,
                                 _sm_count(x.device))
        if tile is not None and dequantizes(rows, qweight.shape[0]):
            # The weight dequantized once, then the BLAS product.
            weight = int_dequantize(qweight, scales, zeros, bits=bits, group_size=group_size,
                                    in_features=in_features, dtype=x.dtype, codebook=codebook)
            x_in = x2 if perm is None else x2[:, perm.long()]
            out = torch.nn.functional.linear(x_in, weight, bias)
            return out.reshape(*shape[:-1], out.shape[-1])
        if tile is not None:
            out = int_matmul(x2, qweight, scales, zeros, tile, bits=bits,
                             group_size=group_size, bias=bias, perm=perm, codebook=codebook)
            return out.reshape(*shape[:-1], out.shape[-1])
    return int_linear_reference(x, qweight, scales, zeros, bits=bits, group_size=group_size,
                                in_features=in_features, bias=bias, perm=perm,
                                codebook=codebook)
