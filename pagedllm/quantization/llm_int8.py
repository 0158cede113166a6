"""bitsandbytes' LLM.int8 products: the 8-bit checkpoints transformers saves with
``BitsAndBytesConfig(load_in_8bit=True)`` (``pagedllm.quantization.bitsandbytes`` reads
them), multiplied as bitsandbytes' ``MatMul8bitLt`` multiplies one row.

A projection holds an int8 ``weight [N, K]`` and ``SCB [N]`` (float32: each row's largest
magnitude, the weight being ``q * SCB / 127``). For an input row ``x`` and the checkpoint's
``llm_int8_threshold`` ``t``:

1. ``h`` is ``x`` in float16; with ``t > 0`` its outliers are its values of magnitude
   ``t`` or more.
2. The other values are quantized: ``r`` is their largest magnitude, ``q = round(h * (127 /
   r))`` (float32, halves to even) in int8, 0 at the outliers.
3. ``out = (sum_k q w) * (r * SCB) * 6.200124e-05`` in float32 (bitsandbytes' constant for
   1 / 127**2), plus the bias, then ``x``'s dtype,
4. plus the outliers, unquantized, times their columns of ``w * SCB * (1 / 127)`` (rounded
   to ``x``'s dtype).

Every row is multiplied on its own: bitsandbytes takes a column unquantized in every row
of a product once any row holds an outlier there, so a row's result would depend on the
rows beside it (the other requests of a step, how a prompt is chunked, a cached prefix).
One row at a time, as HF transformers' decode steps run, the two are the same, bit for
bit on the CPU (``llm_int8_linear``'s reference: the integer sums exact).

On CUDA the integer sums run on the tensor cores (``layers.int8_matmul``, exact int32) and
the outliers ride on the same product, so CUDA graphs see one shape whatever they are: each
row's outliers, zero elsewhere, are written as two int8 rows (``v = s1 q1 + s2 q2`` to
about 2**-14 of the row's largest; bitsandbytes itself rounds those columns' weights to the
model's dtype, 2**-9 in bfloat16), stacked under the quantized rows (``stacked_rows``; one
kernel, ``triton_ops.quantize_rows_llm_int8``, but for a row-parallel projection, whose
rows' maxima come from the other ranks), and the three float32 products added (a prompt
step's rows in chunks, ``SUMS_BYTES`` of sums at a time).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.layers import triton_ops

RowMax = Callable[[torch.Tensor], torch.Tensor]

# bitsandbytes' constants: 1 / 127**2 for the integer sums, 1 / 127 for a weight.
SUMS_SCALE = 6.200124e-05
WEIGHT_SCALE = 7.874015718698502e-3
# The float32 sums of the stacked rows (three a token with outliers) are held at most this
# many bytes at a time: a prompt step's rows multiply in chunks past it (8,192 tokens of an
# 8B model's gate/up would otherwise hold 2.8 GB, which the memory profile then takes from
# the KV cache); each chunk reads the weight once more.
SUMS_BYTES = 256 << 20


def quantize_rows(x: torch.Tensor, threshold: float, whole_row_max: RowMax | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x [M, K]`` -> (int8 ``[M, K]``, 0 at the outliers; each row's largest magnitude
    below ``threshold`` (float32 ``[M]``); the outliers (bool ``[M, K]``, None with
    ``threshold == 0``)): steps 1 and 2 of the module docstring. ``whole_row_max``: ``x``
    holds part of each row (a row-parallel projection's columns), and this gives the
    whole rows' largest magnitudes from the part's."""
    h = x.to(torch.float16)
    outliers = None
    if threshold > 0:
        outliers = h.abs() >= threshold
        h = h.masked_fill(outliers, 0)
    row_max = h.abs().amax(dim=1).float()
    if whole_row_max is not None:
        row_max = whole_row_max(row_max)
    inverse = torch.where(row_max > 0, 127.0 / row_max, torch.zeros_like(row_max))
    return torch.round(h * inverse[:, None]).to(torch.int8), row_max, outliers


