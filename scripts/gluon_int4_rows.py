#!/usr/bin/env python3
"""A candidate for one row of 4-bit weights (issue 17's L1), written in Gluon so that its
layouts are set by hand: the engine's kernel (``triton_ops.small_batch_matmul``, Triton)
converts the row of inputs to the unpacked weights' layout through shared memory and sums
each tile across lanes, 7 barriers and 31 shuffles an iteration of its sm_90 loop; this
one keeps each lane's inputs in registers beside its words and sums across lanes once,
after the loop (docs/benchmarks.md, "One row of 4-bit weights in Gluon").

    python scripts/gluon_int4_rows.py --sass               # any machine: the sm_90 loops
    python scripts/gluon_int4_rows.py --out gluon.json     # a GPU: checked, then timed

The weights are the stored layout of ``pagedllm.quantization.int_weights`` (4-bit codes
``[N, K / 8]`` in int32 words, values ``2p`` and ``2p + 1`` in slots ``p`` and ``p + 4``),
bf16 scales and uint8 zero points in groups of 128. A program owns ``RPT * (32 / WT) *
warps`` rows and ``K / SPLIT`` inputs; a lane holds ``RPT`` rows by ``WPT`` words (8
inputs each) of its ``WT`` lanes' 128-input tile, and multiplies them as
``int_row_products`` does (a value ``v = 1 + q / 16`` made by a shift and an and/or,
``sum (q - zero) x = 16 sum v x - (16 + zero) sum x``), its group's scale applied per row
and tile, each tile's loads issued an iteration ahead. The slices' sums are added into a float32 row by atomics (in any order: the
result may differ in the last bits from run to run). On a GPU each projection of
Llama-3.1-8B is checked against the dequantized weights' product and timed in CUDA graphs
over weight copies that are not in L2, beside the engine's configured tile.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUP = 128


@gluon.jit
def int4_rows_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, N, K, k_per_split, stride_wn,
                     stride_sn, one, RPT: gl.constexpr, WT: gl.constexpr, WPT: gl.constexpr,
                     NUM_WARPS: gl.constexpr):
    """``out[n] += sum_k x[k] (q[n, k] - zero) scale`` over this program's rows and
    ``K`` slice; ``one`` is the bits of 1.0 (a register: one and/or per value)."""
    BLOCK_N: gl.constexpr = RPT * (32 // WT) * NUM_WARPS
    L4: gl.constexpr = gl.BlockedLayout([RPT, 1, WPT, 8], [32 // WT, WT, 1, 1],
                                        [NUM_WARPS, 1, 1, 1], [3, 2, 1, 0])
    LQ: gl.constexpr = gl.SliceLayout(3, L4)  # words [rows, lanes, words a lane]
    LP: gl.constexpr = gl.SliceLayout(0, LQ)  # [lanes, words a lane]
    LA: gl.constexpr = gl.SliceLayout(2, LQ)  # sums [rows, lanes]
    LN: gl.constexpr = gl.SliceLayout(1, LA)  # [rows]
    LX: gl.constexpr = gl.SliceLayout(0, L4)  # inputs [lanes, words a lane, 8]
    TILE: gl.constexpr = WT * WPT * 8
    n = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=LN)
    n_rows = gl.minimum(n, N - 1)
    lane_q = gl.arange(0, WT, layout=gl.SliceLayout(1, LP))
    word_q = gl.arange(0, WPT, layout=gl.SliceLayout(0, LP))
    words = gl.expand_dims(gl.expand_dims(lane_q, 1) * WPT + gl.expand_dims(word_q, 0), 0)
    w_tile = w_ptr + gl.expand_dims(gl.expand_dims(n_rows, 1), 2) * stride_wn + words
    lane_x = gl.arange(0, WT, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))
    word_x = gl.arange(0, WPT, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))
    value_x = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, LX)))
    x_index = (gl.expand_dims(gl.expand_dims(lane_x, 1) * WPT + gl.expand_dims(word_x, 0), 2) * 8
               + gl.expand_dims(gl.expand_dims(value_x, 0), 0))
    # Value c of a word sits at bits 4 * (c // 2 + 4 * (c % 2)); moved to bits 19-22.
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, L4))))
    left = 19 - (c // 2 + 4 * (c % 2)) * 4
    up = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.maximum(left, 0).to(gl.uint32), 0), 0), 0)
    down = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.maximum(-left, 0).to(gl.uint32), 0),
                                         0), 0)
    one_bits = one.to(gl.uint32)
    acc = gl.zeros([BLOCK_N, WT], gl.float32, layout=LA)
    k_start = gl.program_id(1) * k_per_split
    k_end = k_start + k_per_split
    # The first tile's loads; each iteration then loads the next (the last: its own again)
    # before it multiplies the one loaded the iteration before.
    q_next = gl.load(w_tile + k_start // 8)
    x_next = gl.load(x_ptr + k_start + x_index)
    scale_next = gl.load(s_ptr + n_rows * stride_sn + k_start // 128)
    zero_next = gl.load(z_ptr + n_rows * stride_sn + k_start // 128)
    for k0 in range(k_start, k_end, TILE):
        q = q_next.to(gl.uint32, bitcast=True)
        x = x_next.to(gl.float32)
        scale = scale_next.to(gl.float32)
        zero = zero_next.to(gl.float32)
        ahead = gl.minimum(k0 + TILE, k_end - TILE)
        q_next = gl.load(w_tile + ahead // 8)
        x_next = gl.load(x_ptr + ahead + x_index)
        scale_next = gl.load(s_ptr + n_rows * stride_sn + ahead // 128)
        zero_next = gl.load(z_ptr + n_rows * stride_sn + ahead // 128)
        v = ((((gl.expand_dims(q, 3) << up) >> down) & 0x780000) | one_bits).to(
            gl.float32, bitcast=True)
        sum_vx = gl.sum(gl.sum(v * gl.expand_dims(x, 0), axis=3), axis=2)
        sum_x = gl.expand_dims(gl.convert_layout(gl.sum(gl.sum(x, axis=2), axis=1),
                                                 gl.SliceLayout(0, LA)), 0)
        acc += gl.expand_dims(scale, 1) * (sum_vx * 16.0 - gl.expand_dims(zero + 16.0, 1) * sum_x)
    gl.atomic_add(out_ptr + n, gl.sum(acc, axis=1), mask=n < N, sem="relaxed")


def rows_per_program(rpt: int, wt: int, warps: int) -> int:
    return rpt * (32 // wt) * warps


def int4_rows(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor, config: tuple[int, int, int, int, int],
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [1, K] @ W.T`` in float32 (``[N]``) for 4-bit ``qweight [N, K / 8]`` with
    ``scales``/``zeros`` ``[N, K / 128]``; ``config`` = (RPT, WT, WPT, warps, SPLIT)."""
    rpt, wt, wpt, warps, split = config
    n, k = qweight.shape[0], x.shape[-1]
    if out is None:
        out = torch.zeros(n, dtype=torch.float32, device=x.device)
    else:
        out.zero_()
    grid = (triton.cdiv(n, rows_per_program(rpt, wt, warps)), split)
    int4_rows_kernel[grid](x, qweight, scales, zeros, out, n, k, k // split,
                           qweight.stride(0), scales.stride(0), 0x3F800000, RPT=rpt, WT=wt,
                           WPT=wpt, NUM_WARPS=warps, num_warps=warps)
    return out


