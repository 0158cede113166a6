"""INT8 W8A8 projections (compressed-tensors ``int-quantized``, llm-compressor's ``W8A8``):
int8 weights with a float32 scale per output row, inputs quantized to int8 per token
(dynamic) or with the checkpoint's per-tensor scale (static), both symmetric.

A value ``v`` with scale ``s`` is stored as ``round(v / s)`` clamped to [-128, 127]
(``torch.round``: halves to even); a dynamic row's scale is its largest magnitude over
127.5, half the range's width, as compressed-tensors quantizes (its largest value then
saturates at 127, or reaches -128; vLLM's CUDA kernel divides by 127 instead, a different
rounding of the same checkpoint). The product is

    out[m, n] = (sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n]  (+ bias[n])

On CUDA the inputs are quantized by one Triton kernel a row (``triton_ops``, the same
values) and the integer sums run in int32 on the tensor cores, exact, then are scaled in
float32 and rounded once to the activation dtype: decode batches of a few rows in the
small-batch kernel (``triton_ops.small_batch_matmul``), the rest in
``layers.int8_matmul``. Elsewhere the reference dequantizes both operands to float32 and
multiplies there, as a transformers model holding the dequantized weights and quantizing
each input the same way computes it.
"""

from __future__ import annotations

import torch

from pagedllm.layers import triton_ops
from pagedllm.quantization.fp8 import divide_exactly

INT8_MAX = 127
# A dynamic row's largest magnitude maps to half the width of [-128, 127].
_HALF_RANGE = 127.5


def quantize_rows_int8(x: torch.Tensor, input_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (int8 ``[M, K]``, float32 scales ``[M, 1]``): per row (its largest
    magnitude over 127.5, or 1 for a row of zeros), or with the static ``input_scale`` (one
    value) on every row."""
    x = x.float()
    if input_scale is None:
        scale = divide_exactly(x.abs().amax(dim=-1, keepdim=True), _HALF_RANGE)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    quantized = torch.round(x / scale).clamp_(-INT8_MAX - 1, INT8_MAX).to(torch.int8)
    return quantized, scale


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` in ``x``'s dtype for int8 ``weight [N, K]`` with
    ``weight_scale [N, 1]`` (see the module docstring)."""
    rows = x.reshape(-1, x.shape[-1])
    if triton_ops.use_fused_ops(rows):
        from pagedllm.layers.int8_matmul import int8_matmul  # kernels load on first use

        quantized, x_scale = triton_ops.quantize_rows_int8(rows, input_scale)
        out = int8_matmul(quantized, x_scale, weight, weight_scale, bias, x.dtype)
    else:
        quantized, x_scale = quantize_rows_int8(rows, input_scale)
        out = (quantized.float() * x_scale) @ (weight.float() * weight_scale.float()).t()
        if bias is not None:
            out = out + bias.float()
        out = out.to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])
