"""The quantized small-batch sweep's candidate tiles all fit the shapes it times (so the
GPU run spends its budget on timings, not on launches refused for their shape)."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # the script imports Triton kernels: as the kernel tests do

from pagedllm.layers.triton_ops import _int_tile_fits  # noqa: E402
from tests.benchmarks.gpu_report import load_script  # noqa: E402

sweep = load_script("gemv_quant_sweep")


@pytest.mark.parametrize("kind", ["int4", "fp8", "int8", "bf16"])
@pytest.mark.parametrize("rows", [1, 4])
def test_every_candidate_tiles_the_projection(kind, rows):
    for _, n, k in sweep.GEMV_SHAPES[:4]:
        tiles = sweep.candidates(kind, rows, k)
        assert tiles and len(set(tiles)) == len(tiles)
        for tile in tiles:
            assert (k // tile.block_k) % tile.split == 0 and k // tile.block_k // tile.split >= 2
            assert tile.use_dot or rows == 1  # lane-wise tiles serve one row
            if kind == "int4":
                assert _int_tile_fits(tile, k, sweep.GROUP)
        assert any(t.split > 1 for t in tiles)  # split-K is in the grid


@pytest.mark.parametrize("rows", [64, 128, 256])
def test_int_gemm_candidates_tile_the_projections(rows):
    tiles = sweep.int_gemm_candidates(rows)
    assert tiles and all(t.block_m <= rows for t in tiles) and len(set(tiles)) == len(tiles)
    # A batch of 256 tries whole-batch tiles (each weight tile dequantized once) first.
    assert (tiles[0].block_m == 256) == (rows >= 256)
    for _, n, k in sweep.GEMV_SHAPES[:4]:
        assert all(k % t.block_k == 0 and sweep.GROUP % t.block_k == 0
                   and (k // t.block_k) % t.split == 0 for t in tiles)
