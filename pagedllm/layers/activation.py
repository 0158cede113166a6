"""Gated activations over a fused ``[gate; up]`` projection.

``gate_up`` has ``2 * d`` features in its last dimension: the first ``d`` are the gate, the
last ``d`` the up projection; the result ``act(gate) * up`` has ``d``. On CUDA, SiLU's
split, activation and product are one Triton kernel (``triton_ops.py``), which also
quantizes its output for an FP8 projection it feeds (``GatedActivation.feeds``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.triton_ops import silu_and_mul, use_fused_ops
from pagedllm.quantization.fp8 import Fp8Rows, Fp8Sums

if TYPE_CHECKING:
    from pagedllm.layers.linear import Linear

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
        self._consumer: tuple[Linear, ...] = ()  # a tuple: not a submodule

    def feeds(self, proj: Linear) -> None:
        """Declare that this activation's output goes to ``proj`` and nowhere else: on
        CUDA, when ``proj`` would quantize it for an FP8 product
        (``Linear.takes_fp8_rows``), SiLU-and-mul's kernel quantizes it instead and
        ``forward`` returns ``Fp8Rows`` (the same values)."""
        self._consumer = (proj,)

    @property
    def is_silu(self) -> bool:
        return self._fn is F.silu

    @property
    def takes_sums(self) -> bool:
        """Whether ``forward`` scales ``Fp8Sums`` as it reads them (the fused SiLU)."""
        return self.is_silu

    def forward(self, gate_up: torch.Tensor | Fp8Sums) -> torch.Tensor | Fp8Rows:
        """``gate_up`` may be an FP8 product's ``Fp8Sums`` (``takes_sums``): SiLU-and-mul's
        kernel scales them as it reads them."""
        sums_scales = None
        if isinstance(gate_up, Fp8Sums):
            fused = self.is_silu and use_fused_ops(gate_up.sums)
            gate_up, sums_scales = ((gate_up.sums, gate_up.scales) if fused
                                    else (gate_up.scaled(), None))
        if self.is_silu and gate_up.dim() == 2 and use_fused_ops(gate_up):
            if self._consumer and self._consumer[0].takes_fp8_rows(gate_up):
                consumer = self._consumer[0]
                return Fp8Rows(*silu_and_mul(gate_up, fp8=True, input_scale=consumer.input_scale,
                                             sums_scales=sums_scales), gate_up.dtype)
            return silu_and_mul(gate_up, sums_scales=sums_scales)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._fn(gate) * up

    def extra_repr(self) -> str:
        return self.hidden_act
