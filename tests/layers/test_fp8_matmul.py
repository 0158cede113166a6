"""FP8 W8A8 products of decode batches with ``K`` split over programs (``layers.fp8_matmul``,
under the interpreter without a GPU): the dequantized operands' product, whatever the
split."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.fp8_matmul import Fp8Tile, fp8_matmul, fp8_matmul_tile
from pagedllm.quantization.fp8 import FP8_MAX, dequantize_rows, quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, n, k, tile", [
    (1, 70, 200, Fp8Tile(16, 32, 32, 4, 2)),        # one row; ragged column and K tiles
    (40, 130, 256, Fp8Tile(16, 64, 64, 4, 2, 4)),   # K in four slices, row tiles share weights
    (150, 96, 384, Fp8Tile(64, 32, 32, 4, 2, 3)),   # three slices, a partial row tile
    (150, 96, 384, None),                           # the configured tile
    (3, 70, 256, Fp8Tile(16, 32, 64, 4, 2, 2, swap=True)),  # weights on the wide side
    (12, 96, 512, None),                            # the configured tile of a few rows
])
def test_fp8_matmul_is_the_dequantized_product(rows, n, k, tile):
    gen = torch.Generator().manual_seed(rows + (tile.split if tile else 0))
    x = torch.randn(rows, k, generator=gen) * torch.linspace(0.1, 30, k)
    x[rows // 2] *= 1e-4  # a row of small values keeps its own scale
    a, a_scale = quantize_rows(x)
    b = ((torch.rand(n, k, generator=gen) * 2 - 1) * FP8_MAX).to(torch.float8_e4m3fn)
    b_scale = torch.rand(n, 1, generator=gen) * 0.01 + 1e-3
    bias = torch.randn(n, generator=gen)
    values_a, values_b = dequantize_rows(a, a_scale).double(), dequantize_rows(b, b_scale).double()
    product = values_a @ values_b.t()
    # Each K step's products summed on the tensor cores (about 14 bits kept within it), the
    # steps and slices in float32: every output within 2**-12 of its products' magnitudes.
    bound = 2**-12 * (values_a.abs() @ values_b.abs().t()) + 1e-6
    for _ in range(2):  # the counters are back at zero after a launch
        got = fp8_matmul(a.to(DEVICE), a_scale.to(DEVICE), b.to(DEVICE), b_scale.to(DEVICE),
                         bias.to(DEVICE), torch.float32, tile)
        assert ((got.cpu().double() - product - bias.double()).abs() <= bound).all()
    got = fp8_matmul(a.to(DEVICE), a_scale.to(DEVICE), b.to(DEVICE), b_scale.to(DEVICE),
                     None, torch.bfloat16, tile)
    assert ((got.cpu().double() - product).abs() <= 2**-7 * product.abs() + bound).all()


def test_configured_tiles_split_narrow_outputs_of_decode_batches():
    """K in four slices while the launch stays within two programs per SM of an H200, else
    in two; slices of at least four steps."""
    assert fp8_matmul_tile(64, 4096, 14336).split == 4      # 64 tiles
    assert fp8_matmul_tile(128, 4096, 4096).split == 2      # 128 tiles
    assert fp8_matmul_tile(176, 4096, 14336).split == 2
    assert fp8_matmul_tile(128, 4096, 384).split == 1       # three steps of K
    # Up to 16 rows the weights take the tensor cores' wide side, K in two for narrow outputs.
    narrow = fp8_matmul_tile(16, 4096, 14336)
    assert narrow.swap and narrow.split > 1
    assert fp8_matmul_tile(9, 6144, 4096).split == 1
    assert not fp8_matmul_tile(17, 4096, 4096).swap


def test_fp8_matmul_refuses_operands_it_does_not_take():
    a = torch.zeros(4, 32, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.zeros(8, 32, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="float8_e4m3fn operands"):
        fp8_matmul(a, torch.ones(4, device=DEVICE), b, torch.ones(8, device=DEVICE), None,
                   torch.float32)
    with pytest.raises(ValueError, match="SPLIT must divide"):
        fp8_matmul(a, torch.ones(4, device=DEVICE), a.repeat(2, 1), torch.ones(8, device=DEVICE),
                   None, torch.float32, Fp8Tile(16, 16, 16, 4, 2, 3))