def llm_int8_linear(x: torch.Tensor, weight: torch.Tensor, scb: torch.Tensor, threshold: float,
                    bias: torch.Tensor | None = None, whole_row_max: RowMax | None = None
                    ) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` in ``x``'s dtype for the int8 ``weight [N, K]`` with
    bitsandbytes' row maxima ``scb`` (``[N]`` or ``[N, 1]``, float32): the module
    docstring's product (``whole_row_max`` as ``quantize_rows`` takes it)."""
    rows = x.reshape(-1, x.shape[-1])
    scb = scb.reshape(-1).float()
    product = _kernel_product if triton_ops.use_fused_ops(rows) else _reference_product
    out = product(rows, weight, scb, threshold, bias, whole_row_max)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _reference_product(rows: torch.Tensor, weight: torch.Tensor, scb: torch.Tensor,
                       threshold: float, bias: torch.Tensor | None,
                       whole_row_max: RowMax | None = None) -> torch.Tensor:
    quantized, row_max, outliers = quantize_rows(rows, threshold, whole_row_max)
    sums = (quantized.double() @ weight.double().t()).float()  # exact integers
    out = sums * (row_max[:, None] * scb[None, :]) * SUMS_SCALE
    if bias is not None:
        out = out + bias.float()
    out = out.to(rows.dtype)
    if outliers is not None:
        # The columns holding some row's outliers; on CUDA every column (no host sync).
        columns = slice(None) if rows.is_cuda else outliers.any(dim=0)
        outlier_weight = (weight[:, columns].float() * scb[:, None] * WEIGHT_SCALE).to(rows.dtype)
        out = out.addmm(rows[:, columns] * outliers[:, columns], outlier_weight.t())
    return out


def _kernel_product(rows: torch.Tensor, weight: torch.Tensor, scb: torch.Tensor,
                    threshold: float, bias: torch.Tensor | None,
                    whole_row_max: RowMax | None = None) -> torch.Tensor:
    from pagedllm.layers.int8_matmul import int8_matmul  # kernels load on first use

    if whole_row_max is None:
        stacked, scales = triton_ops.quantize_rows_llm_int8(rows, threshold, SUMS_SCALE,
                                                            WEIGHT_SCALE)
    else:  # the whole rows' maxima come from the other ranks, between the passes
        stacked, scales = stacked_rows(rows, threshold, whole_row_max)
    num_rows, n = rows.shape[0], weight.shape[0]
    groups = stacked.shape[0] // max(num_rows, 1)

    def summed(part_rows: torch.Tensor, part_scales: torch.Tensor) -> torch.Tensor:
        sums = int8_matmul(part_rows, part_scales, weight, scb, None, torch.float32)
        return sums.view(groups, -1, n).sum(dim=0)

    chunk = max(1, SUMS_BYTES // (groups * n * 4))
    if chunk >= num_rows:  # decode steps: no copy of the rows or of the sums
        out = summed(stacked, scales)
    else:  # the rows in chunks: each chunk's groups stacked, their float32 sums bounded
        out = torch.empty((num_rows, n), dtype=torch.float32, device=rows.device)
        stacked, scales = stacked.view(groups, num_rows, -1), scales.view(groups, num_rows)
        for start in range(0, num_rows, chunk):
            part = slice(start, start + chunk)
            out[part] = summed(stacked[:, part].reshape(-1, stacked.shape[-1]),
                               scales[:, part].reshape(-1))
    if bias is not None:
        out = out + bias.float()
    return out.to(rows.dtype)


def stacked_rows(rows: torch.Tensor, threshold: float, whole_row_max: RowMax | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the tensor-core product (module docstring): int8 ``[R * M, K]`` and
    float32 scales ``[R * M]``, the codes and their rows' largest magnitudes times
    ``SUMS_SCALE``, then with outliers (R = 3, else 1) each row's outliers as two int8 rows
    (``_int8_rows``: the values, then what the first leaves) with scales times
    ``WEIGHT_SCALE``. ``triton_ops.quantize_rows_llm_int8`` computes the same in one
    kernel."""
    quantized, row_max, outliers = quantize_rows(rows, threshold, whole_row_max)
    stacked, scales = [quantized], [row_max * SUMS_SCALE]
    if outliers is not None:
        outlier_values = torch.where(outliers, rows.float(), 0.0)
        high, high_scale = _int8_rows(outlier_values)
        low, low_scale = _int8_rows(outlier_values - high.float() * high_scale[:, None])
        stacked += [high, low]
        scales += [high_scale * WEIGHT_SCALE, low_scale * WEIGHT_SCALE]
    return torch.cat(stacked), torch.cat(scales)


def _int8_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``values [M, K]`` as int8 rows times float32 scales (``values ~ q * scale``,
    each row's largest magnitude at 127; a row of zeros: scale 0)."""
    scale = values.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = torch.round(values / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return quantized, scale