CONFIGS = [(rpt, 4, 4, warps, split) for rpt in (2, 4, 8) for warps in (4, 8)
           for split in (1, 2, 4, 8)]


def fits(config: tuple[int, int, int, int, int], k: int) -> bool:
    """The tile (128 inputs: one group) and the split's slices divide ``K``."""
    rpt, wt, wpt, warps, split = config
    tile = wt * wpt * 8
    return tile == GROUP and k % (tile * split) == 0


def sass_counts(config: tuple[int, int, int, int, int]) -> dict:
    """The sm_90 main loop of ``config``'s kernel, compiled here: instructions (per weight
    a lane holds), barriers, shuffles, shared-memory and spill accesses."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from sass_loop import main_loop, sass

    rpt, wt, wpt, warps, _ = config
    signature = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", z_ptr="*u8", out_ptr="*fp32",
                     N="i32", K="i32", k_per_split="i32", stride_wn="i32", stride_sn="i32",
                     one="i32")
    constants = dict(RPT=rpt, WT=wt, WPT=wpt, NUM_WARPS=warps)
    signature.update({name: "constexpr" for name in constants})
    names = list(int4_rows_kernel.arg_names)
    aligned = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "out_ptr", "N", "K", "k_per_split",
               "stride_wn", "stride_sn")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    compiled = triton.compile(
        GluonASTSource(fn=int4_rows_kernel, signature=signature, constexprs=constants,
                       attrs=attrs),
        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
    loop = main_loop(sass(compiled))
    ops = collections.Counter(text.split()[1] if text.startswith("@") else text.split()[0]
                              for text in loop)

    def count(*prefixes: str) -> int:
        return sum(v for op, v in ops.items() if op.startswith(prefixes))

    weights = rpt * wpt * 8
    return dict(config=list(config), instructions=len(loop),
                per_weight=round(len(loop) / weights, 2), barriers=count("BAR"),
                shuffles=count("SHFL"), shared=count("LDS", "STS", "LDSM", "STSM"),
                spills=count("LDL", "STL"))


def timed_rows() -> list[dict]:
    """Each projection: the engine's configured tile and every fitting candidate, checked
    and timed (``gemv_quant_sweep.measure``)."""
    from gemv_quant_sweep import DEVICE, DTYPE, L2_FLUSH_BYTES, int4_weights, measure

    from check_kernels_gpu import GEMV_SHAPES, graph_us_per_launch
    from pagedllm.layers import triton_ops
    from pagedllm.quantization.int_weights import dequantize

    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(47)
    for name, n, k in GEMV_SHAPES[:4]:
        copies = max(2, -(-L2_FLUSH_BYTES // (n * k // 2)))
        weights = [int4_weights(n, k, gen) for _ in range(copies)]
        reference = dequantize(weights[0][0], weights[0][1].scales, weights[0][1].zeros, 4,
                               GROUP, k, torch.float32)
        x = torch.randn(1, k, generator=gen, device=DEVICE).to(DTYPE)
        want = (x.float() @ reference.T)[0]
        bf16 = [(torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(DTYPE)
                for _ in range(max(2, -(-L2_FLUSH_BYTES // (n * k * 2))))]
        rows.append(dict(shape=name, impl="bf16", us=graph_us_per_launch(
            lambda w: triton_ops.small_batch_matmul(x, w), bf16)))
        del bf16
        rows.append(measure(dict(shape=name, impl="engine"),
                            lambda w: triton_ops.small_batch_matmul(x, w[0], int_weights=w[1])[0],
                            weights, want, n * k / 2))
        out = torch.zeros(n, dtype=torch.float32, device=DEVICE)
        for config in (c for c in CONFIGS if fits(c, k)):
            rows.append(measure(dict(shape=name, impl="gluon", config=list(config)),
                                lambda w, c=config: int4_rows(x, w[0], w[1].scales, w[1].zeros,
                                                              c, out),
                                weights, want, n * k / 2))
        del weights
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sass", action="store_true",
                        help="print the candidates' sm_90 loops (no GPU needed)")
    parser.add_argument("--out", default=None, help="JSON of the timed rows")
    args = parser.parse_args()
    if args.sass:
        for config in dict.fromkeys(c[:4] + (1,) for c in CONFIGS):
            print(json.dumps(sass_counts(config)))
        return 0
    if not torch.cuda.is_available():
        parser.error("timing needs a CUDA GPU; --sass reads the loops without one")
    rows = timed_rows()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    for name in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == name]
        bf16 = next(r["us"] for r in mine if r["impl"] == "bf16")
        engine = next(r for r in mine if r["impl"] == "engine")
        best = min((r for r in mine if r["impl"] == "gluon" and "us" in r),
                   key=lambda r: r["us"], default=None)
        best_text = (f"{best['us']:.2f} us {best['config']} (err {best['max_rel_err']:.1e})"
                     if best else "none")
        print(f"{name:8} bf16 {bf16:7.2f} us  engine {engine.get('us', float('nan')):7.2f} us  "
              f"gluon best {best_text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
