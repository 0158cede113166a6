"""The experts' products in torch, one expert at a time: exact, and the reference.

For token ``t`` routed to experts ``e_1..e_k`` with weights ``w_1..w_k``::

    out[t] = sum_j  w_j * down_{e_j}( act(gate_{e_j}(x[t])) * up_{e_j}(x[t]) )

Each expert multiplies only the rows routed to it (an expert with no tokens costs
nothing); the weighted sum runs in float32 and is cast to the activation dtype once.
That needs each expert's row count on the host; ``fused_moe_dense`` computes the same sum
with every expert over every row (E times the work, no host sync), for CUDA graphs when
the Triton kernels are turned off.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``,
    ``topk_weights [T, k]``, ``topk_ids [T, k]`` -> ``[T, H]`` in ``x``'s dtype."""
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
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        expert_out = F.linear(act(gate) * up, w2[expert])
        weight = topk_weights.flatten()[slots, None]
        out.index_add_(0, tokens, expert_out.float() * weight.float())
    return out.to(x.dtype)


def fused_moe_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """``fused_moe_reference``'s result with static shapes: each expert's output on all
    rows, times the row's routing weight for that expert (0 when not routed)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        weight = (topk_weights.float() * (topk_ids == expert)).sum(dim=-1, keepdim=True)
        gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)
        out += F.linear(act(gate) * up, w2[expert]).float() * weight
    return out.to(x.dtype)
