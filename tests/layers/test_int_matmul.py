"""The integer-weight matmul kernel computes the torch reference's product (CPU under the
interpreter): prompt-sized tiles and split-K small batches, 4 and 8 bits, groups and
per-channel scales, zero points, act-order permutations and biases."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers import int_matmul, triton_ops
from pagedllm.layers import linear as linear_module
from pagedllm.layers.int_matmul import (
    IntTile,
    WgmmaTile,
    int4_wgmma,
    int_dequantize,
    int_linear,
    int_matmul_config,
    wgmma_config,
)
from pagedllm.layers.triton_ops import GemvTile, IntWeights
from pagedllm.quantization import bitsandbytes
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


def _reference(x, qweight, scales, zeros, bits, group_size, bias=None, perm=None,
               weight_dtype=None):
    """The reference's weights (dequantized, rounded once to ``x``'s dtype or to
    ``weight_dtype``, back in input order) times ``x`` in float32."""
    weight = dequantize(qweight, scales, zeros, bits, group_size, x.shape[1],
                        weight_dtype or x.dtype).float()
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


HOPPER = torch.cuda.is_available() and int_matmul.is_hopper(torch.device("cuda"))


@pytest.mark.skipif(not HOPPER, reason="the wgmma kernel runs on Hopper GPUs")
@pytest.mark.parametrize("rows", [1, 5, 65, 128, 300])
@pytest.mark.parametrize("n, k, group_size", [(192, 512, 128), (320, 256, 64), (128, 448, -1),
                                              (128, 384, -1)])
@pytest.mark.parametrize("tile", [WgmmaTile(), WgmmaTile(block_m=64), WgmmaTile(block_k=128),
                                  WgmmaTile(block_m=256, stages=3),
                                  WgmmaTile(block_n=128, num_warps=8), WgmmaTile(paired=False),
                                  WgmmaTile(block_m=16, word_stages=8),
                                  WgmmaTile(block_m=64, block_k=128, word_stages=2),
                                  WgmmaTile(block_m=8, split=2),
                                  WgmmaTile(block_m=16, block_k=128, word_stages=2, split=2),
                                  WgmmaTile(block_m=8, block_k=128, split=4),
                                  WgmmaTile(block_m=8, split=8)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hopper_kernel_gives_the_dequantized_product(rows, n, k, group_size, tile, dtype):
    """Partial row and column tiles, groups of 64 and 128 and per channel, an odd number
    of steps over K (7), fewer steps than word stages, a bias; the weights made in float32
    or two at a time in half precision; K split in two slices (of an odd number of steps)
    or in four or eight."""
    if k % (tile.block_k * tile.split) or (group_size != -1 and group_size % tile.block_k):
        pytest.skip("the tile's steps do not divide K and the groups")
    qweight, scales, zeros, _ = packed_projection(n, k, 4, group_size, seed=rows + n,
                                                  dtype=dtype)
    gen = torch.Generator().manual_seed(200 + rows)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    got = int4_wgmma(x, qweight, scales, zeros, tile, group_size=group_size, bias=bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = _reference(x, qweight, scales, zeros, 4, group_size, bias)
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(not HOPPER, reason="the wgmma kernel runs on Hopper GPUs")
def test_hopper_split_tiles_replay_in_a_cuda_graph():
    """A split tile's last slice adds the slices and sets its tile's counter back, so
    launches captured in one CUDA graph and replayed give the product every time."""
    tile = WgmmaTile(block_m=8, block_k=128, split=4)
    qweight, scales, zeros, _ = packed_projection(512, 1024, 4, 128, seed=3,
                                                  dtype=torch.bfloat16)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(4)).to(DEVICE,
                                                                           torch.bfloat16)
    want = _reference(x, qweight, scales, zeros, 4, 128)
    first = int4_wgmma(x, qweight, scales, zeros, tile, group_size=128)
    torch.testing.assert_close(first.float(), want, rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [int4_wgmma(x, qweight, scales, zeros, tile, group_size=128) for _ in range(3)]
    for _ in range(5):
        for out in outs:
            out.zero_()
        graph.replay()
        for out in outs:  # the slices added in one order, whichever finished first
            assert torch.equal(out, first)
    assert not int_matmul.split_locks(x.device).any()


@pytest.mark.skipif(not HOPPER, reason="the wgmma kernel runs on Hopper GPUs")
def test_hopper_decode_batches_take_the_wgmma_kernel(monkeypatch):
    """Steps of up to WGMMA_MAX_ROWS rows run 4-bit weights on the wgmma kernel, act-order
    weights through the gathered activation; longer prompts and 8-bit weights keep the
    other kernels."""
    launched = []
    real = int_matmul.int4_wgmma
    monkeypatch.setattr(int_matmul, "int4_wgmma",
                        lambda *a, **kw: launched.append(a[0].shape) or real(*a, **kw))
    qweight, scales, zeros, perm = packed_projection(256, 512, 4, 128, seed=8, act_order=True,
                                                     dtype=torch.bfloat16)
    for rows in (5, 64, 200, int_matmul.WGMMA_MAX_ROWS + 1):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(
            DEVICE, torch.bfloat16)
        got = int_linear(x, qweight, scales, zeros, bits=4, group_size=128, in_features=512,
                         perm=perm)
        want = _reference(x, qweight, scales, zeros, 4, 128, perm=perm)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert launched == [(5, 512), (64, 512), (200, 512)]
    qweight8, scales8, zeros8, _ = packed_projection(256, 512, 8, 128, seed=9)
    x = torch.randn(100, 512, generator=torch.Generator().manual_seed(1)).to(DEVICE, DTYPE)
    int_linear(x, qweight8, scales8, zeros8, bits=8, group_size=128, in_features=512)
    assert len(launched) == 3


def test_the_wgmma_kernel_serves_hopper_4bit_steps_up_to_its_row_limit(monkeypatch):
    """Which steps ``wgmma_config`` sends to the Hopper kernel; every tile it picks tiles
    its shape (its steps divide ``K`` and the group)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(int_matmul, "is_hopper", lambda device: True)
    monkeypatch.setattr(int_matmul, "_sm_count", lambda device: 132)
    for rows in (1, 9, 64, 65, 128, 129, 300, int_matmul.WGMMA_MAX_ROWS):
        for n, k, group in ((6144, 4096, 128), (28672, 4096, 64), (4096, 14336, -1),
                            (4096, 4096, 64), (512, 448, -1)):
            tile = wgmma_config(rows, n, k, group, 4, cuda)
            assert tile is not None, (rows, n, k, group)
            assert k % tile.block_k == 0 and (k if group == -1 else group) % tile.block_k == 0
    assert wgmma_config(int_matmul.WGMMA_MAX_ROWS + 1, 4096, 4096, 128, 4, cuda) is None
    assert wgmma_config(256, 4096, 4096, 128, 8, cuda) is None  # 8-bit weights
    assert wgmma_config(256, 4096, 4096, 32, 4, cuda) is None  # groups under 64 inputs
    assert wgmma_config(256, 4096, 4000, -1, 4, cuda) is None  # K in no whole 64-input steps
    monkeypatch.setenv(int_matmul.INT_WGMMA_ENV, "0")
    assert wgmma_config(256, 4096, 4096, 128, 4, cuda) is None
    monkeypatch.setattr(int_matmul, "is_hopper", lambda device: False)
    monkeypatch.delenv(int_matmul.INT_WGMMA_ENV)
    assert wgmma_config(256, 4096, 4096, 128, 4, cuda) is None


