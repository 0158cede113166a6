"""The experts' products on CUDA: tokens sorted by expert, two grouped GEMMs, a combine.

Every (token, choice) pair is a *slot* ``token * top_k + choice``. The slots are sorted by
expert and each expert's run padded to a multiple of ``BLOCK_M`` (pad slots hold
``num_slots``), so a block of ``BLOCK_M`` sorted slots belongs to one expert::

    sorted slots: [ e0 e0 e0 pad | e1 e1 e1 e1 | e3 pad pad pad | (unused) ... ]
    block expert: [     0        |      1      |       3        |  -1 ...    ]

The list has a fixed upper size (``slots + min(E, slots) * (BLOCK_M - 1)``, rounded to a
block: at most ``min(E, slots)`` experts have slots), so no step needs the counts on the
host and the launches can be captured in a CUDA graph. ``BLOCK_M`` and the rest of the
tile come from ``tiles.choose_tile`` before the sort, and both GEMMs use that one tile.
The first GEMM computes ``silu(gate) * up`` per slot with gate and up in one program,
the second the down projection times the slot's routing weight (float32 rows); the
combine sums each token's ``top_k`` rows and casts once, as ``torch_ref`` does. FP8 experts
(``scales``): each GEMM's input is first quantized per row and group
(``fp8_block_matmul.quantize_groups_fp8``: per token, then per slot) and the kernel scales
each group's product (``_kernels``); INT8 W8A8 experts the same way, per row, in int8
(``triton_ops.quantize_rows_int8``). Integer experts (``ExpertInts``) are dequantized tile
by tile inside the same GEMMs, their inputs unquantized; the tile's ``BLOCK_K`` is cut to
divide both products' inputs and the group size.
"""

from __future__ import annotations

import functools
import os

import torch

from dataclasses import replace

from pagedllm.core.kv_cache import cdiv
from pagedllm.layers.fused_moe.tiles import MoeTile, choose_tile
from pagedllm.layers.fused_moe.torch_ref import ExpertInts, ExpertQuant

# An FP8 or int8 tensor-core product sums 32 inputs at least (Triton's smallest such dot).
FP8_MIN_BLOCK_K = 32


@functools.cache
def _kernels():
    from pagedllm.layers.fused_moe import _kernels

    return _kernels


def sort_slots_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids [T, k]`` -> ``(sorted_slots [L] int32, block_expert [L / block_m] int32)``
    as drawn in the module docstring; slots of one expert keep their token order."""
    flat = topk_ids.flatten().to(torch.int64)
    num_slots = flat.numel()
    device = flat.device
    length = cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    count_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_slots, device=device) - count_start[expert_of_sorted]
    destination = (padded_end - padded)[expert_of_sorted] + rank
    sorted_slots = torch.full((length,), num_slots, dtype=torch.int32, device=device)
    sorted_slots[destination] = order.to(torch.int32)
    block_starts = torch.arange(0, length, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots, block_expert


def _w8a8_operand(rows: torch.Tensor, weight_scale: torch.Tensor,
                  block: tuple[int, int] | None, input_scale: torch.Tensor | None,
                  int8: bool) -> tuple[torch.Tensor, tuple, dict]:
    """``rows`` quantized for an FP8 (or, with ``int8``, INT8) GEMM over weights scaled by
    ``weight_scale`` (per token and group, or with the static ``input_scale``): the
    kernel's ``a`` and its scale and weight-scale arguments."""
    from pagedllm.layers.fp8_block_matmul import quantize_groups_fp8
    from pagedllm.layers.triton_ops import quantize_rows_fp8, quantize_rows_int8
    from pagedllm.quantization import int8 as int8_reference
    from pagedllm.quantization.fp8 import quantize_groups, quantize_rows

    group_n, group_k = block if block is not None else (1, rows.shape[1])
    if int8:
        quantize = quantize_rows_int8 if rows.is_cuda else int8_reference.quantize_rows_int8
        quantized, scale = quantize(rows, input_scale)
    elif block is None or input_scale is not None:  # a scale a row: per token, or static
        quantize = quantize_rows_fp8 if rows.is_cuda else quantize_rows
        quantized, scale = quantize(rows, input_scale)
    else:
        quantize = quantize_groups_fp8 if rows.is_cuda else quantize_groups
        quantized, scale = quantize(rows, group_k)
    weight_scale = weight_scale.contiguous()
    args = (scale, weight_scale)
    sizes = dict(group_n=group_n, group_k=group_k, stride_asm=scale.stride(0),
                 stride_bse=weight_scale.stride(0), stride_bsn=weight_scale.stride(1))
    return quantized, args, sizes


def int_block_k(block_k: int, hidden: int, inter: int, group_size: int) -> int | None:
    """The largest ``BLOCK_K`` of at most ``block_k`` (16 at least, a power of two) that
    divides both products' inputs (``hidden`` and ``inter``) and the integer experts'
    groups (-1: per channel), so every weight tile lies in one group; None if none does."""
    sizes = (hidden, inter) + (() if group_size == -1 else (group_size,))
    while block_k >= 16:
        if all(size % block_k == 0 for size in sizes):
            return block_k
        block_k //= 2
    return None


