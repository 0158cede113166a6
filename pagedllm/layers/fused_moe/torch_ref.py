"""The experts' products in torch, one expert at a time: exact, and the reference.

For token ``t`` routed to experts ``e_1..e_k`` with weights ``w_1..w_k``::

    out[t] = sum_j  w_j * down_{e_j}( act(gate_{e_j}(x[t])) * up_{e_j}(x[t]) )

Each expert multiplies only the rows routed to it (an expert with no tokens costs
nothing); the weighted sum runs in float32 and is cast to the activation dtype once.
That needs each expert's row count on the host; ``fused_moe_dense`` computes the same sum
with every expert over every row (E times the work, no host sync), for CUDA graphs when
the Triton kernels are turned off.

FP8 experts (``ExpertScales``): each product's input is quantized per token (per token and
group of ``block[1]`` inputs with block-wise weights; or with the layer's static input
scale) and multiplied by the dequantized weight in float32, the result rounded to the
activation dtype, as a dense FP8 projection does (``quantization.fp8``); INT8 W8A8 experts
the same way with int8 inputs (``quantization.int8``). Integer experts
(``ExpertInts``, W4A16 / W8A16): each expert's weight is dequantized to the activation
dtype in the checkpoint's column order and multiplied, as a dense integer-weight
projection's reference does (``quantization.int_weights.int_linear_reference``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from pagedllm.quantization.fp8 import dequantize_blocks, quantize_groups, quantize_rows
from pagedllm.quantization.int8 import quantize_rows_int8
from pagedllm.quantization.int_weights import int_linear_reference


class ExpertScales(NamedTuple):
    """The float32 scales of FP8 expert weights (or INT8 W8A8 ones, per channel: the
    weights' dtype tells): ``w13 [E, 2I, 1]`` and ``w2 [E, H, 1]``
    per output channel (``block`` None), or one per ``block = (rows, columns)`` of each
    expert's weight (``[E, cdiv(2I, rows), cdiv(H, columns)]``, ``[E, cdiv(H, rows),
    cdiv(I, columns)]``)."""

    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int] | None = None
    # Static activation scales (one float32 value each, for every expert's gate/up input
    # and down input), or None: dynamic, per token.
    input13: torch.Tensor | None = None
    input2: torch.Tensor | None = None


class ExpertInts(NamedTuple):
    """Integer expert weights (``int_weights``' stored layout, one projection per expert):
    the packed ``w13 [E, 2I, ceil(H / P)]`` and ``w2 [E, H, ceil(I / P)]`` int32 go with
    their scales (``[E, rows, groups]``, the model's dtype), zero points (the same shape,
    uint8) and, for act-order checkpoints, each expert's input order (``[E, H]``,
    ``[E, I]`` int32: stored column ``k`` is the checkpoint's ``perm[e, k]``). A codebook
    (bitsandbytes' 16 values, float32) stands for the zero points: float32 scales, zeros
    None, each weight ``codebook[q] * scale``."""

    w13_scales: torch.Tensor
    w13_zeros: torch.Tensor
    w2_scales: torch.Tensor
    w2_zeros: torch.Tensor
    bits: int
    group_size: int
    w13_perm: torch.Tensor | None = None
    w2_perm: torch.Tensor | None = None
    codebook: torch.Tensor | None = None


ExpertQuant = ExpertScales | ExpertInts


def expert_linear(x: torch.Tensor, weights: torch.Tensor, expert: int,
                  quant: ExpertQuant | None, first: bool) -> torch.Tensor:
    """``x @ weights[expert].T`` in ``x``'s dtype: the gate/up product (``first``, of
    ``w13``) or the down product (of ``w2``), plain or with ``quant``'s FP8 or integer
    weights (see the module docstring)."""
    weight = weights[expert]
    if quant is None:
        return F.linear(x, weight)
    if isinstance(quant, ExpertInts):
        scales, zeros, perm = ((quant.w13_scales, quant.w13_zeros, quant.w13_perm) if first
                               else (quant.w2_scales, quant.w2_zeros, quant.w2_perm))
        return int_linear_reference(x, weight, scales[expert],
                                    None if zeros is None else zeros[expert], bits=quant.bits,
                                    group_size=quant.group_size, in_features=x.shape[-1],
                                    perm=None if perm is None else perm[expert],
                                    codebook=quant.codebook)
    scale = (quant.w13 if first else quant.w2)[expert]
    input_scale = quant.input13 if first else quant.input2
    if weight.dtype == torch.int8:
        xq, x_scale = quantize_rows_int8(x, input_scale)
        return ((xq.float() * x_scale) @ (weight.float() * scale).t()).to(x.dtype)
    block = quant.block
    group = block[1] if block is not None else x.shape[-1]
    if input_scale is not None:
        xq, x_scale = quantize_rows(x, input_scale)
    else:
        xq, x_scale = quantize_groups(x, group)
    values = dequantize_blocks(weight, scale, block or (1, weight.shape[1]))
    return (dequantize_blocks(xq, x_scale, (1, group)) @ values.t()).to(x.dtype)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                        scales: ExpertQuant | None = None) -> torch.Tensor:
    """``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``,
    ``topk_weights [T, k]``, ``topk_ids [T, k]`` -> ``[T, H]`` in ``x``'s dtype;
    ``scales``: FP8 or integer weights' (see the module docstring)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]  # flat (token, choice) indices, token-major
        start += count
        tokens = slots // topk_ids.shape[1]
        gate, up = expert_linear(x[tokens], w13, expert, scales, first=True).chunk(2, dim=-1)
        expert_out = expert_linear(act(gate) * up, w2, expert, scales, first=False)
        weight = topk_weights.flatten()[slots, None]
        out.index_add_(0, tokens, expert_out.float() * weight.float())
    return out.to(x.dtype)


def fused_moe_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                    scales: ExpertQuant | None = None) -> torch.Tensor:
    """``fused_moe_reference``'s result with static shapes: each expert's output on all
    rows, times the row's routing weight for that expert (0 when not routed)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        weight = (topk_weights.float() * (topk_ids == expert)).sum(dim=-1, keepdim=True)
        gate, up = expert_linear(x, w13, expert, scales, first=True).chunk(2, dim=-1)
        out += expert_linear(act(gate) * up, w2, expert, scales, first=False).float() * weight
    return out.to(x.dtype)