def test_decode_batches_of_up_to_64_rows_split_k_over_one_tile_of_rows(monkeypatch):
    """Up to ``WGMMA_SPLIT_ROWS`` rows of 4-bit weights on Hopper take one tile of 8 to 64
    rows, ``K`` split until about four programs an SM where the output is narrow, every
    slice whole steps of ``K`` in whole groups."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(int_matmul, "is_hopper", lambda device: True)
    monkeypatch.setattr(int_matmul, "_sm_count", lambda device: 132)
    llama = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336)}
    for name, (n, k) in llama.items():
        tile = wgmma_config(16, n, k, 128, 4, cuda)
        column_tiles = -(-n // tile.block_n)
        # Every SM gets two programs or more; an output wide enough to fill them twice is
        # not split.
        assert column_tiles * tile.split >= 2 * 132, name
        assert tile.split == 1 or column_tiles < 2 * 132, name
    for rows in (1, 8, 9, 16, 17, 33, 64):  # one tile of rows, at most twice the batch
        block_m = wgmma_config(rows, 4096, 4096, 128, 4, cuda).block_m
        assert rows <= block_m <= max(8, 2 * rows - 1), rows
    assert wgmma_config(65, 4096, 4096, 128, 4, cuda).split == 1
    for rows, n, k, group in [(3, 320, 448, 64), (16, 128, 384, -1), (40, 4096, 14336, 128)]:
        tile = wgmma_config(rows, n, k, group, 4, cuda)
        steps = k // tile.block_k
        assert steps % tile.split == 0 and (k if group == -1 else group) % tile.block_k == 0


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
    assert batch.block_m == 64 and (14336 // batch.block_k) % batch.split == 0
    assert int_matmul_config(128, 28672, 4096, 128, 132).split == 1  # wide: tiles enough
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


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(
    torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                             reason="the interpreter truncates to bfloat16"))])
@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, -1)])
def test_int_dequantize_writes_the_references_weights(bits, group_size, dtype):
    """Bit for bit; on a GPU 4-bit tiles are made in half-precision pairs."""
    qweight, scales, zeros, _ = packed_projection(40, 128, bits, group_size, seed=5,
                                                  dtype=dtype)
    got = int_dequantize(qweight, scales, zeros, bits=bits, group_size=group_size,
                         in_features=128, dtype=dtype)
    want = dequantize(qweight, scales, zeros, bits, group_size, 128, dtype)
    assert torch.equal(got, want)


def test_prompt_sized_steps_dequantize_once_then_multiply(monkeypatch):
    """More than DEQUANTIZE_ROWS rows: one dequantizing launch, the act-order gather on the
    activation, and BLAS; the kernel's row tiles are not used."""
    monkeypatch.setattr(int_matmul, "use_fused_ops", lambda x: True)  # as on a GPU
    monkeypatch.setenv(int_matmul.INT_WGMMA_ENV, "0")  # as off Hopper
    monkeypatch.setattr(int_matmul, "DEQUANTIZE_ROWS", 8)
    monkeypatch.setattr(int_matmul, "int_matmul", lambda *a, **k: pytest.fail("row tiles"))
    qweight, scales, zeros, perm = packed_projection(24, 64, 4, 32, seed=6, act_order=True)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(7)).to(DEVICE, DTYPE)
    got = int_linear(x, qweight, scales, zeros, bits=4, group_size=32, in_features=64, perm=perm)
    torch.testing.assert_close(got.float(), _reference(x, qweight, scales, zeros, 4, 32, perm=perm),
                               rtol=2e-3, atol=2e-3)


