"""INT8 W8A8 products of many rows (``layers.w8a8_matmul``, under the interpreter without a
GPU): exact int32 sums scaled once, the values of the int32 product scaled the same way."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.w8a8_matmul import W8A8Tile, w8a8_matmul
from pagedllm.quantization.fp8 import FP8_MAX, dequantize_rows, quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, n, k, tile", [
    (1, 70, 200, W8A8Tile(16, 32, 32, 4, 2)),     # one row; ragged column and K tiles
    (40, 130, 256, W8A8Tile(16, 64, 64, 4, 2)),   # several row tiles share a column tile
    (200, 96, 96, None),                          # the configured tile, a partial row tile
])
def test_w8a8_matmul_is_the_scaled_int32_product(rows, n, k, tile):
    gen = torch.Generator().manual_seed(rows)
    a = torch.randint(-128, 128, (rows, k), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    a_scale, b_scale = torch.rand(rows, 1, generator=gen), torch.rand(n, 1, generator=gen)
    bias = torch.randn(n, generator=gen)
    sums = (a.double() @ b.double().t()).float()  # exact: |sums| < 2**24
    want = sums * a_scale * b_scale.reshape(1, -1) + bias
    got = w8a8_matmul(a.to(DEVICE), a_scale.to(DEVICE), b.to(DEVICE), b_scale.to(DEVICE),
                      bias.to(DEVICE), torch.float32, tile)
    # The exact sums, scaled: within the float32 roundings of the scaling (a GPU fuses the
    # last multiply with the bias's add).
    torch.testing.assert_close(got.cpu(), want, rtol=2**-21, atol=2**-21 * want.abs().max().item())
    got = w8a8_matmul(a.to(DEVICE), a_scale.to(DEVICE), b.to(DEVICE), b_scale.to(DEVICE),
                      None, torch.bfloat16, tile)
    # One rounding to bfloat16 (the interpreter truncates where a GPU rounds to nearest).
    torch.testing.assert_close(got.cpu().float(), sums * a_scale * b_scale.reshape(1, -1),
                               rtol=2**-7, atol=0)


def test_w8a8_matmul_refuses_scales_that_are_not_one_a_row():
    a = torch.zeros(4, 32, dtype=torch.int8, device=DEVICE)
    b = torch.zeros(8, 32, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="one scale a row"):
        w8a8_matmul(a, torch.ones(1, device=DEVICE), b, torch.ones(8, device=DEVICE), None,
                    torch.float32)



@pytest.mark.parametrize("rows, n, k, tile", [
    (1, 70, 200, W8A8Tile(16, 32, 32, 4, 2)),     # one row; ragged column and K tiles
    (40, 130, 256, W8A8Tile(16, 64, 64, 4, 2)),   # several row tiles share a column tile
    (150, 96, 384, None),                         # the configured tile, a partial row tile
])
def test_fp8_operands_give_the_dequantized_product(rows, n, k, tile):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen) * torch.linspace(0.1, 30, k)
    x[rows // 2] *= 1e-4  # a row of small values keeps its own scale
    a, a_scale = quantize_rows(x)
    b = ((torch.rand(n, k, generator=gen) * 2 - 1) * FP8_MAX).to(torch.float8_e4m3fn)
    b_scale = torch.rand(n, 1, generator=gen) * 0.01 + 1e-3
    bias = torch.randn(n, generator=gen)
    values_a, values_b = dequantize_rows(a, a_scale), dequantize_rows(b, b_scale)
    want = values_a.double() @ values_b.double().t() + bias.double()
    got = w8a8_matmul(a.to(DEVICE), a_scale.to(DEVICE), b.to(DEVICE), b_scale.to(DEVICE),
                      bias.to(DEVICE), torch.float32, tile)
    # Each K step's products summed on the tensor cores (about 14 bits kept within it),
    # then in float32: every output within 2**-12 of its products' magnitudes.
    magnitude = values_a.double().abs() @ values_b.double().abs().t()
    assert ((got.cpu().double() - want).abs() <= 2**-12 * magnitude + 1e-6).all()
    got = w8a8_matmul(a.to(DEVICE), a_scale.to(DEVICE), b.to(DEVICE), b_scale.to(DEVICE),
                      None, torch.bfloat16, tile)
    assert ((got.cpu().double() - (want - bias.double())).abs()
            <= 2**-7 * (want - bias.double()).abs() + 2**-12 * magnitude + 1e-6).all()


def test_w8a8_matmul_refuses_mixed_operands():
    a = torch.zeros(4, 32, dtype=torch.int8, device=DEVICE)
    b = torch.zeros(8, 32, device=DEVICE).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn operands of one dtype"):
        w8a8_matmul(a, torch.ones(4, device=DEVICE), b, torch.ones(8, device=DEVICE), None,
                    torch.float32)
