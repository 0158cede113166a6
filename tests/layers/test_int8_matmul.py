"""INT8 W8A8 products of many rows (``layers.int8_matmul``, under the interpreter without a
GPU): exact int32 sums scaled once, the values of the int32 product scaled the same way."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.int8_matmul import Int8Tile, int8_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, n, k, tile", [
    (1, 70, 200, Int8Tile(16, 32, 32, 4, 2)),     # one row; ragged column and K tiles
    (40, 130, 256, Int8Tile(16, 64, 64, 4, 2)),   # several row tiles share a column tile
    (200, 96, 96, None),                          # the configured tile, a partial row tile
])
def test_int8_matmul_is_the_scaled_int32_product(rows, n, k, tile):
    gen = torch.Generator().manual_seed(rows)
    a = torch.randint(-128, 128, (rows, k), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    a_scale, b_scale = torch.rand(rows, 1, generator=gen), torch.rand(n, 1, generator=gen)
    bias = torch.randn(n, generator=gen)
    sums = (a.double() @ b.double().t()).float()  # exact: |sums| < 2**24
    want = sums * a_scale * b_scale.reshape(1, -1) + bias
    got = int8_matmul(a.to(DEVICE), a_scale.to(DEVICE), b.to(DEVICE), b_scale.to(DEVICE),
                      bias.to(DEVICE), torch.float32, tile)
    # The exact sums, scaled: within the float32 roundings of the scaling (a GPU fuses the
    # last multiply with the bias's add).
    torch.testing.assert_close(got.cpu(), want, rtol=2**-21, atol=2**-21 * want.abs().max().item())
    got = int8_matmul(a.to(DEVICE), a_scale.to(DEVICE), b.to(DEVICE), b_scale.to(DEVICE),
                      None, torch.bfloat16, tile)
    # One rounding to bfloat16 (the interpreter truncates where a GPU rounds to nearest).
    torch.testing.assert_close(got.cpu().float(), sums * a_scale * b_scale.reshape(1, -1),
                               rtol=2**-7, atol=0)


def test_int8_matmul_refuses_scales_that_are_not_one_a_row():
    a = torch.zeros(4, 32, dtype=torch.int8, device=DEVICE)
    b = torch.zeros(8, 32, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="one scale a row"):
        int8_matmul(a, torch.ones(1, device=DEVICE), b, torch.ones(8, device=DEVICE), None,
                    torch.float32)