def test_every_decode_batch_size_gives_the_dequantized_product(monkeypatch):
    """Larger decode batches take the row tiles or dequantize once, by their rows and the
    output's width (``int_matmul.dequantizes``; the wide-output bound lowered to these
    shapes): every batch size, narrow or wide, act-order or not, gives the reference's
    product, and both ways are taken."""
    monkeypatch.setattr(int_matmul, "use_fused_ops", lambda x: True)  # as on a GPU
    monkeypatch.setenv(int_matmul.INT_WGMMA_ENV, "0")  # as off Hopper
    monkeypatch.setattr(int_matmul, "WIDE_OUTPUT", 64)
    ways = set()
    for name in ("int_dequantize", "int_matmul"):
        monkeypatch.setattr(int_matmul, name, (lambda f, name: lambda *a, **k: (
            ways.add(name), f(*a, **k))[1])(getattr(int_matmul, name), name))
    for n, rows, act_order in ((32, 40, False), (32, 70, True), (64, 70, False),
                               (64, 130, True)):
        qweight, scales, zeros, perm = packed_projection(n, 64, 4, 32, seed=rows + n,
                                                         act_order=act_order)
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(n)).to(DEVICE, DTYPE)
        got = int_linear(x, qweight, scales, zeros, bits=4, group_size=32, in_features=64,
                         perm=perm)
        torch.testing.assert_close(got.float(), _reference(x, qweight, scales, zeros, 4, 32,
                                                           perm=perm), rtol=2e-3, atol=2e-3)
    assert ways == {"int_dequantize", "int_matmul"}


@pytest.mark.parametrize("rows, tile", [
    (1, GemvTile(32, 32, 4, 2, False)),      # one row, lane-wise, the whole of K
    (1, GemvTile(32, 16, 4, 2, False, 4)),   # one row, K in four slices
    (3, GemvTile(32, 32, 4, 2, True, 2)),    # tensor-core tiles, two slices
])
@pytest.mark.parametrize("bits, group_size, act_order", [
    (4, 32, False), (4, 64, True), (4, -1, False), (8, 32, True)])
