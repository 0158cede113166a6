"""FP8 W8A8: float8_e4m3fn weights with one float32 scale per output channel, inputs
quantized per token (dynamic) or with the checkpoint's per-tensor ``input_scale`` (static).

The weights come from an FP8 checkpoint (``pagedllm.quantization.checkpoint``) or are
quantized at load (``--quantization fp8`` on a bf16/fp16/fp32 checkpoint: the projections
inside the decoder layers, qkv, o, gate/up and down; the embedding, the LM head and the
norms stay in the model's dtype). The product is::

    y[t, n] = (sum_k xq[t, k] * wq[n, k]) * x_scale[t] * w_scale[n]  (+ bias[n])
    xq = round_e4m3(clamp(x * (1 / x_scale), -448, 448))
    x_scale[t] = max_k |x[t, k]| / 448  (dynamic)  or  input_scale  (static)

(``1 / x_scale`` rounded to float32 once a row, then one product an element, as vLLM's
quantization kernels scale: a division an element cost the fused kernels a quarter of
their instructions.)

On CUDA devices of compute capability 8.9 or higher the product runs on the FP8 tensor
cores (``torch._scaled_mm`` with row-wise scales; on Hopper a
wide product of 129-224 rows is padded with zero rows to 256, ``cublas_rows``, and decode
batches' narrow products take ``layers.fp8_matmul``'s split-K GEMM instead,
``split_k_product``). Elsewhere the same quantized operands are dequantized and multiplied
in float32: the reference the tests compare with (an HF model whose weights and projection
inputs are quantized the same way gives the same greedy tokens).

Block-wise weights (``fp8_block_linear``; a checkpoint's ``weight_block_size`` or
compressed-tensors' ``block`` strategy) hold one scale per ``(rows, columns)`` block of the
weight, and each input row is quantized per group of ``columns`` inputs::

    y[t, n] = sum_g x_scale[t, g] * w_scale[n // rows, g] * sum_{k in group g} xq[t, k] * wq[n, k]
    x_scale[t, g] = max_{k in group g} |x[t, k]| / 448

The op that produces a projection's input can hand it over already quantized
(``Fp8Rows``: the norm before qkv and gate/up, SiLU-and-mul before down, on CUDA), the
same values ``quantize_rows`` gives, so the product skips its own quantization pass. And
on Hopper the product can hand its sums to the op that reads them before the scales are
applied (``Fp8Sums``: gate/up's to SiLU-and-mul, o_proj's and down's to the norm after
them), so that cuBLASLt multiplies with one unit scale per operand, its faster kernels
(bfloat16 models; ``PAGEDLLM_FP8_DEFERRED_SCALES=0`` turns it off).

cuBLASLt's products take its FP8 fast accumulation (the tensor cores' own accumulator over
the whole of K, as vLLM's CUTLASS FP8 kernels on Hopper accumulate): faster, and its error
is a small part of what rounding the operands to FP8 already costs (docs/benchmarks.md).
``PAGEDLLM_FP8_FAST_ACCUM=0`` promotes the partial sums to float32 every few steps instead.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedllm.layers.triton_ops import is_hopper, quantize_rows_fp8, use_fused_ops
from pagedllm.switches import switch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Scales never reach zero (an all-zero row quantizes to zeros with this scale).
_MIN_SCALE = 1e-12


class Fp8Rows(NamedTuple):
    """Rows quantized for an FP8 product by the op that produced them: float8_e4m3fn
    ``values [T, K]`` and float32 ``scale [T, 1]``, as ``quantize_rows`` gives them for
    the product's dynamic or static scale; ``dtype`` is the activation dtype the product
    returns."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


class Fp8Sums(NamedTuple):
    """An FP8 product handed to the op that consumes it before its scales are applied:
    ``sums [T, N]`` (``sum_k xq[t, k] * wq[n, k]`` rounded to the activation dtype),
    ``row_scale [T, 1]`` and ``col_scale [N, 1]`` (float32). The product is
    ``round(sums * row_scale * col_scale)``, which the consumer computes as it reads the
    sums (``triton_ops.silu_and_mul``, ``rms_norm``: ``sums_scales``); cuBLASLt's products
    with one scale per tensor run faster on Hopper than its row-wise ones."""

    sums: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.sums.shape

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.row_scale, self.col_scale

    def scaled(self) -> torch.Tensor:
        """The product with its scales applied (for a consumer that takes no sums)."""
        return (self.sums.float() * self.row_scale * self.col_scale.t()).to(self.sums.dtype)


