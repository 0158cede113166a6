"""Mixture-of-experts feed-forward: top-k routing and the experts' products in one layer.

``routing.py`` picks each token's experts and weights, ``torch_ref.py`` is the exact
reference (the CPU path and what the kernel is tested against), ``triton_moe.py`` is the
CUDA path (tokens sorted by expert, one grouped GEMM over all experts per projection),
``tiles.py`` picks that GEMM's tile per layer shape and batch, ``layer.py`` holds the
stacked expert weights and loads them from checkpoints.
"""

from pagedllm.layers.fused_moe.layer import FusedMoE, MoEBlock
from pagedllm.layers.fused_moe.routing import select_experts

__all__ = ["FusedMoE", "MoEBlock", "select_experts"]
