"""The integer-weight matmul kernel computes the torch reference's product (CPU under the
interpreter): prompt-sized tiles and split-K small batches, 4 and 8 bits, groups and
per-channel scales, zero points, act-order permutations and biases."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers import int_matmul
from pagedllm.layers.int_matmul import IntTile, int_dequantize, int_linear, int_matmul_config
from pagedllm.quantization.int_weights import (
    dequantize,
    int_linear_reference,
    num_groups,
    pack_rows,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16
# The interpreter multiplies bf16 tiles of tl.dot as raw 16-bit integers: bfloat16 natively.
DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the interpreter's bf16 tl.dot"))]


def packed_projection(n: int, k: int, bits: int, group_size: int, seed: int,
                      act_order: bool = False, dtype: torch.dtype = DTYPE):
    """Random codes, zero points and scales of an ``[n, k]`` projection in the stored
    layout, with a random act-order permutation when asked."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    groups = num_groups(k, group_size)
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen).to(torch.uint8)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.005).to(dtype)
    perm = torch.randperm(k, generator=gen).to(torch.int32) if act_order else None
    return (pack_rows(codes, bits).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE),
            None if perm is None else perm.to(DEVICE))


def _reference(x, qweight, scales, zeros, bits, group_size, bias=None, perm=None):
    """The reference's weights (dequantized, rounded once to ``x``'s dtype, back in input
    order) times ``x`` in float32."""
    weight = dequantize(qweight, scales, zeros, bits, group_size, x.shape[1], x.dtype).float()
    if perm is not None:
        weight[:, perm.long()] = weight.clone()
    out = x.float() @ weight.T
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize("rows, tile", [
    (3, IntTile(16, 32, 32, 2, 4, 2)),   # a decode batch: split-K into two slices
    (1, IntTile(16, 32, 16, 4, 4, 2)),   # one row, four slices
    (1, IntTile(1, 32, 32, 2, 4, 2)),    # one row, lane-wise products, two slices
    (37, IntTile(32, 32, 32, 1, 4, 2)),  # a prompt: partial row and column tiles
])
@pytest.mark.parametrize("bits, group_size, act_order", [
    (4, 32, False), (4, 64, True), (4, -1, False), (8, 32, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int_matmul_equals_the_dequantized_product(rows, tile, bits, group_size, act_order,
                                                   dtype):
    n, k = 48, 128  # 48 outputs: one and a half 32-wide column tiles
    qweight, scales, zeros, perm = packed_projection(n, k, bits, group_size, seed=rows,
                                                     act_order=act_order, dtype=dtype)
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    want = _reference(x, qweight, scales, zeros, bits, group_size, bias, perm)
    got = int_matmul.int_matmul(x, qweight, scales, zeros, tile, bits=bits,
                                group_size=group_size, bias=bias, perm=perm)
    assert got.dtype == dtype and got.shape == (rows, n)
    # The same weights, products summed in float32 in another order, rounded to the dtype.
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_split_k_rows_do_not_depend_on_the_batch():
    qweight, scales, zeros, _ = packed_projection(32, 128, 4, 32, seed=9)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(10)).to(DEVICE, DTYPE)
    tile = IntTile(16, 32, 32, 4, 4, 2)
    alone = int_matmul.int_matmul(x[2:3], qweight, scales, zeros, tile, bits=4, group_size=32)
    batch = int_matmul.int_matmul(x, qweight, scales, zeros, tile, bits=4, group_size=32)
    assert torch.equal(batch[2:3], alone)


def test_tiles_fit_the_groups_and_split_small_batches():
    # Llama-3.1-8B's down projection, groups of 128: decode splits K, prompts do not.
    decode = int_matmul_config(16, 4096, 14336, 128, 132)
    assert decode.block_m == 16 and decode.split > 1 and 128 % decode.block_k == 0
    assert (14336 // decode.block_k) % decode.split == 0
    batch = int_matmul_config(128, 4096, 14336, 128, 132)
    assert batch.split == 1 and batch.block_m == 64
    assert int_matmul_config(16, 64, 352, -1, 132).block_k == 32  # per channel: K's divisor
    assert int_matmul_config(16, 64, 100, 100, 132) is None  # no tile divides 100


def test_shapes_that_do_not_tile_take_the_reference(monkeypatch):
    """A CUDA-like input whose K (100) no tile divides falls back to the exact reference;
    one that tiles takes the kernel."""
    launched = []
    monkeypatch.setattr(int_matmul, "use_fused_ops", lambda x: True)  # as on a GPU
    real = int_matmul.int_matmul
    monkeypatch.setattr(int_matmul, "int_matmul",
                        lambda *a, **kw: launched.append(a[0].shape) or real(*a, **kw))
    x = torch.randn(2, 100, generator=torch.Generator().manual_seed(1)).to(DEVICE, DTYPE)
    qweight, scales, zeros, _ = packed_projection(16, 100, 4, 100, seed=2)
    got = int_linear(x, qweight, scales, zeros, bits=4, group_size=100, in_features=100)
    want = int_linear_reference(x, qweight, scales, zeros, bits=4, group_size=100,
                                in_features=100)
    assert launched == [] and torch.equal(got, want)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE, DTYPE)
    qweight, scales, zeros, _ = packed_projection(16, 64, 4, 32, seed=4)
    got = int_linear(x, qweight, scales, zeros, bits=4, group_size=32, in_features=64)
    assert launched == [(2, 64)]
    torch.testing.assert_close(got.float(), _reference(x, qweight, scales, zeros, 4, 32),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, -1)])
def test_int_dequantize_writes_the_references_weights(bits, group_size):
    qweight, scales, zeros, _ = packed_projection(40, 128, bits, group_size, seed=5)
    got = int_dequantize(qweight, scales, zeros, bits=bits, group_size=group_size,
                         in_features=128, dtype=DTYPE)
    want = dequantize(qweight, scales, zeros, bits, group_size, 128, DTYPE)
    assert torch.equal(got, want)


def test_prompt_sized_steps_dequantize_once_then_multiply(monkeypatch):
    """More than DEQUANTIZE_ROWS rows: one dequantizing launch, the act-order gather on the
    activation, and BLAS; the kernel's row tiles are not used."""
    monkeypatch.setattr(int_matmul, "use_fused_ops", lambda x: True)  # as on a GPU
    monkeypatch.setattr(int_matmul, "DEQUANTIZE_ROWS", 8)
    monkeypatch.setattr(int_matmul, "int_matmul", lambda *a, **k: pytest.fail("row tiles"))
    qweight, scales, zeros, perm = packed_projection(24, 64, 4, 32, seed=6, act_order=True)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(7)).to(DEVICE, DTYPE)
    got = int_linear(x, qweight, scales, zeros, bits=4, group_size=32, in_features=64, perm=perm)
    torch.testing.assert_close(got.float(), _reference(x, qweight, scales, zeros, 4, 32, perm=perm),
                               rtol=2e-3, atol=2e-3)
