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
activation dtype, as a dense FP8 projection does (``quantization.fp8``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from pagedllm.quantization.fp8 import dequantize_blocks, quantize_groups, quantize_rows


class ExpertScales(NamedTuple):
    """The float32 scales of FP8 expert weights: ``w13 [E, 2I, 1]`` and ``w2 [E, H, 1]``
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


def expert_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                  block: tuple[int, int] | None,
                  input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` for one expert: plain, or with FP8 ``weight`` and its ``scale``
    (see the module docstring; ``input_scale``: static), in ``x``'s dtype."""
    if scale is None:
        return F.linear(x, weight)
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
                        scales: ExpertScales | None = None) -> torch.Tensor:
    """``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``,
    ``topk_weights [T, k]``, ``topk_ids [T, k]`` -> ``[T, H]`` in ``x``'s dtype;
    ``scales``: FP8 weights' (see the module docstring)."""
    s13, s2, block, in13, in2 = scales if scales is not None else (None,) * 5
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
        gate, up = expert_linear(x[tokens], w13[expert], None if s13 is None else s13[expert],
                                 block, in13).chunk(2, dim=-1)
        expert_out = expert_linear(act(gate) * up, w2[expert], None if s2 is None else s2[expert],
                                   block, in2)
        weight = topk_weights.flatten()[slots, None]
        out.index_add_(0, tokens, expert_out.float() * weight.float())
    return out.to(x.dtype)


def fused_moe_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                    scales: ExpertScales | None = None) -> torch.Tensor:
    """``fused_moe_reference``'s result with static shapes: each expert's output on all
    rows, times the row's routing weight for that expert (0 when not routed)."""
    s13, s2, block, in13, in2 = scales if scales is not None else (None,) * 5
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        weight = (topk_weights.float() * (topk_ids == expert)).sum(dim=-1, keepdim=True)
        gate, up = expert_linear(x, w13[expert], None if s13 is None else s13[expert],
                                 block, in13).chunk(2, dim=-1)
        out += expert_linear(act(gate) * up, w2[expert], None if s2 is None else s2[expert],
                             block, in2).float() * weight
    return out.to(x.dtype)
