#!/usr/bin/env python3
"""Time the small-batch product (``triton_ops.small_batch_matmul``) on quantized weights
over its tiles, split-K included, on Llama-3.1-8B's four layer projections, as a decode
step runs them: back to back inside a CUDA graph, cycling over enough weight copies that
none is in L2.

    python scripts/gemv_quant_sweep.py --out gemv_quant.json [--kinds int4,fp8|none] \
        [--rows 1,4] [--budget-s 300] [--int-gemm-rows 64,128,256]

Kinds: ``int4`` (GPTQ-style 4-bit weights in groups of 128, symmetric zero points, the
stored layout of ``pagedllm.quantization.int_weights``), ``fp8`` (W8A8, one scale per
row), ``int8`` (INT8 W8A8, FP8's tiles) and ``bf16`` (the unquantized weights:
tensor-core tiles, split-K first). For each kind, projection and row count it times the
bf16 weights' configured tile, the path the kind took before the small-batch kernel served
it (``int4``: the split-K ``int_matmul`` tiles; ``fp8``: the configured tile without
split-K; ``int8``: the rows quantized, then ``torch._int_mm``), the kind's configured
tile, then a grid of candidates (likeliest first, until the case's share of the budget
runs out).
Each candidate's output is checked once against the dequantized weights' product
(``max_rel_err``: the largest difference over the largest output). For FP8 at one row it
also times the configured tile given the row's scale as a static input scale (``static``:
the same product without the pass over the row for its largest magnitude, which is what
quantizing the row once, where it is produced, would save). Prints a table last
(configured, best, before, bf16, static, in microseconds a launch) and writes every row as
JSON.

``--int-gemm-rows`` times the larger decode batches of 4-bit weights the same way: the
``int_matmul`` tiles (whole ``K``, tensor cores) and, on Hopper, ``int4_wgmma``'s tiles
(``wgmma-configured``: ``wgmma_config``'s) against cuBLAS on the bf16 weights, and the
prompts' way (``dequantize``: ``int_dequantize`` writes the weight in bf16, then cuBLAS),
which any batch could take. ``--int8-gemm-rows`` times INT8 W8A8's larger batches
(``torch._int_mm`` against ``int8_matmul``'s tiles), ``--fp8-gemm-rows`` FP8's (cuBLASLt at
the batch's own rows and padded as the engine pads them, with and without fast
accumulation, with one scale per tensor as
static FP8 checkpoints scale them (``impl="per-tensor"``; ``"per-tensor-fast-accum"`` with
cuBLASLt's fast accumulation), and ``fp8_matmul``'s split-K
tiles for the narrow outputs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_kernels_gpu import GEMV_SHAPES, graph_us_per_launch  # noqa: E402

from pagedllm.layers import int_matmul, triton_ops  # noqa: E402
from pagedllm.layers.fp8_matmul import Fp8Tile, fp8_matmul, fp8_matmul_tile  # noqa: E402
from pagedllm.layers.int8_matmul import Int8Tile, int8_matmul, int8_matmul_tile  # noqa: E402
from pagedllm.layers.int_matmul import IntTile  # noqa: E402
from pagedllm.layers.triton_ops import GemvTile, IntWeights  # noqa: E402
from pagedllm.quantization.fp8 import (  # noqa: E402
    FP8_MAX,
    SPLIT_GEMM_MAX_N,
    SPLIT_GEMM_MAX_ROWS,
    dequantize_rows,
    quantize_rows,
)
from pagedllm.quantization.int8 import quantize_rows_int8  # noqa: E402
from pagedllm.quantization.int_weights import dequantize, pack_rows  # noqa: E402

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
GROUP = 128
L2_FLUSH_BYTES = 400_000_000
# W8A8 formats: (quantize rows, dequantize rows).
W8A8_FORMATS = {"fp8": (quantize_rows, dequantize_rows),
                "int8": (quantize_rows_int8, lambda q, scale: q.float() * scale)}


def measure(row: dict[str, Any], op: Callable[[Any], torch.Tensor], weights: list,
            want: torch.Tensor, weight_bytes: float) -> dict[str, Any]:
    """Fill ``row`` with ``op``'s error on the first weight copy against ``want`` (the
    largest difference over the largest output) and its microseconds a launch over all
    copies in a CUDA graph, or with the error that stopped it; returns ``row``."""
    try:
        got = op(weights[0]).float()
        row["max_rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
        row["us"] = graph_us_per_launch(op, weights)
        row["tb_s"] = weight_bytes / row["us"] / 1e6
    except Exception as exc:  # e.g. too much shared memory for the stages
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def splits(steps: int) -> list[int]:
    """Slice counts that cut ``steps`` K steps into whole slices of at least two steps."""
    return [s for s in (1, 2, 4, 7, 8, 14) if steps % s == 0 and steps // s >= 2]


def candidates(kind: str, rows: int, k: int) -> list[GemvTile]:
    """The grid for ``kind`` at ``rows`` rows and ``K = k``, likeliest first."""
    tiles: list[GemvTile] = []
    if kind == "bf16":  # tensor-core tiles, split-K first (the configured tiles have none)
        shapes = ((32, 512), (64, 512), (64, 256), (64, 128), (128, 128), (32, 256))
        tiles += [GemvTile(n, bk, 4, 3, True, s) for s in (2, 4, 8, 1) for n, bk in shapes
                  if s in splits(k // bk)]
        tiles += [GemvTile(n, bk, w, st, True, s) for n, bk in shapes for s in splits(k // bk)
                  for w, st in ((8, 3), (4, 4), (4, 2))]
    elif kind == "int4":
        if rows == 1:
            tiles += [GemvTile(n, 64, 4, 3, False, s) for s in splits(k // 64)
                      for n in (64, 128, 32)]
            tiles += [GemvTile(n, 128, w, 3, False, s) for s in splits(k // 128)
                      for n in (128, 64, 32) for w in (4, 8)]
        tiles += [GemvTile(n, 128, w, 3, True, s) for s in splits(k // 128)
                  for n in (64, 32, 128) for w in (4, 8)]
    else:
        if rows == 1:  # lane-wise (num_stages changes nothing there: loads land in registers)
            tiles += [GemvTile(n, 512, w, 1, False, s) for s in splits(k // 512)
                      for n in (16, 32) for w in (4, 8)]
            # Twice the weights in flight per program (8 warps: as many registers a thread).
            tiles += [GemvTile(16, 1024, w, 1, False, s) for s in splits(k // 1024)
                      for w in (8, 4)]
        tiles += [GemvTile(n, bk, w, 3, True, s) for bk in (256, 512) for s in splits(k // bk)
                  for n in (32, 64, 128) for w in (4, 8) if n * bk <= 65536]
    return tiles


def int_gemm_candidates(rows: int) -> list[IntTile]:
    """``int_matmul`` tiles for a decode batch of ``rows`` rows (tensor cores; ``K`` whole or
    split in two or four for the narrow tiles), likeliest first. From 256 rows, tiles of all
    256 rows too: each weight tile dequantized once a step, as the dequantize-then-BLAS way
    does, without writing the weight out."""
    tiles = [IntTile(64, 64, 128, s, 4, st) for s in (2, 4) for st in (4, 3)]
    tiles += [IntTile(bm, bn, bk, 1, w, st) for bm, bn, bk, w in (
        (64, 64, 128, 4), (64, 128, 128, 4), (128, 128, 64, 8), (64, 256, 64, 8),
        (128, 256, 64, 8), (128, 64, 128, 4), (128, 128, 128, 8), (32, 128, 128, 4),
        (256, 64, 64, 8), (256, 128, 64, 8), (256, 64, 128, 8))
        for st in (4, 3) if bm <= max(32, rows)]
    return sorted(tiles, key=lambda t: t.block_m != 256)  # stable: those first when listed


# int4_wgmma's candidates on Hopper.
WGMMA_CANDIDATES = [int_matmul.WgmmaTile(block_m=bm, block_k=bk, stages=st, word_stages=ws)
                    for bm, bk, st in ((256, 64, 3), (128, 128, 3), (128, 64, 4), (64, 64, 4))
                    for ws in (4, 8)] + [int_matmul.WgmmaTile(block_n=128, num_warps=8),
                                         int_matmul.WgmmaTile(paired=False)] + [
    int_matmul.WgmmaTile(block_m=16, block_k=128, split=split) for split in (1, 2, 4)]


def int_gemm_sweep(row_counts: list[int], budget_s: float,
                   save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Large decode batches on 4-bit weights: ``int_matmul``'s configured tile and the
    candidates, beside cuBLAS on the bf16 weights, per projection and batch."""
    results: list[dict[str, Any]] = []
    share = budget_s / 4
    gen = torch.Generator(device=DEVICE).manual_seed(46)
    for name, n, k in GEMV_SHAPES[:4]:
        deadline = time.monotonic() + share
        copies = max(2, -(-L2_FLUSH_BYTES // (n * k // 2)))
        weights = [int4_weights(n, k, gen) for _ in range(copies)]
        bf16 = [(torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(DTYPE)
                for _ in range(max(2, -(-L2_FLUSH_BYTES // (n * k * 2))))]
        ref_weight = dequantize(weights[0][0], weights[0][1].scales, weights[0][1].zeros, 4,
                                GROUP, k, torch.float32)
        for m in row_counts:
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(DTYPE)
            want = x.float() @ ref_weight.T
            results.append(dict(kind="int4-gemm", shape=name, rows=m, impl="bf16",
                                us=graph_us_per_launch(lambda w: torch.nn.functional.linear(x, w),
                                                       bf16)))

            def dequantized(w):
                weight = int_matmul.int_dequantize(w[0], w[1].scales, w[1].zeros, bits=4,
                                                   group_size=GROUP, in_features=k, dtype=DTYPE)
                return torch.nn.functional.linear(x, weight)
            results.append(measure(dict(kind="int4-gemm", shape=name, rows=m, impl="dequantize"),
                                   dequantized, weights, want, n * k * 0.5))
            wgmma = int_matmul.wgmma_config(m, n, k, GROUP, 4, DEVICE)
            for label, wtile in ([("wgmma-configured", wgmma)] if wgmma else []) + [
                    ("wgmma", t) for t in WGMMA_CANDIDATES
                    if t != wgmma and int_matmul.is_hopper(DEVICE)]:
                if label == "wgmma" and time.monotonic() > deadline:
                    break

                def op(w, t=wtile):
                    return int_matmul.int4_wgmma(x, w[0], w[1].scales, w[1].zeros, t,
                                                 group_size=GROUP)
                results.append(measure(dict(kind="int4-gemm", shape=name, rows=m, impl=label,
                                            tile=list(wtile.__dict__.values())),
                                       op, weights, want, n * k * 0.5))
            configured = int_matmul.int_matmul_config(m, n, k, GROUP)
            for label, tile in [("configured", configured)] + [
                    ("tile", t) for t in int_gemm_candidates(m) if t != configured]:
                if label == "tile" and time.monotonic() > deadline:
                    break
                row: dict[str, Any] = dict(kind="int4-gemm", shape=name, rows=m, impl=label,
                                           tile=list(tile.__dict__.values()))

                def op(w, t=tile):
                    return int_matmul.int_matmul(x, w[0], w[1].scales, w[1].zeros, t, bits=4,
                                                 group_size=GROUP)
                results.append(measure(row, op, weights, want, n * k * 0.5))
            save(results)
        del weights, bf16
        torch.cuda.empty_cache()
    return results


def int_mm_product(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
                   ) -> torch.Tensor:
    """INT8 W8A8 the way the engine took it before its Triton kernels: the rows quantized,
    ``torch._int_mm`` (cuBLASLt; at least 17 rows, fewer padded), then scaled."""
    rows, scales = triton_ops.quantize_rows_int8(x)
    padded = torch.nn.functional.pad(rows, (0, 0, 0, max(0, 17 - rows.shape[0])))
    sums = torch._int_mm(padded, weight.t())[:rows.shape[0]]
    return (sums.float() * scales * weight_scale.reshape(1, -1)).to(x.dtype)


INT8_GEMM_TILES = [Int8Tile(*t) for t in (
    (64, 128, 128, 4, 4), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (64, 256, 128, 4, 3),
    (128, 128, 64, 4, 4), (64, 128, 256, 4, 3), (128, 128, 256, 8, 3), (128, 64, 128, 4, 4))]


def w8a8_copies(n: int, k: int, quantize: Callable, gen: torch.Generator
                ) -> tuple[list[torch.Tensor], list]:
    """Random bf16 weights ``[n, k]`` and their W8A8 rows (``quantize``'s pairs), enough
    copies of each that cycling through them keeps every one out of L2."""
    bf16 = [(torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(DTYPE)
            for _ in range(max(2, -(-L2_FLUSH_BYTES // (n * k * 2))))]
    weights = [quantize(w) for w in bf16]
    return bf16, (weights * 2)[:max(2, -(-L2_FLUSH_BYTES // (n * k)))]


def timed_tiles(case: dict[str, Any], configured: tuple, grid: list, deadline: float,
                op: Callable, weights: list, want: torch.Tensor, weight_bytes: float
                ) -> list[dict[str, Any]]:
    """``case`` timed with ``op(w, tile)`` on the configured tile, then on ``grid``'s others
    until ``deadline``: one row each (``impl`` "configured" or "tile")."""
    rows = []
    for tile in [configured] + [t for t in grid if t != configured]:
        if time.monotonic() > deadline and tile != configured:
            break
        row = dict(case, tile=list(tile), impl="configured" if tile == configured else "tile")
        rows.append(measure(row, lambda w, t=tile: op(w, t), weights, want, weight_bytes))
    return rows


def int8_gemm_sweep(row_counts: list[int], budget_s: float,
                    save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Larger batches on INT8 W8A8 weights: the rows quantized, then ``torch._int_mm``
    (``impl="before"``) or ``int8_matmul``'s tiles, beside cuBLAS on the bf16 weights."""
    results: list[dict[str, Any]] = []
    share = budget_s / 4
    gen = torch.Generator(device=DEVICE).manual_seed(47)
    for name, n, k in GEMV_SHAPES[:4]:
        deadline = time.monotonic() + share
        bf16, weights = w8a8_copies(n, k, quantize_rows_int8, gen)
        for m in row_counts:
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(DTYPE)
            xq, x_scale = quantize_rows_int8(x)
            want = (xq.float() * x_scale) @ (weights[0][0].float() * weights[0][1]).T
            results.append(dict(kind="int8-gemm", shape=name, rows=m, impl="bf16",
                                us=graph_us_per_launch(lambda w: torch.nn.functional.linear(x, w),
                                                       bf16)))
            results.append(measure(dict(kind="int8-gemm", shape=name, rows=m, impl="before"),
                                   lambda w: int_mm_product(x, w[0], w[1]), weights, want, n * k))
            def op(w, t):
                rows, scales = triton_ops.quantize_rows_int8(x)
                return int8_matmul(rows, scales, w[0], w[1], None, DTYPE, t)
            results += timed_tiles(dict(kind="int8-gemm", shape=name, rows=m),
                                   int8_matmul_tile(m, n, k), INT8_GEMM_TILES, deadline, op,
                                   weights, want, n * k)
            save(results)
        del weights, bf16
        torch.cuda.empty_cache()
    return results


FP8_SPLIT_TILES = [Fp8Tile(*t, s) for t, splits in (
    ((64, 128, 128, 4, 4), (1, 2, 4, 8)), ((128, 128, 128, 8, 4), (1, 2, 4)),
    ((64, 64, 128, 4, 4), (2, 4, 8)), ((64, 128, 256, 4, 3), (2, 4))) for s in splits] + [
    # A few rows: the weights on the tensor cores' wide side.
    Fp8Tile(16, bn, bk, 4, st, s, swap=True) for bn, bk, st in ((64, 256, 4), (128, 128, 4))
    for s in (1, 2, 4)]


def fp8_gemm_sweep(row_counts: list[int], budget_s: float,
                   save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Larger batches on FP8 W8A8 weights through the engine's ``fp8_linear`` (the rows
    quantized, then ``torch._scaled_mm``, the split-K GEMM set aside): at the batch's own
    rows (``impl="unpadded"``, ``PAGEDLLM_FP8_PAD_ROWS=0``) and padded as the engine pads
    them (to the rows of ``cublas_rows``), with partial sums promoted to float32
    (``"promoted"``, ``PAGEDLLM_FP8_FAST_ACCUM=0``) and with cuBLASLt's fast accumulation
    (``"engine"``), beside cuBLAS on the bf16 weights (whose row holds the FP8 product's
    error against them, ``fp8_rounding_err``: what rounding the operands costs);
    and for the narrow outputs (``split_k_product``'s), ``fp8_matmul``'s configured tile and
    a grid of split-K tiles (``"configured"``, ``"tile"``; the rows quantized by the same
    kernel) until the shape's share of ``budget_s`` runs out."""
    from pagedllm.quantization import fp8

    results: list[dict[str, Any]] = []
    gen = torch.Generator(device=DEVICE).manual_seed(53)
    for name, n, k in GEMV_SHAPES[:4]:
        deadline = time.monotonic() + budget_s / 4
        bf16, weights = w8a8_copies(n, k, quantize_rows, gen)
        for m in row_counts:
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(DTYPE)
            xq, x_scale = quantize_rows(x)
            want = dequantize_rows(xq, x_scale) @ dequantize_rows(*weights[0]).T
            exact = x.float() @ bf16[0].float().T
            results.append(dict(kind="fp8-gemm", shape=name, rows=m, impl="bf16",
                                fp8_rounding_err=((want - exact).abs().max()
                                                  / exact.abs().max()).item(),
                                us=graph_us_per_launch(lambda w: torch.nn.functional.linear(x, w),
                                                       bf16)))
            configured = fp8.PAD_ROWS, fp8.SPLIT_GEMM, fp8.FAST_ACCUM
            fp8.SPLIT_GEMM = False  # cuBLASLt for every shape; the split-K tiles below
            for impl, pad, fast in (("unpadded", False, False), ("promoted", True, False),
                                    ("engine", True, True)):
                fp8.PAD_ROWS, fp8.FAST_ACCUM = pad, fast
                row = dict(kind="fp8-gemm", shape=name, rows=m, impl=impl,
                           cublas_rows=fp8.cublas_rows(m, n, DEVICE))
                results.append(measure(row, lambda w: fp8.fp8_linear(x, w[0], w[1]), weights,
                                       want, n * k))
            fp8.PAD_ROWS, fp8.SPLIT_GEMM, fp8.FAST_ACCUM = configured
            results.append(per_tensor_product(name, m, x, bf16, n * k))
            results.append(per_tensor_product(name, m, x, bf16, n * k, fast_accum=True))
            if m <= SPLIT_GEMM_MAX_ROWS and n <= SPLIT_GEMM_MAX_N:
                def op(w, t):
                    rows, scales = triton_ops.quantize_rows_fp8(x)
                    return fp8_matmul(rows, scales, w[0], w[1], None, DTYPE, t)
                grid = [t for t in FP8_SPLIT_TILES if (k // t.block_k) % t.split == 0]
                results += timed_tiles(dict(kind="fp8-gemm", shape=name, rows=m),
                                       fp8_matmul_tile(m, n, k), grid, deadline, op, weights,
                                       want, n * k)
            save(results)
        del weights, bf16
        torch.cuda.empty_cache()
    return results


def per_tensor_product(shape: str, m: int, x: torch.Tensor, bf16: list[torch.Tensor],
                       weight_bytes: int, fast_accum: bool = False) -> dict[str, Any]:
    """cuBLASLt's FP8 product with one scale for each operand (``torch._scaled_mm``'s
    tensor-wise scaling, as a static per-tensor checkpoint would run, and as the engine's
    products with unit scales run), the operands quantized per tensor: the row of
    ``impl="per-tensor"``, or with ``fast_accum`` (cuBLASLt's FP8 fast accumulation,
    ``PAGEDLLM_FP8_FAST_ACCUM``) of ``impl="per-tensor-fast-accum"``."""
    def per_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (t.abs().amax().float() / FP8_MAX).reshape(1)
        return quantize_rows(t, scale)[0], scale.reshape(())

    xq, x_scale = per_tensor(x)
    weights = [per_tensor(w) for w in bf16]
    want = (xq.float() * x_scale) @ (weights[0][0].float() * weights[0][1]).T
    row = dict(kind="fp8-gemm", shape=shape, rows=m,
               impl="per-tensor-fast-accum" if fast_accum else "per-tensor")
    return measure(row, lambda w: torch._scaled_mm(xq, w[0].t(), scale_a=x_scale, scale_b=w[1],
                                                   out_dtype=DTYPE, use_fast_accum=fast_accum),
                   (weights * 2)[:max(2, -(-L2_FLUSH_BYTES // weight_bytes))], want, weight_bytes)


def int4_weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, IntWeights]:
    codes = torch.randint(0, 16, (n, k), generator=gen, device=DEVICE)
    scales = (torch.rand(n, k // GROUP, generator=gen, device=DEVICE) * 0.002 + 0.001).to(DTYPE)
    zeros = torch.full((n, k // GROUP), 8, dtype=torch.uint8, device=DEVICE)
    return pack_rows(codes, 4), IntWeights(scales, zeros, 4, GROUP)


def sweep(kinds: list[str], row_counts: list[int], budget_s: float,
          save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    share = budget_s / (len(kinds) * 4 * len(row_counts))  # each case gets its share
    configured = triton_ops.small_batch_matmul_config
    gen = torch.Generator(device=DEVICE).manual_seed(45)
    try:
        for kind in kinds:
            for name, n, k in GEMV_SHAPES[:4]:
                bytes_per_weight = {"int4": 0.5, "fp8": 1.0, "int8": 1.0, "bf16": 2.0}[kind]
                copies = max(2, -(-L2_FLUSH_BYTES // int(n * k * bytes_per_weight)))
                bf16 = [(torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(DTYPE)
                        for _ in range(max(2, -(-L2_FLUSH_BYTES // (n * k * 2))))]
                if kind == "int4":
                    weights = [int4_weights(n, k, gen) for _ in range(copies)]
                    ref_weight = dequantize(weights[0][0], weights[0][1].scales,
                                            weights[0][1].zeros, 4, GROUP, k, torch.float32)

                    def op(w, x):
                        return triton_ops.small_batch_matmul(x, w[0], int_weights=w[1])

                    def before(w, x):
                        tile = int_matmul.int_matmul_config(16, n, k, GROUP)
                        return int_matmul.int_matmul(x, w[0], w[1].scales, w[1].zeros, tile,
                                                     bits=4, group_size=GROUP)
                elif kind == "bf16":
                    weights, ref_weight = bf16, bf16[0].float()

                    def op(w, x):
                        return triton_ops.small_batch_matmul(x, w)

                    before = None
                else:
                    quantize, dequantize_w8a8 = W8A8_FORMATS[kind]
                    weights = [quantize(w) for w in bf16]
                    weights = (weights * (copies // len(weights) + 1))[:copies]
                    ref_weight = dequantize_w8a8(*weights[0])

                    def op(w, x):
                        return triton_ops.small_batch_matmul(x, w[0], weight_scale=w[1])

                    before = None
                    if kind == "int8":

                        def before(w, x):
                            return int_mm_product(x, w[0], w[1])
                for m in row_counts:
                    deadline = time.monotonic() + share
                    x = torch.randn(m, k, generator=gen, device=DEVICE).to(DTYPE)
                    want = x.float() @ ref_weight.T
                    if kind in W8A8_FORMATS:
                        xq, x_scale = W8A8_FORMATS[kind][0](x)
                        want = W8A8_FORMATS[kind][1](xq, x_scale) @ ref_weight.T

                    def timed(label: str, fn, tile: GemvTile | None = None) -> None:
                        row: dict[str, Any] = dict(kind=kind, shape=name, rows=m, impl=label)
                        if tile is not None:
                            row["tile"] = list(tile)
                            triton_ops.small_batch_matmul_config = (
                                lambda *a, t=tile, **kw: t)
                        try:
                            measure(row, lambda w: fn(w, x), weights, want,
                                    n * k * bytes_per_weight)
                        finally:
                            triton_ops.small_batch_matmul_config = configured
                        results.append(row)

                    bf16_row: dict[str, Any] = dict(kind=kind, shape=name, rows=m, impl="bf16")
                    bf16_row["us"] = graph_us_per_launch(
                        lambda w: triton_ops.small_batch_matmul(x, w), bf16)
                    results.append(bf16_row)
                    if before is not None:
                        timed("before", before)
                    elif kind == "fp8" and m == 1:  # the configured tile without split-K
                        tile = triton_ops.small_batch_matmul_config(m, n, k, fp8=True)
                        timed("before", op, GemvTile(*tile[:5]))
                    timed("configured", op)
                    if kind == "fp8" and m == 1:  # the row's own scale, given: no amax pass
                        timed("static", lambda w, x: triton_ops.small_batch_matmul(
                            x, w[0], weight_scale=w[1], input_scale=x_scale.reshape(1)))
                    for tile in candidates(kind, m, k):
                        if time.monotonic() > deadline:
                            break
                        timed("tile", op, tile)
                    save(results)
                bf16 = weights = None  # free the copies before the next shape
                torch.cuda.empty_cache()
    finally:
        triton_ops.small_batch_matmul_config = configured
    return results


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'kind':5} {'projection':10} {'rows':>4} {'bf16':>7} {'before':>7} "
          f"{'config':>7} {'best':>7} {'TB/s':>5} {'err':>8} {'static':>7}  best tile")
    for key in dict.fromkeys((r["kind"], r["shape"], r["rows"]) for r in results):
        mine = [r for r in results if (r["kind"], r["shape"], r["rows"]) == key]
        pick = {r["impl"]: r.get("us", float("nan")) for r in mine if r["impl"] != "tile"}
        tiles = sorted((r for r in mine if "us" in r and r["impl"] in ("tile", "configured")),
                       key=lambda r: r["us"])
        if key[0] == "fp8-gemm":  # cuBLAS at the batch's own rows and the engine's; split-K
            best = tiles[0] if tiles else {}
            print(f"{key[0]:5} {key[1]:10} {key[2]:4} {pick['bf16']:7.1f} bf16, "
                  f"{pick.get('unpadded', float('nan')):7.1f} unpadded, "
                  f"{pick.get('promoted', float('nan')):7.1f} promoted, "
                  f"{pick.get('engine', float('nan')):7.1f} engine, "
                  f"{pick.get('per-tensor', float('nan')):7.1f} per-tensor, "
                  f"{pick.get('per-tensor-fast-accum', float('nan')):7.1f} fast, "
                  f"{pick.get('configured', float('nan')):7.1f} split-K configured, "
                  f"{best.get('us', float('nan')):7.1f} best {best.get('tile', '')}")
            continue
        if key[0] == "int4-gemm":  # BLAS on bf16, dequantize + BLAS, the tiles, wgmma
            ours = sorted((r for r in mine if "us" in r and r["impl"].startswith("wgmma")),
                          key=lambda r: r["us"])
            best = ours[0] if ours else {}
            print(f"{key[0]:9} {key[1]:10} {key[2]:5} {pick['bf16']:7.1f} bf16, "
                  f"{pick.get('dequantize', float('nan')):7.1f} dequantize, "
                  f"{tiles[0]['us'] if tiles else float('nan'):7.1f} best tile, "
                  f"{pick.get('wgmma-configured', float('nan')):7.1f} wgmma, "
                  f"{best.get('us', float('nan')):7.1f} best wgmma "
                  f"(err {best.get('max_rel_err', float('nan')):.1e}) {best.get('tile', '')}")
            continue
        if not tiles:
            continue
        best = tiles[0]
        print(f"{key[0]:5} {key[1]:10} {key[2]:4} {pick.get('bf16', float('nan')):7.1f} "
              f"{pick.get('before', float('nan')):7.1f} {pick.get('configured', float('nan')):7.1f} "
              f"{best['us']:7.1f} {best['tb_s']:5.2f} {best['max_rel_err']:8.1e} "
              f"{pick.get('static', float('nan')):7.1f}  "
              f"{best.get('tile', 'configured')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON rows")
    parser.add_argument("--kinds", default="int4,fp8",
                        help="int4, fp8, int8, bf16 (comma-separated)")
    parser.add_argument("--rows", default="1,4", help="decode batch sizes, e.g. 1,4")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="seconds after which no new candidate tile starts")
    parser.add_argument("--int-gemm-rows", default="",
                        help="also time int_matmul's tiles on 4-bit weights at these decode "
                             "batch sizes, e.g. 64,128,256 (with --int-gemm-budget-s)")
    parser.add_argument("--int-gemm-budget-s", type=float, default=200.0)
    parser.add_argument("--int8-gemm-rows", default="",
                        help="also time INT8 W8A8 products of these batch sizes: torch._int_mm "
                             "against int8_matmul's tiles (with --int8-gemm-budget-s)")
    parser.add_argument("--int8-gemm-budget-s", type=float, default=120.0)
    parser.add_argument("--fp8-gemm-rows", default="",
                        help="also time FP8 W8A8 products of these batch sizes as the engine "
                             "runs them (torch._scaled_mm, padded rows), unpadded, with one "
                             "scale per tensor, and on fp8_matmul's split-K tiles (with "
                             "--fp8-gemm-budget-s)")
    parser.add_argument("--fp8-gemm-budget-s", type=float, default=120.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gemv_quant_sweep.py needs a CUDA GPU; on the CPU run `pytest tests/layers`.")
        return 2
    kinds = [kind for kind in args.kinds.split(",") if kind and kind != "none"]
    if set(kinds) - {"int4", "fp8", "int8", "bf16"}:
        parser.error(f"--kinds takes int4, fp8, int8 and bf16, got {args.kinds!r}")

    def save(rows: list[dict[str, Any]]) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows),
                                       indent=1) + "\n")

    results = sweep(kinds, [int(r) for r in args.rows.split(",") if r], args.budget_s, save) \
        if kinds else []
    if args.int_gemm_rows:
        done = list(results)
        results += int_gemm_sweep([int(r) for r in args.int_gemm_rows.split(",")],
                                  args.int_gemm_budget_s, lambda rows: save(done + rows))
    if args.int8_gemm_rows:
        done = list(results)
        results += int8_gemm_sweep([int(r) for r in args.int8_gemm_rows.split(",")],
                                   args.int8_gemm_budget_s, lambda rows: save(done + rows))
    if args.fp8_gemm_rows:
        done = list(results)
        results += fp8_gemm_sweep([int(r) for r in args.fp8_gemm_rows.split(",")],
                                  args.fp8_gemm_budget_s, lambda rows: save(done + rows))
    save(results)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
