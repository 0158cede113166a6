"""RMSNorm, with the residual add fused into the same call; LayerNorm for the older
families (GPT-NeoX, OPT).

Numerics follow the reference checkpoints: the mean of squares and the rescale run in
float32, the result is cast back to the input dtype and only then multiplied by the weight.
On CUDA the whole chain (with the residual add) is one Triton kernel (``triton_ops.py``),
and after a projection of a small decode batch it rides on the projection's own launch
(``linear_and_norm``). A norm whose output goes to an FP8 projection alone
(``RMSNorm.feeds``) hands it over quantized when that projection would quantize it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import Linear, small_batch_product
from pagedllm.layers.triton_ops import head_rms_norm, rms_norm, use_fused_ops
from pagedllm.quantization.fp8 import Fp8Rows, Fp8Sums


class RMSNorm(nn.Module):
    """``y = weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    ``forward(x)`` returns ``y``. ``forward(x, residual)`` first forms ``s = x + residual``
    (in the input dtype) and returns ``(norm(s), s)``: the pre-norm residual stream of a
    decoder layer in one call.

    With ``weight_offset`` (Gemma: 1.0) the scale is ``weight_offset + weight`` and the
    product runs in float32 before the one cast, as those checkpoints compute it (the
    torch path on every device).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self._consumer: tuple[Linear, ...] = ()  # a tuple: not a submodule

    def feeds(self, proj: Linear) -> None:
        """Declare that this norm's output goes to ``proj`` and nowhere else. On CUDA, when
        ``proj`` would quantize it for an FP8 product (``Linear.takes_fp8_rows``), the
        norm's kernel quantizes it instead and ``forward`` returns ``Fp8Rows`` in place
        of the normalised tensor: the same values, one pass over memory fewer."""
        self._consumer = (proj,)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            return (x32 * (self.weight.float() + self.weight_offset)).to(dtype)
        return self.weight * x32.to(dtype)

    def forward(
        self, x: torch.Tensor | Fp8Sums, residual: torch.Tensor | None = None
    ) -> torch.Tensor | Fp8Rows | tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """``x`` may be an FP8 product's ``Fp8Sums``: the fused kernel scales them as it
        reads them, elsewhere they are scaled first."""
        sums_scales = None
        if isinstance(x, Fp8Sums):
            x, sums_scales = (x.sums, x.scales) if self._runs_fused(x.sums) else (x.scaled(), None)
        if self._runs_fused(x):
            if not self._consumer or not self._consumer[0].takes_fp8_rows(x):
                return rms_norm(x, self.weight, self.eps, residual, sums_scales=sums_scales)
            out = rms_norm(x, self.weight, self.eps, residual, fp8=True,
                           input_scale=self._consumer[0].input_scale, sums_scales=sums_scales)
            if residual is None:
                return Fp8Rows(*out, x.dtype)
            return Fp8Rows(*out[0], x.dtype), out[1]
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def _runs_fused(self, x: torch.Tensor) -> bool:
        return use_fused_ops(x) and self.weight.dtype == x.dtype and not self.weight_offset


def qk_norms(qk: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, q_heads: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's and Gemma 3's per-head norms: ``q_norm`` over each of the first ``q_heads``
    heads of ``qk`` (``[T, heads * head_dim]``, e.g. the q and k columns of a fused qkv
    output; ``head_dim`` is the norms' size) and ``k_norm`` over each of the rest. Returns
    ``(q, k)``, ``[T, q_heads * head_dim]`` and ``[T, (heads - q_heads) * head_dim]``. Where
    both norms run fused (CUDA, plain weights, one eps) one launch does both
    (``head_rms_norm``); else each norm on its own heads (Gemma 3's offset weights)."""
    heads = qk.view(qk.shape[0], -1, q_norm.weight.shape[0])
    if q_norm._runs_fused(qk) and k_norm._runs_fused(qk) and q_norm.eps == k_norm.eps:
        q, k = head_rms_norm(heads, q_norm.weight, q_norm.eps, k_norm.weight, q_heads)
    else:
        q, k = q_norm(heads[:, :q_heads]), k_norm(heads[:, q_heads:])
    return q.flatten(1), k.flatten(1)


class LayerNorm(nn.Module):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension, in
    float32, cast back to the input dtype (the reference checkpoints' numerics)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias,
                            self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


def linear_and_norm(
    x: torch.Tensor | Fp8Rows, proj: Linear, norm: RMSNorm, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm(proj(x), residual)``: the normalised sum and the sum. For a decode step of a
    few sequences on CUDA the norm runs at the end of the projection's small-batch product
    (one launch for both; the same roundings as the two kernels); not for a row-parallel
    projection, whose ranks' products are summed before the norm. A larger FP8 product
    hands the norm its sums, which the norm's kernel scales (``Fp8Sums``)."""
    if not proj.reduces and norm.weight.dtype == x.dtype and not norm.weight_offset:
        fused = small_batch_product(proj, x, proj.bias, norm=(norm.weight, norm.eps, residual))
        if fused is not None:
            return fused
    return norm(proj(x, sums=True), residual)