def _int_operand(rows: torch.Tensor, ints: ExpertInts, first: bool
                 ) -> tuple[torch.Tensor, tuple, dict]:
    """``rows`` as they are for a GEMM over integer experts, with the experts' scales,
    zero points (the scales in their place for a codebook: not read) and input order (one
    stride for scales and zero points: both contiguous)."""
    scales, zeros, perm = ((ints.w13_scales, ints.w13_zeros, ints.w13_perm) if first
                           else (ints.w2_scales, ints.w2_zeros, ints.w2_perm))
    scales = scales.contiguous()
    zeros = scales if zeros is None else zeros.contiguous()
    group = rows.shape[1] if ints.group_size == -1 else ints.group_size
    sizes = dict(group_n=1, group_k=1, stride_asm=0, stride_bse=scales.stride(0),
                 stride_bsn=scales.stride(1), stride_pe=0 if perm is None else perm.stride(0),
                 INT_BITS=ints.bits, INT_GROUP=group, HAS_PERM=perm is not None)
    return rows, (rows, scales, zeros, scales if perm is None else perm.contiguous()), sizes


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     tile: MoeTile | None = None,
                     scales: ExpertQuant | None = None) -> torch.Tensor:
    """Same arguments and result as ``torch_ref.fused_moe_reference`` with SiLU (the
    only activation this kernel computes). ``tile`` (for sweeps and tests) replaces
    ``choose_tile``'s, the environment's included; FP8 experts take a ``BLOCK_K`` of at
    least ``FP8_MIN_BLOCK_K``, cut to the block's width if wider; integer experts one that
    divides both inputs and the group (``int_block_k``; a ValueError when none does)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    ints = scales if isinstance(scales, ExpertInts) else None
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    tile = tile or choose_tile(num_experts, num_slots)
    if ints is not None:
        block_k = int_block_k(tile.block_k, hidden, inter, ints.group_size)
        if block_k is None:
            raise ValueError(f"integer experts of {hidden} and {inter} inputs in groups of "
                             f"{ints.group_size} do not tile in steps of 16 inputs or more.")
        tile = replace(tile, block_k=block_k)
    elif scales is not None:  # FP8 and int8 products take 32 inputs a step at least
        block_k = max(tile.block_k, FP8_MIN_BLOCK_K)
        if scales.block is not None:
            width = scales.block[1]
            if width < FP8_MIN_BLOCK_K or width & (width - 1):
                raise ValueError(f"block-wise FP8 experts on the GPU need a block width that "
                                 f"is a power of two of at least {FP8_MIN_BLOCK_K}, got {width}.")
            block_k = min(block_k, width)
        tile = replace(tile, block_k=block_k)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_slots, block_expert = sort_slots_by_expert(topk_ids, num_experts, tile.block_m)
    num_blocks = block_expert.numel()
    dot_f32 = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    kernel = _kernels().moe_gemm_kernel
    activated = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    meta = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages,
                W8A8="" if ints is not None or scales is None else (
                    "int8" if w13.dtype == torch.int8 else "fp8"), DOT_F32=dot_f32)

    def operand(rows: torch.Tensor, first: bool) -> tuple[torch.Tensor, tuple, dict]:
        """The GEMM's ``a``, its four scale, zero-point and order arguments, and the sizes,
        strides and constants that go with them."""
        if ints is not None:
            return _int_operand(rows, ints, first)
        unused = dict(group_n=1, group_k=1, stride_asm=0, stride_bse=0, stride_bsn=0,
                      stride_pe=0, INT_BITS=0, INT_GROUP=1, HAS_PERM=False)
        if scales is None:
            return rows, (rows,) * 4, unused
        quantized, (a_scale, b_scale), sizes = _w8a8_operand(
            rows, scales.w13 if first else scales.w2, scales.block,
            scales.input13 if first else scales.input2, meta["W8A8"] == "int8")
        return quantized, (a_scale, b_scale, b_scale, b_scale), {**unused, **sizes}

    a, scale_args, sizes = operand(x, first=True)
    codebook = None if ints is None else ints.codebook
    kernel[(num_blocks * cdiv(inter, tile.block_n),)](
        a, w13, activated, topk_weights, sorted_slots, block_expert, *scale_args, codebook,
        num_slots, num_blocks, inter, hidden, sizes.pop("group_n"), sizes.pop("group_k"),
        a.stride(0), w13.stride(0), w13.stride(1), activated.stride(0),
        A_DIV=top_k, GATED=True, WEIGHTED=False, **sizes, **meta,
    )
    weights = topk_weights.flatten().float().contiguous()
    rows = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    a, scale_args, sizes = operand(activated, first=False)
    kernel[(num_blocks * cdiv(hidden, tile.block_n),)](
        a, w2, rows, weights, sorted_slots, block_expert, *scale_args, codebook,
        num_slots, num_blocks, hidden, inter, sizes.pop("group_n"), sizes.pop("group_k"),
        a.stride(0), w2.stride(0), w2.stride(1), rows.stride(0),
        A_DIV=1, GATED=False, WEIGHTED=True, **sizes, **meta,
    )
    return rows.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
