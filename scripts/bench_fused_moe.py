"""Time one mixture-of-experts layer on a GPU: the grouped Triton GEMM
(``layers/fused_moe/triton_moe.py``) against the loop over experts (``torch_ref.py``),
at Mixtral-8x7B's and Qwen3-30B-A3B's expert shapes, after checking they agree.

Usage: python scripts/bench_fused_moe.py [--tokens 1,16,256,4096] [--dtype bfloat16]
       [--fp8 channel|block] [--int-bits 4|8]

``--fp8``: the same layers with FP8 experts (per-channel scales, or 128 x 128 blocks) timed
beside the model dtype's, each checked once against the FP8 reference. ``--int-bits``: with
integer experts (W4A16 / W8A16, groups of 128, rounded to nearest) the same way.

``--sweep --out FILE.json [--budget-s S]`` times, per (shape, tokens), the tile
``tiles.choose_tile`` picks, a grid of candidate tiles, and the loop over experts; each
tile's output is checked once against the loop's. The fused calls are timed as CUDA graph
replays (the sort and both launches are graph-safe), the loop, which reads its experts'
row counts on the host, with events over many calls. Candidates run tile by tile across
all (shape, tokens) pairs, so a budget cut leaves every pair with the same tiles timed.
All rows go to FILE.json; the last lines printed are a table per (shape, tokens):
configured ms, best tile and its ms, loop ms. A best tile is pinned for a run with
``PAGEDLLM_MOE_TILE`` or for good in ``tiles.DEFAULT_TILES``.

``--tiny`` (automatic without CUDA) sweeps small shapes with a few tiles, under Triton's
interpreter on the CPU, timed by the host clock: a check that the sweep runs end to end,
not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.layers.fused_moe.routing import select_experts  # noqa: E402
from pagedllm.layers.fused_moe.tiles import MoeTile, choose_tile, row_bucket  # noqa: E402
from pagedllm.layers.fused_moe.torch_ref import (  # noqa: E402
    ExpertInts,
    ExpertScales,
    fused_moe_reference,
)
from pagedllm.layers.fused_moe.triton_moe import fused_moe_triton  # noqa: E402
from pagedllm.quantization.fp8 import quantize_groups, quantize_rows  # noqa: E402
from pagedllm.quantization.int_weights import pack_rows  # noqa: E402

INT_GROUP = 128

# name: (experts, top_k, hidden, expert intermediate, renormalize)
SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336, True), "qwen3-30b-a3b": (128, 8, 2048, 768, True)}
SWEEP_TOKENS = "1,16,64,256,1024,4096"
# Few and many experts, widths that do not fill a tile.
TINY_SHAPES = {"tiny-4e": (4, 2, 32, 48, True), "tiny-8e": (8, 4, 32, 24, True)}
TINY_TOKENS = "1,8"
TINY_CANDIDATES = (MoeTile(32, 16, 16, group_m=2, num_warps=4, num_stages=2),)
# Largest output error, as a fraction of the largest output, that a tile may show.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
SHARED_MEMORY_BYTES = 220 * 1024  # a Hopper SM's 227 KiB, less Triton's own


def _time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _iters_for(ms: float, target_ms: float = 50.0) -> int:
    return max(5, min(200, round(target_ms / max(ms, 1e-3))))


def _graph_ms(fn) -> float:
    """Milliseconds a replay of ``fn`` captured in a CUDA graph (``fn`` already ran once,
    so its kernels are compiled)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(2):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    iters = _iters_for(start.elapsed_time(end))
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _events_ms(fn) -> float:
    """Milliseconds a call of ``fn``, launched back to back, between CUDA events."""
    return _time_ms(fn, iters=_iters_for(_time_ms(fn, iters=1)))


def candidate_tiles(rows_per_expert: float) -> list[MoeTile]:
    """The sweep's grid for a batch with this many slots per expert on average: row
    blocks from an eighth to four times the rows (16 to 128), column and reduction blocks
    of 64 to 256, 4 or 8 warps with at most 128 accumulator floats a thread (the gated
    GEMM holds two ``BLOCK_M x BLOCK_N`` accumulators), 3, 4 or 2 stages whose operand
    buffers fit an H200 SM's shared memory; 3 stages first."""
    tiles = []
    for num_stages in (3, 4, 2):
        for block_m in (16, 32, 64, 128):
            if not min(64, rows_per_expert / 8) <= block_m <= max(16, 4 * rows_per_expert):
                continue
            for block_n, block_k in ((64, 64), (64, 128), (128, 64), (128, 128), (256, 64),
                                     (64, 256)):
                stage_bytes = (block_m * block_k + 2 * block_k * block_n) * 2
                if num_stages * stage_bytes > SHARED_MEMORY_BYTES:
                    continue
                for num_warps in (4, 8):
                    per_thread = 2 * block_m * block_n / (32 * num_warps)
                    if per_thread <= 128 and (num_warps == 4 or block_m * block_n >= 64 * 64):
                        tiles.append(MoeTile(block_m, block_n, block_k, num_warps=num_warps,
                                             num_stages=num_stages))
    return tiles


