"""Top-k routing: each token's experts and the weights its expert outputs are summed with.

The router's logits go through a float32 softmax over all experts; the ``top_k`` largest
probabilities are kept (``torch.topk``, so ties resolve as the reference checkpoints'
code resolves them); with ``renormalize`` the kept ones are divided by their sum (Mixtral
always, Qwen3-MoE when ``norm_topk_prob``), otherwise they stay fractions of the whole.
"""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(weights [T, top_k] float32, expert ids [T, top_k]
    int64)``; weights are non-negative and, with ``renormalize``, sum to 1 per token."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