def test_small_batch_kernel_takes_integer_weights(monkeypatch, rows, tile, bits, group_size,
                                                  act_order):
    """Decode batches of a few rows: the small-batch kernel dequantizes the packed words as
    they stream in, plain, with a bias, with the SiLU gate of ``[gate; up]`` and with the
    norm riding on it, and equals the dequantized product (lane-wise, the weights stay in
    float32: the product of the float32 weights)."""
    monkeypatch.setattr(triton_ops, "small_batch_matmul_config", lambda *a, **kw: tile)
    n, k = 48, 128
    qweight, scales, zeros, perm = packed_projection(2 * n, k, bits, group_size, seed=rows,
                                                     act_order=act_order)
    ints = IntWeights(scales, zeros, bits, group_size, perm)
    gen = torch.Generator().manual_seed(200 + rows)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, DTYPE)
    bias = torch.randn(2 * n, generator=gen).to(DEVICE, DTYPE)
    want = _reference(x, qweight, scales, zeros, bits, group_size, bias, perm,
                      weight_dtype=None if tile.use_dot else torch.float32)
    got = triton_ops.small_batch_matmul(x, qweight, bias, int_weights=ints)
    assert got.dtype == DTYPE and got.shape == (rows, 2 * n)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)

    gate, up = want.to(DTYPE).float().chunk(2, dim=-1)
    gated = (torch.nn.functional.silu(gate).to(DTYPE).float() * up)
    got = triton_ops.small_batch_matmul(x, qweight, bias, silu_gated=True, int_weights=ints)
    torch.testing.assert_close(got.float(), gated, rtol=4e-3, atol=4e-3)

    norm_weight = torch.randn(2 * n, generator=gen).to(DEVICE, DTYPE)
    residual = torch.randn(rows, 2 * n, generator=gen).to(DEVICE, DTYPE)
    product = triton_ops.small_batch_matmul(x, qweight, int_weights=ints)
    want_normed, want_sum = triton_ops.rms_norm(product, norm_weight, 1e-6, residual)
    normed, summed = triton_ops.small_batch_matmul(x, qweight, norm=(norm_weight, 1e-6, residual),
                                                   int_weights=ints)
    assert torch.equal(summed, want_sum) and torch.equal(normed, want_normed)
    assert not triton_ops.arrival_counters(x.device, 1).any()  # every counter reset


@pytest.mark.parametrize("magnitude", [1e-5, 1.0, 3e4])
@pytest.mark.parametrize("act_order", [False, True])
def test_one_row_of_4bit_weights_at_any_input_magnitude(monkeypatch, magnitude, act_order):
    """One row of 4-bit weights equals the dequantized product whatever the row's
    magnitude: massive activations of tens of thousands (past float16's range once
    multiplied) and rows of 1e-5 alike, with one input 40 times the rest."""
    monkeypatch.setattr(triton_ops, "small_batch_matmul_config",
                        lambda *a, **kw: GemvTile(32, 64, 4, 2, False, 2))
    dtype = torch.bfloat16
    n, k = 64, 256
    qweight, scales, zeros, perm = packed_projection(n, k, 4, 64, seed=7, act_order=act_order,
                                                     dtype=dtype)
    ints = IntWeights(scales, zeros, 4, 64, perm)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(8))
    x[0, 5] = 40.0
    x = (x * magnitude).to(DEVICE, dtype)
    want = _reference(x, qweight, scales, zeros, 4, 64, perm=perm, weight_dtype=torch.float32)
    got = triton_ops.small_batch_matmul(x, qweight, int_weights=ints)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float() / magnitude, want / magnitude, rtol=8e-3, atol=8e-3)


