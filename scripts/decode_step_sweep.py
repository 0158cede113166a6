#!/usr/bin/env python3
"""Time the kernels of a large decode step that are not products, over their launch
settings, on Llama-3.1-8B's shapes: where a 512-sequence step over an FP8 cache spends
what the products leave (docs/benchmarks.md, "Short contexts over an FP8 cache").

    python scripts/decode_step_sweep.py --out decode_step.json [--parts decode,registers,silu,norm]

- ``decode``: decode attention alone at short contexts (512 sequences of 129..256,
  257..384 and 385..512 tokens; 256 of 129..256), over a bf16 and an FP8 cache, per tile
  (``BLOCK_N, num_warps, num_stages``), each context range's top as the launch's bound.
- ``gap``: decode attention of 512 sequences of 1,024 tokens over an FP8 cache, alone
  (as ``decode``), with the step's rope and cache write riding on the launch (the
  engine's ``new_kv``), with the blocks spread over a cache the size of the engine's
  (3.6 GB a layer), and both: inside the engine the same launch took 333 us where the
  kernel alone takes about 285.
- ``registers``: decode attention per tile under register caps (``maxnreg``:
  ``triton_decode.MAX_REGISTERS``), W1's mix (256 sequences of 100..2,048 tokens)
  and TensorRT-LLM's decode batches (512 of 1,000..2,000 and 129..256), bf16 and FP8
  caches: fewer registers a thread, more programs a multiprocessor.
- ``widen``: decode attention over an FP8 cache with its tiles widened to float16 at the
  products' operand loads (the default) or before the products
  (``PAGEDLLM_FP8_KV_WIDEN=staged``), per tile, at W1's mix, TensorRT-LLM's decode
  batches and four 32,000-token contexts (split); each staged launch's largest difference
  from the default's (``max_diff``: the products sum in another order).
- ``silu``: SiLU-and-mul with FP8 output (``silu_and_mul_fp8_kernel``) over gate/up's
  sums before their scales, at 64, 256, 512 and 8,192 rows of 2 x 14,336, per launch
  (``triton_ops.SiluFp8Launch``: ``BLOCK``, a row in one pass up to 16k, else two; warps;
  programs a multiprocessor).
- ``argmax``: the sampler's pass over 64, 256 and 512 rows of 128,256 bf16 logits (greedy
  and the Gumbel draw) per ``triton_ops.ARGMAX_PROGRAMS_PER_SM``.
- ``norm``: RMSNorm with the residual added, bf16 and FP8 output, at the same rows of
  4,096, per warps.

Each setting's output is checked equal to the engine's default launch (``equal``), and
timed inside one CUDA graph over enough input copies that none is in L2 (microseconds a
launch). Prints each row as it goes and a table of the best per case last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_kernels_gpu import (  # noqa: E402
    BLOCK_SIZE, HEAD_DIM, decode_only, decode_tile, fp8_kv_step, graph_us_per_launch, kv_bytes,
    make_step, uniform_lengths,
)

from pagedllm.layers import triton_ops  # noqa: E402
from pagedllm.layers.attention import triton_decode  # noqa: E402
from pagedllm.layers.attention.kv_quant import paged_kv_views  # noqa: E402
from pagedllm.layers.attention.triton_common import FP8_KV_WIDEN_ENV  # noqa: E402

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
HIDDEN, INTERMEDIATE = 4096, 14336
ROWS = (64, 256, 512, 8192)
OUT_OF_L2_BYTES = 200_000_000
DECODE_CASES = (("512 x 129..256", 512, 129, 256), ("512 x 257..384", 512, 257, 384),
                ("512 x 385..512", 512, 385, 512), ("256 x 129..256", 256, 129, 256))
DECODE_TILES = ((16, 2, 2), (32, 2, 2), (32, 4, 2), (64, 2, 2), (64, 4, 2), (64, 4, 3),
                (128, 4, 2))
# SiLU-and-mul launches (triton_ops.SiluFp8Launch: block, warps, programs a multiprocessor,
# 0 = one program a row).
SILU_SETTINGS = ((16384, 16, 0), (16384, 32, 1), (16384, 32, 1, 1), (16384, 16, 1, 1),
                 (16384, 16, 1))
NORM_WARPS = (2, 4, 8, 16)


def copies_for(nbytes: int) -> int:
    return max(2, -(-OUT_OF_L2_BYTES // max(nbytes, 1)))


def decode_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for label, seqs, lo, hi in DECODE_CASES:
        bf16 = make_step([(n - 1, 1) for n in uniform_lengths(seqs, lo, hi, seed=7)], seed=51)
        for cache, step in (("bf16", bf16), ("fp8", fp8_kv_step(bf16))):
            want = decode_only(step, max_seq_len=hi)().clone()
            for tile in DECODE_TILES:
                with decode_tile(tile):
                    launch = decode_only(step, max_seq_len=hi)
                    equal = torch.equal(launch(), want)
                    us = graph_us_per_launch(lambda _: launch(), [None] * 8)
                rows.append(dict(part="decode", case=label, cache=cache, tile=list(tile), us=us,
                                 tb_s=kv_bytes(step) / us / 1e6, equal=equal))
                print(f"decode {label:15} {cache:5} tile {tile}: {us:7.1f} us "
                      f"{rows[-1]['tb_s']:5.2f} TB/s{'' if equal else '  DIFFERS'}", flush=True)
        del bf16, step
        torch.cuda.empty_cache()
    return rows


REGISTER_CASES = (("W1 mix 256 x 100..2048", 256, 100, 2048),
                  ("512 x 1000..2000", 512, 1000, 2000), ("512 x 129..256", 512, 129, 256))
# (cache, tile, register caps): None is the compiler's own count (124 registers at FP8's
# 128,4,2, 96 at 64,4,2; bf16's 217 at 128,4,2, 111 at 64,4,2, by sass_loop.py's compile).
REGISTER_SETTINGS = (("fp8", (128, 4, 2), (None, 120, 96, 80, 72)),
                     ("fp8", (64, 4, 2), (None, 80, 72, 64)),
                     ("fp8", (64, 2, 2), (None, 128, 96)),
                     ("bf16", (128, 4, 2), (None, 168, 128)),
                     ("bf16", (64, 4, 2), (None, 96, 80)))


@contextlib.contextmanager
def register_cap(cap: int | None) -> Iterator[None]:
    """Every decode launch inside takes at most ``cap`` registers a thread."""
    configured = triton_decode.MAX_REGISTERS
    triton_decode.MAX_REGISTERS = cap
    try:
        yield
    finally:
        triton_decode.MAX_REGISTERS = configured


def register_rows() -> list[dict[str, Any]]:
    """``registers``: decode attention per tile under register caps (more programs a
    multiprocessor), at W1's and TensorRT-LLM's decode batches."""
    rows: list[dict[str, Any]] = []
    for label, seqs, lo, hi in REGISTER_CASES:
        bf16 = make_step([(n - 1, 1) for n in uniform_lengths(seqs, lo, hi, seed=8)], seed=54)
        steps = {"bf16": bf16, "fp8": fp8_kv_step(bf16)}
        order = triton_decode.longest_first(bf16.metadata.seq_lens)
        for cache, tile, caps in REGISTER_SETTINGS:
            step = steps[cache]
            with decode_tile(tile):
                want = decode_only(step, max_seq_len=hi, order=order)().clone()
                for cap in caps:
                    with register_cap(cap):
                        launch = decode_only(step, max_seq_len=hi, order=order)
                        equal = torch.equal(launch(), want)
                        us = graph_us_per_launch(lambda _: launch(), [None] * 8)
                    rows.append(dict(part="registers", case=label, cache=cache, tile=list(tile),
                                     max_registers=cap, us=us,
                                     tb_s=kv_bytes(step) / us / 1e6, equal=equal))
                    print(f"registers {label:22} {cache:5} tile {tile} cap {cap}: {us:7.1f} us "
                          f"{rows[-1]['tb_s']:5.2f} TB/s{'' if equal else '  DIFFERS'}",
                          flush=True)
        del bf16, steps, step
        torch.cuda.empty_cache()
    return rows


WIDEN_CASES = REGISTER_CASES + (("4 x 32000 (split)", 4, 32000, 32000),)
WIDEN_TILES = ((64, 2, 2), (64, 4, 2), (128, 4, 2), (128, 8, 2))


@contextlib.contextmanager
def fp8_widening(mode: str) -> Iterator[None]:
    """Every decode launch inside widens an FP8 cache's tiles as ``mode`` says
    (``PAGEDLLM_FP8_KV_WIDEN``, read at each launch)."""
    configured = os.environ.get(FP8_KV_WIDEN_ENV)
    os.environ[FP8_KV_WIDEN_ENV] = mode
    try:
        yield
    finally:
        if configured is None:
            del os.environ[FP8_KV_WIDEN_ENV]
        else:
            os.environ[FP8_KV_WIDEN_ENV] = configured


def widen_rows() -> list[dict[str, Any]]:
    """``widen``: decode attention over an FP8 cache (bf16 queries, float16 products), its
    tiles widened at the products' operand loads or before the products, per tile."""
    rows: list[dict[str, Any]] = []
    for label, seqs, lo, hi in WIDEN_CASES:
        step = fp8_kv_step(make_step([(n - 1, 1) for n in uniform_lengths(seqs, lo, hi, seed=9)],
                                     seed=55))
        order = triton_decode.longest_first(step.metadata.seq_lens)
        for tile in WIDEN_TILES:
            with decode_tile(tile):
                with fp8_widening("operand"):
                    want = decode_only(step, max_seq_len=hi, order=order)().clone()
                for mode in ("operand", "staged"):
                    with fp8_widening(mode):
                        launch = decode_only(step, max_seq_len=hi, order=order)
                        diff = (launch().float() - want.float()).abs().max().item()
                        us = graph_us_per_launch(lambda _: launch(), [None] * 8)
                    rows.append(dict(part="widen", case=label, cache=mode, tile=list(tile),
                                     us=us, tb_s=kv_bytes(step) / us / 1e6, max_diff=diff))
                    print(f"widen {label:22} {mode:8} tile {tile}: {us:7.1f} us "
                          f"{rows[-1]['tb_s']:5.2f} TB/s, max diff {diff:.2e}", flush=True)
        del step
        torch.cuda.empty_cache()
    return rows