def _interleave(lists: list[list[MoeTile]]) -> list[MoeTile]:
    """Each list's first tile, then each one's second, ..., without repeats: the order
    the sweep times tiles in, so a budget cut leaves every pair a fair share."""
    order: dict[MoeTile, None] = {}
    for rank in range(max(map(len, lists), default=0)):
        order.update((tiles[rank], None) for tiles in lists if rank < len(tiles))
    return list(order)


class Case:
    """One (shape, tokens) pair: its weights, routed inputs and the loop's output."""

    def __init__(self, name: str, shape: tuple, tokens: int, layer: dict, device: str,
                 dtype: torch.dtype, gen: torch.Generator) -> None:
        experts, top_k, hidden, inter, renormalize = shape
        self.w13, self.w2 = layer["w13"], layer["w2"]
        self.x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
        self.weights, self.ids = select_experts(self.x @ layer["router"].T, top_k, renormalize)
        self.rows_per_expert = tokens * top_k / experts
        self.configured = choose_tile(experts, tokens * top_k)
        self.info = dict(shape=name, experts=experts, top_k=top_k, hidden=hidden, inter=inter,
                         dtype=str(dtype).removeprefix("torch."), tokens=tokens,
                         rows_per_expert=self.rows_per_expert,
                         bucket=row_bucket(tokens * top_k, experts))
        self.ref = self.loop()
        self.tolerance = TOLERANCE[dtype]

    def fused(self, tile: MoeTile) -> torch.Tensor:
        return fused_moe_triton(self.x, self.w13, self.w2, self.weights, self.ids, tile=tile)

    def loop(self) -> torch.Tensor:
        return fused_moe_reference(self.x, self.w13, self.w2, self.weights, self.ids)

    def error(self, out: torch.Tensor) -> float:
        ref = self.ref.float()
        return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _layer(shape: tuple, device: str, dtype: torch.dtype, gen: torch.Generator) -> dict:
    experts, _, hidden, inter, _ = shape
    return dict(
        w13=(torch.randn(experts, 2 * inter, hidden, device=device, generator=gen)
             * hidden ** -0.5).to(dtype),
        w2=(torch.randn(experts, hidden, inter, device=device, generator=gen)
            * inter ** -0.5).to(dtype),
        router=torch.randn(experts, hidden, device=device, generator=gen).to(dtype))


def _cases(shapes: dict, tokens: list[int], device: str, dtype: torch.dtype) -> list[Case]:
    cases = []
    for name, shape in shapes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        layer = _layer(shape, device, dtype, gen)
        cases += [Case(name, shape, count, layer, device, dtype, gen) for count in tokens]
    return cases


def _time_tile(case: Case, tile: MoeTile, kind: str, on_cuda: bool) -> dict:
    """One row: the tile's ms and its error against the loop; a tile that fails to
    compile or launch gets ``error`` and no ms."""
    row = dict(case.info, kind=kind, tile=tile.spec(), ms=None, timing=None,
               max_rel_err=None, ok=False, error=None)
    try:
        start = time.perf_counter()
        out = case.fused(tile)
        if on_cuda:
            torch.cuda.synchronize()
        clock_ms = (time.perf_counter() - start) * 1e3
        row["max_rel_err"] = case.error(out)
        row["ok"] = row["max_rel_err"] <= case.tolerance
        if not on_cuda:
            row["ms"], row["timing"] = clock_ms, "cpu-clock"
            return row
        try:
            row["ms"], row["timing"] = _graph_ms(lambda: case.fused(tile)), "cuda-graph"
        except RuntimeError:  # not capturable here: time the launches instead
            row["ms"], row["timing"] = _events_ms(lambda: case.fused(tile)), "cuda-events"
    except Exception as error:  # noqa: BLE001 - a tile that cannot run is a result
        row["ok"] = False
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return row


def _time_loop(case: Case, on_cuda: bool) -> dict:
    row = dict(case.info, kind="loop", tile=None, max_rel_err=0.0, ok=True, error=None)
    if on_cuda:
        row["ms"], row["timing"] = _events_ms(case.loop), "cuda-events"
    else:
        start = time.perf_counter()
        case.loop()
        row["ms"], row["timing"] = (time.perf_counter() - start) * 1e3, "cpu-clock"
    return row