def test_small_batch_integer_tiles_fit_the_groups_and_split_narrow_outputs():
    # Llama-3.1-8B's projections in groups of 128, one row: steps of one group, K split
    # until the launch fills the GPU, each slice whole steps.
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        tile = triton_ops.small_batch_matmul_config(1, n, k, int_bits=4, group=128)
        assert 128 % tile.block_k == 0 and not tile.use_dot
        assert (k // tile.block_k) % tile.split == 0 and k // tile.block_k // tile.split >= 2
    assert triton_ops.small_batch_matmul_config(1, 4096, 14336, int_bits=4, group=128).split > 1
    assert triton_ops.small_batch_matmul_config(4, 4096, 4096, int_bits=4, group=128).use_dot
    assert triton_ops.small_batch_matmul_config(1, 64, 100, int_bits=4, group=100) is None


def test_int_llama_mlp_of_one_row_runs_on_the_small_batch_kernel(monkeypatch):
    """A decode step of one sequence through a 4-bit Llama MLP: gate/up with the SiLU riding
    on it, then down with the norm after it, two launches of the small-batch kernel, and
    the layers' values (the dequantized weights' products)."""
    from pagedllm.layers.layernorm import RMSNorm, linear_and_norm
    from pagedllm.models.llama import LlamaArchConfig, LlamaMLP
    from pagedllm.quantization.checkpoint import IntWeightScheme

    hf = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
              num_attention_heads=4, hidden_act="silu")
    scheme = IntWeightScheme("gptq", bits=4, group_size=32)
    mlp = LlamaMLP(LlamaArchConfig.from_hf(hf, "llama")).to(DEVICE, DTYPE)
    dense = {}
    for name, proj, (n, k) in (("gate_up", mlp.gate_up_proj, (192, 64)),
                               ("down", mlp.down_proj, (64, 96))):
        proj.make_int(scheme)
        proj.qweight.data, proj.scales.data, proj.zeros.data, _ = packed_projection(
            n, k, 4, 32, seed=n)
        dense[name] = dequantize(proj.qweight, proj.scales, proj.zeros, 4, 32, k,
                                 torch.float32)
    norm = RMSNorm(64, eps=1e-5).to(DEVICE, DTYPE)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE, DTYPE)
    residual = torch.randn(1, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE, DTYPE)
    gate, up = (x.float() @ dense["gate_up"].T).to(DTYPE).float().chunk(2, -1)
    activated = (torch.nn.functional.silu(gate).to(DTYPE).float() * up).to(DTYPE)
    want_sum = ((activated.float() @ dense["down"].T).to(DTYPE) + residual).float()
    launches = []
    monkeypatch.setattr(triton_ops, "use_fused_ops", lambda t: True)  # as on a GPU
    real = triton_ops.small_batch_matmul
    monkeypatch.setattr(linear_module, "small_batch_matmul",
                        lambda x, w, *a, **kw: launches.append(tuple(w.shape)) or real(x, w, *a, **kw))
    monkeypatch.setattr(int_matmul, "int_matmul", lambda *a, **k: pytest.fail("split-K tiles"))
    monkeypatch.setattr(triton_ops, "rms_norm", lambda *a, **k: pytest.fail("a second launch"))
    normed, summed = linear_and_norm(mlp(x), mlp.down_proj, norm, residual)
    assert launches == [(192, 8), (64, 12)]  # packed words: 8 values a word
    torch.testing.assert_close(summed.float(), want_sum, rtol=1e-2, atol=1e-2)
    want = want_sum * torch.rsqrt(want_sum.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(normed.float(), want, rtol=2e-2, atol=2e-2)


def codebook_projection(n: int, k: int, seed: int, quant_type: str = "nf4"):
    """Random 4-bit codes and float32 block scales of an ``[n, k]`` projection in
    bitsandbytes' codebook (groups of 64), in the stored layout."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(n, k // 64, generator=gen) * 0.05 + 0.01
    return (pack_rows(codes, 4).to(DEVICE), scales.to(DEVICE),
            bitsandbytes.code_values(quant_type).to(DEVICE))


@pytest.mark.parametrize("rows, tile", [
    (3, IntTile(16, 32, 32, 2, 4, 2)),   # a decode batch: split-K into two slices
    (1, IntTile(1, 32, 64, 2, 4, 2)),    # one row, lane-wise products
    (37, IntTile(32, 32, 64, 1, 4, 2)),  # a prompt: partial row and column tiles
])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_codebook_weights_give_the_dequantized_product(rows, tile, quant_type):
    """bitsandbytes' NF4 and FP4 (``codebook[q] * scale``, no zero points) on the same
    kernel: the reference's product; and the dequantizing kernel writes its weights bit
    for bit."""
    n, k = 48, 128
    qweight, scales, codebook = codebook_projection(n, k, seed=rows, quant_type=quant_type)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, DTYPE)
    weight = dequantize(qweight, scales, None, 4, 64, k, DTYPE, codebook)
    got = int_matmul.int_matmul(x, qweight, scales, None, tile, bits=4, group_size=64,
                                codebook=codebook)
    torch.testing.assert_close(got.float(), x.float() @ weight.float().T, rtol=2e-3, atol=2e-3)
    assert torch.equal(int_dequantize(qweight, scales, None, bits=4, group_size=64,
                                      in_features=k, dtype=DTYPE, codebook=codebook), weight)


def test_codebook_weights_of_every_batch_size_take_the_kernels(monkeypatch):
    """Through ``int_linear`` as on a GPU: small batches (the split-K tiles), row tiles and
    the dequantize-then-BLAS steps all give the reference's product."""
    monkeypatch.setattr(int_matmul, "use_fused_ops", lambda x: True)  # as on a GPU
    monkeypatch.setattr(int_matmul, "DEQUANTIZE_ROWS", 32)
    qweight, scales, codebook = codebook_projection(32, 128, seed=3)
    for rows in (1, 5, 20, 40):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(DEVICE,
                                                                                      DTYPE)
        got = int_linear(x, qweight, scales, None, bits=4, group_size=64, in_features=128,
                         codebook=codebook)
        want = int_linear_reference(x, qweight, scales, None, bits=4, group_size=64,
                                    in_features=128, codebook=codebook)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