def divide_exactly(values: torch.Tensor, divisor: float) -> torch.Tensor:
    """``values / divisor`` rounded as IEEE division on every device (CUDA multiplies by the
    reciprocal of a Python number, a last bit away), as the Triton kernels divide."""
    return values / torch.full_like(values, divisor)


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` -> (float8_e4m3fn ``[R, C]``, float32 scales ``[R, 1]``): one scale per
    row, each row's largest magnitude mapped to 448; or ``input_scale`` (one float32
    value, a static per-tensor scale) for every row, values beyond its range clamped."""
    if input_scale is None:
        scale = divide_exactly(x.abs().amax(dim=-1, keepdim=True).float(), FP8_MAX)
        scale = scale.clamp_(min=_MIN_SCALE)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    quantized = (x.float() * scale.reciprocal()).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def dequantize_rows(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of quantized rows (the inverse of ``quantize_rows`` up to rounding)."""
    return quantized.float() * scale


@functools.cache
def _fp8_matmul_supported(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


SPLIT_GEMM_ENV = "PAGEDLLM_FP8_SPLIT_GEMM"
# The products the split-K GEMM takes on Hopper: up to this many rows, outputs up to this
# wide (docs/benchmarks.md, "FP8 products of 129-224 rows" and "The split-K FP8 GEMM by
# default").
SPLIT_GEMM_MAX_ROWS, SPLIT_GEMM_MAX_N = 192, 4096
SPLIT_GEMM = switch(SPLIT_GEMM_ENV, True)


def split_k_product(rows: int, n: int, device: torch.device) -> bool:
    """Whether an FP8 product of ``rows x n`` outputs on ``device`` takes
    ``layers.fp8_matmul``: on Hopper, a decode batch's narrow output (o_proj, down), whose
    few output tiles leave cuBLASLt's kernels most of the SMs idle, unless
    ``PAGEDLLM_FP8_SPLIT_GEMM=0``."""
    return (SPLIT_GEMM and rows <= SPLIT_GEMM_MAX_ROWS and n <= SPLIT_GEMM_MAX_N
            and is_hopper(device))


# cuBLASLt's FP8 products with row-wise scales into wide outputs (gate/up) of 129-224 rows
# take up to 1.4 times as long as those of 256 rows on an H200; narrower outputs do not pay
# for the padding's copies (docs/benchmarks.md, "FP8 products of 129-224 rows").
_HOPPER_PADDED_ROWS = (129, 224, 256)
_PADDED_MIN_N = 16384
PAD_ROWS_ENV = "PAGEDLLM_FP8_PAD_ROWS"
PAD_ROWS = switch(PAD_ROWS_ENV, True)
DEFERRED_SCALES_ENV = "PAGEDLLM_FP8_DEFERRED_SCALES"
DEFERRED_SCALES = switch(DEFERRED_SCALES_ENV, True)
# cuBLASLt's FP8 fast accumulation for its products (unit or row-wise scales): the tensor
# cores' own accumulator over the whole of K, without promoting partial sums to float32
# every few steps.
FAST_ACCUM_ENV = "PAGEDLLM_FP8_FAST_ACCUM"
FAST_ACCUM = switch(FAST_ACCUM_ENV, True)


def cublas_rows(rows: int, n: int, device: torch.device) -> int:
    """The rows an FP8 product of ``rows x n`` outputs runs at on ``device``: ``rows``, or
    on Hopper (compute capability 9.x) 256 for 129-224 rows into at least 16,384 outputs,
    unless ``PAGEDLLM_FP8_PAD_ROWS=0``."""
    low, high, padded = _HOPPER_PADDED_ROWS
    if PAD_ROWS and low <= rows <= high and n >= _PADDED_MIN_N and is_hopper(device):
        return padded
    return rows


def _padded_rows(xq: torch.Tensor, n: int) -> torch.Tensor:
    """``xq`` (FP8 rows into ``n`` outputs) with zero rows appended up to ``cublas_rows``
    (bytes 0 are e4m3 zeros, so their sums are 0)."""
    padding = cublas_rows(xq.shape[0], n, xq.device) - xq.shape[0]
    if not padding:
        return xq
    return F.pad(xq.view(torch.uint8), (0, 0, 0, padding)).view(FP8_DTYPE)


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on ``device``: cuBLASLt's one scale for a whole operand. Kept from the
    first call outside a CUDA graph's capture (inside one, a new tensor is filled by the
    graph itself)."""
    scale = _UNIT_SCALES.get(device)
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _UNIT_SCALES[device] = scale
    return scale


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
               *, sums: bool = False) -> torch.Tensor | Fp8Sums:
    """``x @ dequant(weight).T + bias`` with ``x`` quantized per token, or with the static
    ``input_scale`` when given; ``x [T, K]`` in the model's dtype (or ``Fp8Rows``, already
    quantized for this product), ``weight [N, K]`` float8_e4m3fn, ``weight_scale [N, 1]``
    float32. Returns ``[T, N]`` in ``x``'s dtype.

    ``sums=True`` (the caller's consumer scales sums, see ``Fp8Sums``): where cuBLASLt
    multiplies a 2-D bfloat16 ``x`` on Hopper without a bias, the product comes back as
    ``Fp8Sums``, its scales not applied, unless ``PAGEDLLM_FP8_DEFERRED_SCALES=0``. Only
    bfloat16 holds the unscaled sums (up to 448 x 448 x K; float16 ends at 65,504)."""
    if isinstance(x, Fp8Rows):
        if input_scale is not None:
            raise ValueError("fp8_linear: Fp8Rows are quantized already (with the static "
                             "scale, if any): pass input_scale=None.")
        xq, x_scale, dtype = x
        shape = xq.shape
    else:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        quantize = quantize_rows_fp8 if use_fused_ops(x2) else quantize_rows
        xq, x_scale = quantize(x2, input_scale)
    tensor_cores = _fp8_matmul_supported(xq.device) and dtype in (torch.bfloat16, torch.float16)
    if (sums and DEFERRED_SCALES and tensor_cores and dtype == torch.bfloat16 and bias is None
            and len(shape) == 2 and is_hopper(xq.device)
            and not split_k_product(xq.shape[0], weight.shape[0], xq.device)):
        rows = xq.shape[0]
        unit = _unit_scale(xq.device)
        products = torch._scaled_mm(_padded_rows(xq, weight.shape[0]), weight.t(),
                                    scale_a=unit, scale_b=unit, out_dtype=dtype,
                                    use_fast_accum=FAST_ACCUM)
        return Fp8Sums(products[:rows], x_scale.expand(rows, 1), weight_scale.reshape(-1, 1))
    if tensor_cores and split_k_product(xq.shape[0], weight.shape[0], xq.device):
        from pagedllm.layers.fp8_matmul import fp8_matmul  # kernels load on first use

        out = fp8_matmul(xq, x_scale, weight, weight_scale, bias, dtype)
    elif tensor_cores:
        rows = xq.shape[0]
        xq = _padded_rows(xq, weight.shape[0])
        x_scale = x_scale.contiguous()
        if xq.shape[0] > rows:  # the padding rows' sums are 0: any scale will do
            x_scale = F.pad(x_scale, (0, 0, 0, xq.shape[0] - rows), value=1.0)
        # Row-wise scales need a bfloat16 result.
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale,
                               scale_b=weight_scale.t(),
                               bias=None if bias is None else bias.to(torch.bfloat16),
                               out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)[:rows].to(dtype)
    else:
        out = dequantize_rows(xq, x_scale) @ dequantize_rows(weight, weight_scale).t()
        if bias is not None:
            out = out + bias.float()
        out = out.to(dtype)
    return out.reshape(*shape[:-1], weight.shape[0])


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` -> (float8_e4m3fn ``[R, C]``, float32 scales ``[R, cdiv(C, group)]``):
    one scale per row and group of ``group`` columns, each group's largest magnitude mapped
    to 448 (the last group may be narrower)."""
    rows, columns = x.shape
    groups = -(-columns // group)
    padded = F.pad(x.float(), (0, groups * group - columns)).view(rows, groups, group)
    scale = divide_exactly(padded.abs().amax(dim=-1), FP8_MAX).clamp_(min=_MIN_SCALE)
    quantized = (padded * scale[..., None].reciprocal()).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(rows, groups * group)[:, :columns].contiguous(), scale


def dequantize_blocks(quantized: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """float32 values of ``quantized [R, C]`` whose ``scale [cdiv(R, rows), cdiv(C, columns)]``
    holds one value per ``block = (rows, columns)`` (``(1, group)``: rows quantized per
    group, as ``quantize_groups`` gives them)."""
    rows, columns = quantized.shape
    expanded = scale.float().repeat_interleave(block[0], dim=0)[:rows]
    return quantized.float() * expanded.repeat_interleave(block[1], dim=1)[:, :columns]


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` for block-wise FP8 weights (``weight [N, K]``
    float8_e4m3fn, ``weight_scale [cdiv(N, block[0]), cdiv(K, block[1])]`` float32), ``x
    [T, K]`` quantized per token and group of ``block[1]`` inputs. On GPUs with FP8 tensor
    cores the Triton kernels of ``layers.fp8_block_matmul`` quantize and multiply;
    elsewhere the dequantized operands are multiplied in float32 (the reference). Returns ``[T, N]`` in ``x``'s dtype."""
    shape, dtype = x.shape, x.dtype
    x2 = x.reshape(-1, shape[-1])
    if _fp8_matmul_supported(x.device) and dtype in (torch.bfloat16, torch.float16):
        from pagedllm.layers.fp8_block_matmul import block_fp8_matmul, quantize_groups_fp8

        xq, x_scale = quantize_groups_fp8(x2, block[1])
        out = block_fp8_matmul(xq, x_scale, weight, weight_scale, block, bias, dtype)
    else:
        xq, x_scale = quantize_groups(x2, block[1])
        out = dequantize_blocks(xq, x_scale, (1, block[1])) @ dequantize_blocks(
            weight, weight_scale, block).t()
        if bias is not None:
            out = out + bias.float()
        out = out.to(dtype)
    return out.reshape(*shape[:-1], weight.shape[0])