ENGINE_LAYER_BLOCKS = 110_000  # 16-token FP8 blocks a layer: 3.6 GB, an H200 engine's


def gap_rows() -> list[dict[str, Any]]:
    """``gap``: the kernel alone against the engine's launch, one difference at a time."""
    rows: list[dict[str, Any]] = []
    step = fp8_kv_step(make_step([(1023, 1)] * 512, seed=52))
    md = step.metadata
    gen = torch.Generator(device=DEVICE).manual_seed(53)
    num_blocks = step.kv_cache.shape[1]
    spread = torch.zeros((2, ENGINE_LAYER_BLOCKS) + tuple(step.kv_cache.shape[2:]),
                         dtype=step.kv_cache.dtype, device=DEVICE)
    where = torch.randperm(ENGINE_LAYER_BLOCKS, generator=gen, device=DEVICE)[:num_blocks]
    spread.view(torch.uint8)[:, where] = step.kv_cache.view(torch.uint8)  # whole blocks
    spread_tables = where[md.block_tables.long()].to(torch.int32)
    tokens = md.num_actual_tokens
    cos = torch.randn(tokens, HEAD_DIM // 2, generator=gen, device=DEVICE).to(DTYPE)
    sin = torch.randn(tokens, HEAD_DIM // 2, generator=gen, device=DEVICE).to(DTYPE)
    out = torch.empty_like(step.query)
    order = triton_decode.longest_first(md.seq_lens)
    for layout, cache, tables in (("blocks as made", step.kv_cache, md.block_tables),
                                  ("blocks spread over 3.6 GB", spread, spread_tables)):
        key_cache, value_cache = paged_kv_views(cache)
        slots = (tables.long().gather(1, ((md.seq_lens.long() - 1) // BLOCK_SIZE)[:, None])[:, 0]
                 * BLOCK_SIZE + (md.seq_lens.long() - 1) % BLOCK_SIZE)
        for rope_and_write in (False, True):
            new_kv = (triton_decode.NewKV(step.key, step.value, slots, cos, sin, tokens)
                      if rope_and_write else None)

            def launch(_: Any) -> torch.Tensor:
                triton_decode.paged_decode_attention(
                    step.query, key_cache, value_cache, tables, md.seq_lens,
                    md.query_start_loc, out, max_seq_len=md.max_seq_len, scale=HEAD_DIM**-0.5,
                    order=order, new_kv=new_kv, k_scale=0.37, v_scale=0.61)
                return out

            us = graph_us_per_launch(launch, [None] * 8)
            rows.append(dict(part="gap", case=layout, rope_and_write=rope_and_write, us=us,
                             tb_s=kv_bytes(step) / us / 1e6))
            print(f"gap {layout:26} rope+write {'on ' if rope_and_write else 'off'}: "
                  f"{us:7.1f} us {rows[-1]['tb_s']:5.2f} TB/s", flush=True)
    return rows  # the caches go with this frame


def silu_rows() -> list[dict[str, Any]]:
    """SiLU-and-mul with FP8 output over gate/up's sums before their scales (``Fp8Sums``,
    as the engine hands them over on Hopper), per launch, checked equal to the default."""
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=DEVICE).manual_seed(60)
    col_scale = torch.rand(2 * INTERMEDIATE, 1, generator=gen, device=DEVICE) * 1e-2 + 1e-3
    for m in ROWS:
        nbytes = m * 2 * INTERMEDIATE * 2
        row_scale = torch.rand(m, 1, generator=gen, device=DEVICE) * 1e-3 + 1e-4
        inputs = [(torch.randn(m, 2 * INTERMEDIATE, generator=gen, device=DEVICE) * 50).to(DTYPE)
                  for _ in range(min(copies_for(nbytes), 16))]
        want = triton_ops.silu_and_mul(inputs[0], fp8=True, sums_scales=(row_scale, col_scale))
        for setting in SILU_SETTINGS:
            launch = triton_ops.SiluFp8Launch(*setting)

            def run(x: torch.Tensor, launch=launch) -> tuple[torch.Tensor, torch.Tensor]:
                return triton_ops.silu_and_mul(x, fp8=True, sums_scales=(row_scale, col_scale),
                                               launch=launch)

            try:
                got = run(inputs[0])
            except Exception as error:  # noqa: BLE001 - a launch the GPU refuses (shared memory)
                print(f"silu rows {m:5} {setting}: {type(error).__name__}", flush=True)
                continue
            equal = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and \
                torch.equal(got[1], want[1])
            us = graph_us_per_launch(run, inputs)
            moved = nbytes + m * INTERMEDIATE + m * 4
            rows.append(dict(part="silu", rows=m, launch=list(setting), us=us,
                             tb_s=moved / us / 1e6, equal=equal))
            print(f"silu rows {m:5} launch {setting}: {us:7.1f} us "
                  f"{rows[-1]['tb_s']:5.2f} TB/s{'' if equal else '  DIFFERS'}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows


ARGMAX_PROGRAMS = (2, 4, 8, 16, 32)
VOCAB = 128_256


def argmax_rows() -> list[dict[str, Any]]:
    """The sampler's pass over a step's logits (``triton_ops.greedy_argmax`` and the Gumbel
    draw, bf16 logits of Llama-3's vocabulary) per ``ARGMAX_PROGRAMS_PER_SM``, the rows split
    into parts to reach it; each checked equal to the engine's setting."""
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=DEVICE).manual_seed(62)
    configured = triton_ops.ARGMAX_PROGRAMS_PER_SM
    for m in ROWS[:3]:
        logits = [torch.randn(m, VOCAB, generator=gen, device=DEVICE).to(DTYPE)
                  for _ in range(min(copies_for(m * VOCAB * 2), 16))]
        temperature = torch.full((m,), 0.8, device=DEVICE)
        seeds = torch.arange(m, device=DEVICE, dtype=torch.int64)
        draws = {"greedy": triton_ops.greedy_argmax,
                 "gumbel": lambda x: triton_ops.gumbel_sample(x, temperature, seeds)}
        for kind, draw in draws.items():
            want = draw(logits[0])
            for programs in ARGMAX_PROGRAMS:
                triton_ops.ARGMAX_PROGRAMS_PER_SM = programs
                try:
                    equal = torch.equal(draw(logits[0]), want)
                    us = graph_us_per_launch(draw, logits)
                finally:
                    triton_ops.ARGMAX_PROGRAMS_PER_SM = configured
                rows.append(dict(part="argmax", rows=m, fp8=kind, programs_per_sm=programs,
                                 us=us, tb_s=m * VOCAB * 2 / us / 1e6, equal=equal))
                print(f"argmax {kind:6} rows {m:4} programs/SM {programs:2}: {us:7.1f} us "
                      f"{rows[-1]['tb_s']:5.2f} TB/s{'' if equal else '  DIFFERS'}", flush=True)
        del logits
        torch.cuda.empty_cache()
    return rows


def norm_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=DEVICE).manual_seed(61)
    weight = torch.randn(HIDDEN, generator=gen, device=DEVICE).to(DTYPE)
    for m in ROWS:
        nbytes = 2 * m * HIDDEN * 2
        pairs = [(torch.randn(m, HIDDEN, generator=gen, device=DEVICE).to(DTYPE),
                  torch.randn(m, HIDDEN, generator=gen, device=DEVICE).to(DTYPE))
                 for _ in range(min(copies_for(nbytes), 16))]
        for fp8 in (False, True):
            want = triton_ops.rms_norm(pairs[0][0], weight, 1e-5, pairs[0][1], fp8=fp8)
            configured = _NORM_WARPS(HIDDEN)
            for warps in NORM_WARPS:
                triton_ops._norm_warps = lambda block, fp8_out=False, w=warps: w
                try:
                    got = triton_ops.rms_norm(pairs[0][0], weight, 1e-5, pairs[0][1], fp8=fp8)
                    us = graph_us_per_launch(
                        lambda p: triton_ops.rms_norm(p[0], weight, 1e-5, p[1], fp8=fp8), pairs)
                finally:
                    triton_ops._norm_warps = _NORM_WARPS
                equal = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                            for a, b in zip(_flat(got), _flat(want)))
                moved = nbytes + m * HIDDEN * (3 if fp8 else 4)
                rows.append(dict(part="norm", rows=m, fp8=fp8, warps=warps,
                                 configured=warps == configured, us=us,
                                 tb_s=moved / us / 1e6, equal=equal))
                print(f"norm rows {m:5} {'fp8 ' if fp8 else 'bf16'} warps {warps:2}"
                      f"{' (configured)' if warps == configured else ''}: {us:7.1f} us "
                      f"{rows[-1]['tb_s']:5.2f} TB/s{'' if equal else '  DIFFERS'}", flush=True)
        del pairs
        torch.cuda.empty_cache()
    return rows


_NORM_WARPS = triton_ops._norm_warps


def _flat(value) -> list[torch.Tensor]:
    """The tensors of a nested tuple of outputs, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _flat(v)]


def best_table(rows: list[dict[str, Any]]) -> str:
    """The fastest setting of each case beside the engine's, one line each."""
    lines = []
    keyed: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["part"], row.get("case"), row.get("cache"), row.get("rows"), row.get("fp8"))
        keyed.setdefault(key, []).append(row)
    for key, group in keyed.items():
        # A decode tile sums in another order (outputs differ in the last bits).
        best = min((r for r in group if r.get("equal", True) or r["part"] in ("decode", "widen")),
                   key=lambda r: r["us"])
        setting = {k: best[k] for k in ("tile", "max_registers", "block", "warps", "launch",
                                          "programs_per_sm",
                                          "rope_and_write") if k in best}
        lines.append(f"{' '.join(str(k) for k in key if k is not None):32} best {best['us']:7.1f} us "
                     f"{setting}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="decode,gap,silu,norm")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode_step_sweep.py needs a CUDA GPU.")
        return 2
    parts = {"decode": decode_rows, "gap": gap_rows, "silu": silu_rows, "norm": norm_rows,
             "registers": register_rows, "argmax": argmax_rows, "widen": widen_rows}
    rows: list[dict[str, Any]] = []
    for name in args.parts.split(","):
        rows += parts[name]()
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows},
                                       indent=1) + "\n")
    print(best_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