def summary(rows: list[dict]) -> list[dict]:
    """Per (shape, tokens), in the order first seen: configured ms, the fastest tile that
    agrees with the loop (configured included) and its ms, loop ms."""
    out: dict[tuple, dict] = {}
    for row in rows:
        entry = out.setdefault((row["shape"], row["tokens"]), dict(
            shape=row["shape"], tokens=row["tokens"], bucket=row["bucket"], configured=None,
            configured_ms=None, best=None, best_ms=None, loop_ms=None))
        if row["kind"] == "loop":
            entry["loop_ms"] = row["ms"]
            continue
        if row["kind"] == "configured":
            entry["configured"], entry["configured_ms"] = row["tile"], row["ms"]
        if row["ok"] and row["ms"] is not None and (entry["best_ms"] is None
                                                    or row["ms"] < entry["best_ms"]):
            entry["best"], entry["best_ms"] = row["tile"], row["ms"]
    return list(out.values())


def _print_summary(rows: list[dict]) -> None:
    def ms(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    print(f"{'shape':<16} {'tokens':>6} {'bucket':>7} {'configured':>18} {'ms':>8} "
          f"{'best tile':>18} {'ms':>8} {'loop ms':>8}")
    for e in summary(rows):
        print(f"{e['shape']:<16} {e['tokens']:>6} {e['bucket']:>7} {e['configured'] or '-':>18} "
              f"{ms(e['configured_ms']):>8} {e['best'] or '-':>18} {ms(e['best_ms']):>8} "
              f"{ms(e['loop_ms']):>8}", flush=True)


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text(json.dumps(rows, indent=1) + "\n")


def sweep(args: argparse.Namespace) -> list[dict]:
    """Every row of the sweep, also written to ``args.out``."""
    on_cuda = torch.cuda.is_available()
    tiny = args.tiny or not on_cuda
    if not on_cuda:  # the interpreter, set before the kernels' module is imported
        from tests.triton_interpreter import interpret_without_cuda

        interpret_without_cuda()
    device = "cuda" if on_cuda else "cpu"
    dtype = getattr(torch, args.dtype or ("float32" if tiny else "bfloat16"))
    shapes = TINY_SHAPES if tiny else SHAPES
    tokens = [int(t) for t in (args.tokens or (TINY_TOKENS if tiny else SWEEP_TOKENS)).split(",")]
    deadline = time.monotonic() + args.budget_s
    out = Path(args.out)
    rows: list[dict] = []
    cases = _cases(shapes, tokens, device, dtype)
    for case in cases:
        if time.monotonic() > deadline:
            break
        rows.append(_time_tile(case, case.configured, "configured", on_cuda))
        rows.append(_time_loop(case, on_cuda))
    _write(out, rows)
    grid = {id(case): ([t for t in TINY_CANDIDATES if t != case.configured] if tiny else
                       [t for t in candidate_tiles(case.rows_per_expert) if t != case.configured])
            for case in cases}
    tiles = _interleave([grid[id(case)] for case in cases])
    done = 0
    for number, tile in enumerate(tiles, 1):
        if time.monotonic() > deadline:
            break
        for case in cases:
            if tile in grid[id(case)] and time.monotonic() <= deadline:
                rows.append(_time_tile(case, tile, "candidate", on_cuda))
                done += 1
        _write(out, rows)
        print(f"tile {number}/{len(tiles)} {tile.spec()}: {done} timings so far, "
              f"{time.monotonic() - deadline + args.budget_s:.0f} s", file=sys.stderr, flush=True)
    total = sum(len(g) for g in grid.values())
    setting = ("tiny shapes, " if tiny else "") + f"{device}, {cases[0].info['dtype']}"
    print(f"{done} of {total} candidate timings in the {args.budget_s:.0f} s budget ({setting}); "
          f"rows in {out}", flush=True)
    _print_summary(rows)
    return rows


def fp8_experts(case: Case, kind: str) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
    """``case``'s expert weights in FP8: per output channel, or per 128 x 128 block (each
    block's scale from its largest magnitude)."""
    block = (128, 128) if kind == "block" else None

    def quantize(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts, rows, cols = weights.shape
        if block is None:
            q, scale = quantize_rows(weights.reshape(-1, cols))
            return q.view(weights.shape), scale.view(experts, rows, 1)
        # Rows of blocks: each block's rows quantized as one group of its 128 columns.
        tiles = weights.reshape(experts, rows // 128, 128, cols).transpose(2, 3)
        q, scale = quantize_groups(tiles.reshape(-1, 128 * 128), 128 * 128)
        q = q.view(experts, rows // 128, cols, 128).transpose(2, 3).reshape(weights.shape)
        return q.contiguous(), scale.view(experts, rows // 128, cols // 128)

    (q13, s13), (q2, s2) = quantize(case.w13), quantize(case.w2)
    return q13, q2, ExpertScales(s13, s2, block)


def int_experts(case: Case, bits: int) -> tuple[torch.Tensor, torch.Tensor, ExpertInts]:
    """``case``'s expert weights as ``bits``-bit integers in groups of ``INT_GROUP`` inputs,
    rounded to nearest: symmetric (zero point ``2**(bits-1)``, scale ``max|w| / (2**(bits-1)
    - 1)``), packed in the stored layout, scales in the weights' dtype."""
    middle = 1 << (bits - 1)

    def quantize(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        experts, rows, cols = weights.shape
        groups = weights.float().reshape(experts, rows, cols // INT_GROUP, INT_GROUP)
        scale = groups.abs().amax(-1).clamp_min(1e-8) / (middle - 1)
        codes = (groups / scale[..., None]).round().clamp(-middle, middle - 1) + middle
        packed = pack_rows(codes.reshape(experts * rows, cols).to(torch.int32), bits)
        zeros = torch.full(scale.shape, middle, dtype=torch.uint8, device=weights.device)
        return packed.view(experts, rows, -1), scale.to(weights.dtype), zeros

    (q13, s13, z13), (q2, s2, z2) = quantize(case.w13), quantize(case.w2)
    return q13, q2, ExpertInts(s13, z13, s2, z2, bits, INT_GROUP)


def quantized_forms(args: argparse.Namespace) -> list[tuple[str, object]]:
    """(label, function of a case giving ``(w13, w2, scales)``) per quantized form asked."""
    forms = []
    if args.fp8:
        forms.append((f"FP8 ({args.fp8})", lambda case: fp8_experts(case, args.fp8)))
    if args.int_bits:
        forms.append((f"int{args.int_bits}", lambda case: int_experts(case, args.int_bits)))
    return forms


def compare(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("Timing the MoE layer needs CUDA; on the CPU run --sweep (tiny shapes "
                         "under Triton's interpreter).")
    dtype = getattr(torch, args.dtype or "bfloat16")
    tokens = [int(t) for t in (args.tokens or "1,16,256,4096").split(",")]
    forms = quantized_forms(args)
    print("shape, tokens, fused ms, expert loop ms, speed-up, max abs diff / max abs"
          + "".join(f", {label} fused ms, {label} / {dtype}, {label} error"
                    for label, _ in forms))
    for case in _cases(SHAPES, tokens, "cuda", dtype):
        err = case.error(case.fused(case.configured))
        t_fused = _time_ms(lambda case=case: case.fused(case.configured))
        t_loop = _time_ms(case.loop)
        line = (f"{case.info['shape']}, {case.info['tokens']}, {t_fused:.3f}, {t_loop:.3f}, "
                f"{t_loop / t_fused:.2f}x, {err:.2e}")
        for _, make in forms:
            q13, q2, scales = make(case)

            def quantized(case=case, q13=q13, q2=q2, scales=scales):
                return fused_moe_triton(case.x, q13, q2, case.weights, case.ids, scales=scales)

            want = fused_moe_reference(case.x, q13, q2, case.weights, case.ids, scales=scales)
            err = ((quantized().float() - want.float()).abs().max()
                   / want.float().abs().max().clamp_min(1e-30)).item()
            t_quantized = _time_ms(quantized)
            line += f", {t_quantized:.3f}, {t_quantized / t_fused:.2f}, {err:.2e}"
        print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", help="comma-separated token counts")
    parser.add_argument("--dtype", help="bfloat16 (float32 with --tiny)")
    parser.add_argument("--sweep", action="store_true", help="time a grid of tiles")
    parser.add_argument("--out", help="the sweep's JSON rows")
    parser.add_argument("--budget-s", type=float, default=1200.0,
                        help="seconds after which the sweep stops timing")
    parser.add_argument("--tiny", action="store_true",
                        help="small shapes and tiles (automatic without CUDA)")
    parser.add_argument("--fp8", choices=["channel", "block"],
                        help="also time FP8 experts (per-channel or 128 x 128 block scales)")
    parser.add_argument("--int-bits", type=int, choices=[4, 8],
                        help="also time integer experts of this many bits (groups of 128)")
    args = parser.parse_args(argv)
    if args.sweep:
        if not args.out:
            parser.error("--sweep needs --out FILE.json")
        if args.fp8 or args.int_bits:
            parser.error("--fp8 and --int-bits time the configured tiles beside bf16's; the "
                         "sweep takes the model dtype only: drop one of them")
        sweep(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
