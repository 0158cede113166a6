"""Block-wise FP8 products: the Triton kernel (under the interpreter without a GPU) gives the
dequantized reference's values, and the reference is the product a block-wise checkpoint
describes."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.fp8_block_matmul import block_fp8_matmul, quantize_groups_fp8
from pagedllm.quantization.fp8 import (
    FP8_MAX,
    dequantize_blocks,
    fp8_block_linear,
    quantize_groups,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def block_weights(n: int, k: int, block: tuple[int, int], seed: int):
    """Random FP8 weights ``[n, k]`` and a scale per block, each block's own magnitude."""
    gen = torch.Generator().manual_seed(seed)
    blocks = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(blocks, generator=gen) * 0.01 + 1e-3
    codes = (torch.rand(n, k, generator=gen) * 2 - 1) * FP8_MAX
    return codes.to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("rows, n, k, block", [
    (1, 96, 256, (32, 64)),     # one row; output tiles straddle weight blocks
    (5, 200, 150, (64, 32)),    # ragged last blocks of rows and columns
    (40, 130, 128, (128, 128)), # a prompt's rows, Qwen3's and DeepSeek-V3's blocks
])
def test_kernel_gives_the_dequantized_product(rows, n, k, block):
    weight, scale = block_weights(n, k, block, seed=rows)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, k, generator=gen) * torch.linspace(0.1, 30, k)  # groups' own sizes
    xq, x_scale = quantize_groups(x, block[1])
    bias = torch.randn(n, generator=gen)
    weight_values = dequantize_blocks(weight, scale, block)
    want = dequantize_blocks(xq, x_scale, (1, block[1])) @ weight_values.t() + bias
    got = block_fp8_matmul(xq.to(DEVICE), x_scale.to(DEVICE), weight.to(DEVICE),
                           scale.to(DEVICE), block, bias.to(DEVICE), torch.float32)
    # Hopper's FP8 tensor cores keep about 14 bits of a sum within an instruction chain (the
    # kernel adds each group's sum to float32 itself): each output within 2**-12 of its
    # products' magnitudes (2**-13.5 measured on an H200 at 40 rows).
    magnitude = dequantize_blocks(xq, x_scale, (1, block[1])).abs() @ weight_values.abs().t()
    assert ((got.cpu() - want).abs() <= 2**-12 * magnitude + 1e-3).all()


def test_groups_quantize_each_to_its_own_largest_value():
    x = torch.tensor([[1.0, -2.0, 0.0, 300.0, 5.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_groups(x, 2)
    assert scale.shape == (2, 3)
    torch.testing.assert_close(scale[0], torch.tensor([2.0, 300.0, 5.0]) / FP8_MAX)
    assert q[0].float().abs().amax() == FP8_MAX and not q[1].float().any()
    torch.testing.assert_close(dequantize_blocks(q, scale, (1, 2)), x, rtol=0.07, atol=0)


@pytest.mark.parametrize("group", [128, 48])
def test_group_quantization_kernel_gives_quantize_groups_bytes(group):
    """Rows of other magnitudes and a zero row; 300 columns: the last group is partial."""
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(9))
    x = x * torch.tensor([[1e-3], [1.0], [300.0], [0.0]])
    if not torch.cuda.is_available():
        # The interpreter's float32 -> e4m3 conversion mis-rounds values that round up into
        # the next power of two: inputs whose quantization is exact (FP8 values times a
        # power of two, each group's largest at the format's limit).
        exact, _ = quantize_groups(x, group)
        x = exact.float() * 2.0**-6
    got_q, got_scale = quantize_groups_fp8(x.to(DEVICE), group)
    want_q, want_scale = quantize_groups(x, group)
    assert torch.equal(got_scale.cpu(), want_scale)
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))


def test_block_linear_is_the_product_of_the_dequantized_weight():
    """Against the weight written out block by block: the product every block-wise FP8
    checkpoint describes, its input quantized per token and group."""
    block = (32, 64)
    weight, scale = block_weights(70, 200, block, seed=3)
    full = torch.empty(70, 200)
    for i in range(0, 70, 32):
        for j in range(0, 200, 64):
            full[i:i + 32, j:j + 64] = weight[i:i + 32, j:j + 64].float() * scale[i // 32, j // 64]
    x = torch.randn(2, 3, 200, dtype=torch.bfloat16)
    xq, x_scale = quantize_groups(x.reshape(6, 200), 64)
    want = (dequantize_blocks(xq, x_scale, (1, 64)) @ full.t()).to(torch.bfloat16).reshape(2, 3, 70)
    got = fp8_block_linear(x, weight, scale, block)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 70)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
