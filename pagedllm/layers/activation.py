"""Gated activations over a fused ``[gate; up]`` projection.

``gate_up`` has ``2 * d`` features in its last dimension: the first ``d`` are the gate, the
last ``d`` the up projection; the result ``act(gate) * up`` has ``d``. On CUDA, SiLU's
split, activation and product are one Triton kernel (``triton_ops.py``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.triton_ops import silu_and_mul, use_fused_ops

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise function config.json's ``hidden_act`` names (the plain MLPs of
    GPT-NeoX and OPT). Raises ValueError naming the supported ones."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported; supported: {sorted(_ACTIVATIONS)}.")
    return _ACTIVATIONS[name]


class GatedActivation(nn.Module):
    """``act(x[..., :d]) * x[..., d:]`` for ``x`` with ``2 * d`` features."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act={hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}."
            )
        self.hidden_act = hidden_act
        self._fn = _ACTIVATIONS[hidden_act]

    @property
    def is_silu(self) -> bool:
        return self._fn is F.silu

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.is_silu and gate_up.dim() == 2 and use_fused_ops(gate_up):
            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._fn(gate) * up

    def extra_repr(self) -> str:
        return self.hidden_act
