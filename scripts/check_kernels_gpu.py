#!/usr/bin/env python3
"""Check the Triton attention kernels against the torch reference on a CUDA GPU, and time them.

The comparisons of ``tests/kernels`` at real sizes: Llama-3.1-8B attention (32 query heads,
8 KV heads, head_dim 128), bf16, block size 16, contexts up to 8k tokens, up to 256 decodes
in a step. Each case runs the Triton backend and the torch reference in bf16 on the same
inputs and measures both against the torch reference computed in fp32; the Triton output
passes when its error is within twice the bf16 reference's own error (or 1e-2) and the KV
cache both leave behind is bit-identical. Then it times decode attention for a 256 x 1024
batch and a few other shapes, prints a table, and writes everything as JSON to ``--out``.

    python scripts/check_kernels_gpu.py --out kernels.json [--sweep]

``--sweep`` also times the decode and prefill kernels over a grid of tile sizes, warps and
pipeline stages (what the defaults in ``triton_decode.py`` / ``triton_prefill.py`` are
chosen from), for at most ``--sweep-budget-s`` seconds. ``--decode-order-sweep`` times
decode on W1-like length mixes with and without starting the longest sequences first,
across splits and tiles. ``--gemv-sweep`` times ``small_batch_matmul`` (the decode
projections of a few sequences) over its tiles against cuBLAS on Llama-3.1-8B's shapes,
and writes the single tile fastest over the layer's four projections to ``--gemv-tile-out``
(the format of ``PAGEDLLM_GEMV_TILE``). ``--decode-splits`` times decode attention by
batch size (2 to 256 sequences) over split counts and tiles inside CUDA graphs, beside
the engine's own plan. ``--gemv-fp8-sweep`` does the same for FP8 weights (W8A8) inside CUDA graphs, beside the
bf16 tile; ``--fp8-gemm`` times the larger products, bf16 against FP8 ``_scaled_mm`` and
the input quantization. ``--fp8-kv`` checks the kernels over an FP8 KV cache
(``--kv-cache-dtype fp8``, scales that are no powers of two) against the torch reference on
the same cache (the bytes written must be identical), then times decode attention over
bf16 and FP8 caches across tiles. ``--skip-checks`` leaves out the checks and the standard
timings. ``--long-context`` times fresh long prompts through the Triton prefill kernel and
through torch's fused attention by backend (``PAGEDLLM_DENSE_PREFILL``), prefill attention
of long prompts over tiles and tile order, and decode attention at long contexts over
splits and tiles. Exits 1 when a check
fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.layers.attention import (  # noqa: E402
    dense_prefill, triton_decode, triton_prefill,
)
from pagedllm.layers.attention.backend import AttentionMetadata  # noqa: E402
from pagedllm.layers.attention.kv_quant import paged_kv_views  # noqa: E402
from pagedllm.layers.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from pagedllm.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.layers.attention.triton_decode import paged_decode_attention  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SCALE = HEAD_DIM**-0.5
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")


@dataclass
class Step:
    """One step over ``seqs = ((cached, new), ...)``: context already in shuffled blocks,
    NaN in every slot no sequence has written."""

    seqs: list[tuple[int, int]]
    kv_cache: torch.Tensor
    metadata: AttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


def make_step(seqs: list[tuple[int, int]], seed: int) -> Step:
    device = DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    cached = torch.tensor([c for c, _ in seqs], device=device)
    new = torch.tensor([n for _, n in seqs], device=device)
    seq_lens = cached + new
    blocks = (seq_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = int(blocks.sum()) + 1
    order = torch.randperm(num_blocks, device=device, generator=gen)
    owned = torch.arange(int(blocks.max()), device=device)
    first = torch.cumsum(blocks, 0) - blocks
    tables = torch.where(
        owned[None, :] < blocks[:, None],
        order[(first[:, None] + owned[None, :]).clamp(max=num_blocks - 1)],
        0,
    ).to(torch.int32)

    def slots(lo: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        seq = torch.repeat_interleave(torch.arange(len(seqs), device=device), count)
        start = torch.cumsum(count, 0) - count
        pos = lo[seq] + torch.arange(int(count.sum()), device=device) - start[seq]
        return tables[seq, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE

    cache = torch.full(
        (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=DTYPE, device=device
    )
    context_slots = slots(torch.zeros_like(cached), cached)
    cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)[:, context_slots] = torch.randn(
        2, len(context_slots), NUM_KV_HEADS, HEAD_DIM, generator=gen, device=device
    ).to(DTYPE)
    slot_mapping = slots(cached, new)
    num_tokens = int(new.sum())

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(DTYPE)

    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=tables,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(c + n for c, n in seqs),
        block_size=BLOCK_SIZE,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=[c + n for c, n in seqs],
    )
    return Step(
        list(seqs), cache, metadata,
        randn(num_tokens, NUM_HEADS, HEAD_DIM),
        randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
    )


def uniform_lengths(count: int, lo: int, hi: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (count,), generator=gen).tolist()


def check_cases() -> list[tuple[str, list[tuple[int, int]], int | None]]:
    """(name, seqs, sliding window) of every comparison."""
    decodes_8k = [(n - 1, 1) for n in uniform_lengths(64, 1, 8192, seed=1)]
    mixed = [(n - 1, 1) for n in uniform_lengths(200, 100, 2000, seed=2)]
    mixed += [(1024, 256), (0, 200), (1500, 77)]
    return [
        ("prefill 4 x 2048", [(0, 2048)] * 4, None),
        ("chunked prefill, context to 8k", [(3000, 512), (7680, 512), (0, 700), (15, 1)], None),
        ("prefill, window 1024", [(2000, 1000), (0, 1500)], 1024),
        ("decode 256 x 1024", [(1023, 1)] * 256, None),
        ("decode 64, contexts 1..8k", decodes_8k, None),
        ("decode 1 x 8192 (split-K)", [(8191, 1)], None),
        ("decode 64, window 4096", decodes_8k, 4096),
        ("mixed 200 decodes + 3 chunks", mixed, None),
    ]


def run_check(name: str, seqs: list[tuple[int, int]], window: int | None, seed: int) -> dict[str, Any]:
    step = make_step(seqs, seed)
    md = step.metadata
    ref32_cache = step.kv_cache.float()
    ref32 = TorchReferenceBackend().forward(
        step.query.float(), step.key.float(), step.value.float(), ref32_cache, md, SCALE, window
    )
    del ref32_cache
    ref_cache = step.kv_cache.clone()
    ref = TorchReferenceBackend().forward(
        step.query, step.key, step.value, ref_cache, md, SCALE, window
    )
    tri_cache = step.kv_cache.clone()
    out = TritonAttentionBackend().forward(
        step.query, step.key, step.value, tri_cache, md, SCALE, window
    )
    torch.cuda.synchronize()
    triton_err = (out.float() - ref32).abs().max().item()
    ref_err = (ref.float() - ref32).abs().max().item()
    cache_exact = torch.equal(ref_cache.view(torch.int16), tri_cache.view(torch.int16))
    finite = bool(out.isfinite().all())
    ok = finite and cache_exact and triton_err <= max(2 * ref_err, 1e-2)
    return dict(
        case=name, num_seqs=len(seqs), num_tokens=md.num_actual_tokens,
        max_seq_len=md.max_seq_len, sliding_window=window,
        triton_max_abs_err=triton_err, torch_bf16_max_abs_err=ref_err,
        cache_exact=cache_exact, finite=finite, ok=ok,
    )


def bench_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def kv_bytes(step: Step) -> int:
    """Bytes of K and V the step's attention must read (each context token once per KV head)."""
    tokens = sum(c + n for c, n in step.seqs)
    return 2 * tokens * NUM_KV_HEADS * HEAD_DIM * step.kv_cache.element_size()


def causal_flops(step: Step) -> float:
    """Matmul FLOPs of the step's attention (QK^T and PV over the causally visible keys)."""
    pairs = sum(n * c + n * (n + 1) / 2 for c, n in step.seqs)
    return 4.0 * pairs * NUM_HEADS * HEAD_DIM


def decode_only(step: Step, num_splits: int | None = None,
                max_seq_len: int | None = None, order: torch.Tensor | None = None,
                slot_rows: bool = False) -> Callable[[], torch.Tensor]:
    """The decode kernel alone (the launch returns its output); ``max_seq_len`` overrides
    the step's bound (a CUDA graph plans with ``max_model_len``). ``slot_rows``: read the
    values as slot rows, the layout an FP8 cache had before its values became slot-major
    (``kv_quant.paged_kv_views``)."""
    md = step.metadata
    bound = md.max_seq_len if max_seq_len is None else max_seq_len
    out = torch.empty_like(step.query)
    TritonAttentionBackend().forward(step.query, step.key, step.value, step.kv_cache, md, SCALE, None)
    key_cache, value_cache = paged_kv_views(step.kv_cache)
    if slot_rows:
        key_cache, value_cache = step.kv_cache[0], step.kv_cache[1]

    def launch() -> torch.Tensor:
        paged_decode_attention(
            step.query, key_cache, value_cache, md.block_tables, md.seq_lens,
            md.query_start_loc, out, max_seq_len=bound, scale=SCALE, num_splits=num_splits,
            order=order,
        )
        return out

    return launch


def forward(backend: Any, step: Step, keep: bool = False) -> Callable[[], Any]:
    """One call of the backend on ``step``; ``keep``: the call returns the output."""
    def launch() -> Any:
        out = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata,
                              SCALE, None)
        return out if keep else None

    return launch


def timing_rows() -> list[dict[str, Any]]:
    """One row per (shape, implementation): milliseconds, and K/V bytes read per second for
    decode-bound shapes or matmul FLOP/s for prefill-bound ones."""
    triton_backend, torch_backend = TritonAttentionBackend(), TorchReferenceBackend()

    def backend(b: Any) -> Callable[[Step], Callable[[], None]]:
        return lambda step: forward(b, step)

    def splits(n: int | None) -> Callable[[Step], Callable[[], None]]:
        return lambda step: decode_only(step, n)

    mixed = [(n - 1, 1) for n in uniform_lengths(240, 100, 2000, seed=15)] + [(1024, 256)]
    plan: list[tuple[str, list[tuple[int, int]], str, list[tuple[str, Any]]]] = [
        ("decode 256 x 1024", [(1023, 1)] * 256, "gb_s", [
            ("triton decode kernel", splits(None)),
            ("triton backend (write + decode)", backend(triton_backend)),
            ("torch reference", backend(torch_backend)),
        ]),
        ("decode 1 x 8192", [(8191, 1)], "gb_s", [
            ("triton, split-K (auto)", splits(None)), ("triton, one pass", splits(1)),
        ]),
        ("decode 32 x 8192", [(8191, 1)] * 32, "gb_s", [
            ("triton, split-K (auto)", splits(None)), ("triton, one pass", splits(1)),
        ]),
        ("prefill 4 x 2048", [(0, 2048)] * 4, "tflop_s", [
            ("triton backend", backend(triton_backend)), ("torch reference", backend(torch_backend)),
        ]),
        ("chunk 512 on 8k/3k context", [(7680, 512), (3000, 512)], "tflop_s", [
            ("triton backend", backend(triton_backend)),
        ]),
        ("mixed 240 decodes + chunk 256", mixed, "gb_s", [
            ("triton backend", backend(triton_backend)), ("torch reference", backend(torch_backend)),
        ]),
    ]
    rows: list[dict[str, Any]] = []
    for seed, (case, seqs, rate, impls) in enumerate(plan, start=10):
        step = make_step(seqs, seed)
        for impl, launcher in impls:
            ms = bench_ms(launcher(step))
            per_ms = kv_bytes(step) / 1e6 if rate == "gb_s" else causal_flops(step) / 1e9
            rows.append({"case": case, "impl": impl, "ms": ms, rate: per_ms / ms})
        del step
        torch.cuda.empty_cache()
    return rows


def sweep_rows(budget_s: float, save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Time the kernels over tile configurations by replacing the config functions; stops
    starting new configurations after ``budget_s`` seconds."""
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget_s
    decode_config, prefill_config = triton_decode.decode_tile_config, triton_prefill.prefill_tile_config
    decode_grid = [(n, w, s) for n in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3)]
    prefill_grid = [(m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
    # Decide tiles on workload-like mixes: a tile that won "256 x 1024" alone lost on W1.
    w1_mix = [(n - 1, 1) for n in uniform_lengths(256, 100, 2048, seed=21)]
    small_mix = [(n - 1, 1) for n in uniform_lengths(8, 100, 2048, seed=22)]
    cases: list[tuple[str, list[tuple[int, int]], str, int | None]] = [
        ("decode W1 mix 256 x 100..2048", w1_mix, "decode", None),
        ("decode 8 x 100..2048, graph bound", small_mix, "decode", 131072),
        ("decode 256 x 1024", [(1023, 1)] * 256, "decode", None),
        ("prefill 4 x 2048", [(0, 2048)] * 4, "prefill", None),
        ("decode 4 x 8192", [(8191, 1)] * 4, "decode", None),
    ]
    try:
        for label, seqs, kind, bound in cases:
            step = make_step(seqs, seed=20)
            for knobs in decode_grid if kind == "decode" else prefill_grid:
                if time.monotonic() > deadline:
                    return rows
                if kind == "decode":
                    triton_decode.decode_tile_config = (
                        lambda *_, c=knobs, **__: c)
                    names = ("block_n", "num_warps", "num_stages")
                    launch = decode_only(step, max_seq_len=bound)
                else:
                    triton_prefill.prefill_tile_config = lambda q, g, h, d, c=knobs: c
                    names = ("block_m", "block_n", "num_warps", "num_stages")
                    launch = forward(TritonAttentionBackend(), step)
                row: dict[str, Any] = dict(case=label, **dict(zip(names, knobs)))
                try:
                    row["ms"] = bench_ms(launch)
                except Exception as exc:  # e.g. a tile that needs more shared memory than there is
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                else:
                    if kind == "decode":
                        row["gb_s"] = kv_bytes(step) / row["ms"] / 1e6
                    else:
                        row["tflop_s"] = causal_flops(step) / row["ms"] / 1e9
                rows.append(row)
                save(rows)
            del step
    finally:
        triton_decode.decode_tile_config = decode_config
        triton_prefill.prefill_tile_config = prefill_config
    return rows


def w1_decode_mixes() -> list[tuple[str, list[tuple[int, int]]]]:
    """Decode batches like W1's: (label, ((cached, 1), ...))."""
    return [
        ("W1 mix 256 x 100..2048", [(n - 1, 1) for n in uniform_lengths(256, 100, 2048, seed=31)]),
        ("W1 mix 128 x 300..2048", [(n - 1, 1) for n in uniform_lengths(128, 300, 2048, seed=32)]),
        ("uniform 256 x 1024", [(1023, 1)] * 256),
    ]


@contextlib.contextmanager
def decode_tile(tile: tuple[int, int, int]) -> Iterator[None]:
    """Every decode launch inside uses ``tile`` (BLOCK_N, num_warps, num_stages)."""
    configured = triton_decode.decode_tile_config
    triton_decode.decode_tile_config = lambda *_, **__: tile
    try:
        yield
    finally:
        triton_decode.decode_tile_config = configured


def decode_order_rows(save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Decode on W1-like mixes: (tile, splits) x (launch order as given, longest first)."""
    rows: list[dict[str, Any]] = []
    tiles = [(64, 4, 2), (32, 2, 2), (32, 4, 2), (64, 8, 2), (64, 4, 3), (128, 4, 3)]
    for label, seqs in w1_decode_mixes():
        step = make_step(seqs, seed=30)
        order = triton_decode.longest_first(step.metadata.seq_lens)
        rows.append(dict(case=label, impl="argsort (longest_first)",
                         ms=bench_ms(lambda: triton_decode.longest_first(step.metadata.seq_lens))))
        for tile in tiles:
            with decode_tile(tile):
                for splits in (1, 2, 4):
                    for ordered in (False, True):
                        ms = bench_ms(decode_only(step, splits, order=order if ordered else None))
                        rows.append(dict(case=label, block_n=tile[0], num_warps=tile[1],
                                         num_stages=tile[2], num_splits=splits,
                                         longest_first=ordered, ms=ms,
                                         gb_s=kv_bytes(step) / ms / 1e6))
            save(rows)
        del step
        torch.cuda.empty_cache()
    return rows


DECODE_SPLIT_BATCHES = ((2, 1000, 2048), (4, 1000, 2048), (8, 900, 2048), (16, 900, 2048),
                        (32, 800, 2048), (48, 700, 2000), (64, 600, 1900), (96, 500, 1800),
                        (128, 400, 1700), (192, 300, 1500), (256, 200, 1200))
# Five stages: the tiles whose K and V Triton double-buffers (64 or 32 keys; docs/benchmarks.md,
# "Decode attention with double-buffered tiles").
DECODE_SPLIT_TILES = ((64, 4, 2), (128, 4, 2), (128, 4, 3), (64, 4, 3), (32, 4, 2), (128, 8, 3),
                      (64, 8, 3), (64, 2, 5), (64, 4, 5), (32, 4, 5))


def decode_split_rows(batches=DECODE_SPLIT_BATCHES, tiles=DECODE_SPLIT_TILES,
                      split_counts=(1, 2, 3, 4, 6, 8, 12, 16, 24)) -> list[dict[str, Any]]:
    """Decode attention by batch size (contexts like W1's at that batch: longer as it
    shrinks) over splits x tiles, timed inside CUDA graphs over six caches in turn (as a
    step's layers run), so the time is the device's alone: ``bench_ms`` times a launch from
    the host, and below ~100 us it measures the host's launch instead. Rows mark the
    engine's own plan (``engine``: ``plan_decode_splits`` under a graph's ``max_model_len``
    bound, and the tile ``decode_tile_config`` gives it).

    A tile that wins here may still lose inside a step, between the products: on an H200
    (64, 4, 3) beat the engine's one-pass tile by 6-7% here at 96-256 sequences and made
    W1 on llama-3.1-8b 1.9% slower. Confirm a choice on W1 itself, against the current one
    in the same run."""
    device = torch.device("cuda")
    bound = 131072  # llama-3.1-8b's max_model_len, what a captured decode graph plans with
    rows: list[dict[str, Any]] = []
    for batch, lo, hi in batches:
        seqs = [(n - 1, 1) for n in uniform_lengths(batch, lo, hi, seed=batch)]
        steps = [make_step(seqs, seed=10 * batch + i) for i in range(6)]
        order = (triton_decode.longest_first(steps[0].metadata.seq_lens)
                 if triton_decode.wants_longest_first(batch) else None)
        planned = triton_decode.plan_decode_splits(
            batch, NUM_KV_HEADS, bound, triton_decode._multiprocessor_count(device))
        planned_tile = triton_decode.decode_tile_config(HEAD_DIM, device, planned > 1)
        for tile in tiles:
            for splits in sorted({*split_counts, planned}):
                with decode_tile(tile):
                    launches = [decode_only(step, num_splits=splits, max_seq_len=bound, order=order)
                                for step in steps]
                    us = graph_us_per_launch(lambda launch: launch(), launches)
                rows.append(dict(batch=batch, contexts=f"{lo}..{hi}", block_n=tile[0],
                                 num_warps=tile[1], num_stages=tile[2], num_splits=splits,
                                 us=round(us, 2), gb_s=round(kv_bytes(steps[0]) / us / 1e3, 1),
                                 engine=(tile == planned_tile and splits == planned)))
        del steps
        torch.cuda.empty_cache()
        mine = [r for r in rows if r["batch"] == batch and r["contexts"] == f"{lo}..{hi}"]
        engine = next(r for r in mine if r["engine"])
        best = min(mine, key=lambda r: r["us"])
        print(f"{batch:5d} x {lo}..{hi:<5d} engine {engine['us']:7.1f} us {engine['gb_s']:6.0f} GB/s"
              f" ({engine['block_n']},{engine['num_warps']},{engine['num_stages']}; "
              f"{engine['num_splits']} splits)   fastest {best['us']:7.1f} us {best['gb_s']:6.0f} GB/s"
              f" ({best['block_n']},{best['num_warps']},{best['num_stages']}; {best['num_splits']} splits)",
              flush=True)
    return rows


LONG_DECODES = ((1, 32000, 32000), (2, 32000, 32000), (4, 32000, 32000), (1, 8000, 8000),
                (1, 120000, 120000))
LONG_DECODE_TILES = ((128, 4, 3), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 2, 3), (64, 2, 3),
                     (256, 8, 2), (32, 4, 4), (64, 2, 5), (64, 8, 5), (32, 4, 5))


def long_decode_rows() -> list[dict[str, Any]]:
    """Decode attention at long contexts (L2's 32k at batch 1, 2 and 4, 8k, 120k) by split
    count and tile, inside CUDA graphs (``decode_split_rows``)."""
    return decode_split_rows(LONG_DECODES, LONG_DECODE_TILES, (8, 16, 24, 32, 33, 40, 48, 64))


def decode_fixed_cost_rows() -> list[dict[str, Any]]:
    """What a batch-1 decode launch costs beside its reads, inside CUDA graphs: one
    sequence of 16 tokens (one pass: the launch alone), and 32,000 tokens in the engine's
    plan with the partials merged 4 to 64 at a time (``_merge_chunk``)."""
    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    merge_chunk = triton_decode._merge_chunk
    try:
        for context, chunks in ((16, (None,)), (32000, (None, 4, 8, 32, 64))):
            steps = [make_step([(context - 1, 1)], seed=70 + i) for i in range(6)]
            for chunk in chunks:
                if chunk is not None:
                    triton_decode._merge_chunk = lambda g, d, c=chunk: c
                launches = [decode_only(step, max_seq_len=131072) for step in steps]
                us = graph_us_per_launch(lambda launch: launch(), launches)
                triton_decode._merge_chunk = merge_chunk
                row = dict(context=context, merge_chunk=chunk or merge_chunk(NUM_HEADS // NUM_KV_HEADS, HEAD_DIM), us=round(us, 2),
                           gb_s=round(kv_bytes(steps[0]) / us / 1e3, 1))
                rows.append(row)
                print(f"decode 1 x {context:6d}, merged {row['merge_chunk']:2d} at a time: "
                      f"{row['us']:6.1f} us {row['gb_s']:6.0f} GB/s", flush=True)
            del steps
    finally:
        triton_decode._merge_chunk = merge_chunk
    return rows


LONG_PREFILL_CASES = (
    ("chunk 2048 on 29,952", [(29952, 2048)]),
    ("prefill 1 x 32000", [(0, 32000)]),
    ("chunk 8192 on 23,808", [(23808, 8192)]),
    ("prefill 4 x 2048", [(0, 2048)] * 4),
    ("chunk 2048 on 6,144", [(6144, 2048)]),
)
LONG_PREFILL_TILES = ((64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 2),
                      (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 2))


def long_prefill_rows(budget_s: float, save: Callable[[list[dict[str, Any]]], None]
                      ) -> list[dict[str, Any]]:
    """Prefill attention of long prompts (P2's chunks of 2,048 and 8,192 late in the
    prompt, its 32,000 tokens in one step, P1's 4 x 2,048, an early chunk) over tiles, in
    program order and longest first; matmul TFLOP/s over the causally visible keys. Stops
    starting new configurations after ``budget_s`` seconds."""
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget_s
    prefill_config, order = triton_prefill.prefill_tile_config, triton_prefill.PREFILL_LONGEST_FIRST
    try:
        for seed, (label, seqs) in enumerate(LONG_PREFILL_CASES, start=40):
            step = make_step(seqs, seed=seed)
            for knobs in LONG_PREFILL_TILES:
                for longest_first in (False, True):
                    if time.monotonic() > deadline:
                        return rows
                    triton_prefill.prefill_tile_config = lambda q, g, h, d, c=knobs: c
                    triton_prefill.PREFILL_LONGEST_FIRST = longest_first
                    row: dict[str, Any] = dict(case=label, tile=list(knobs), longest_first=longest_first)
                    try:
                        row["ms"] = bench_ms(forward(TritonAttentionBackend(), step))
                    except Exception as exc:  # e.g. more shared memory than there is
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    else:
                        row["tflop_s"] = round(causal_flops(step) / row["ms"] / 1e9, 1)
                    rows.append(row)
                    save(rows)
            del step
            torch.cuda.empty_cache()
    finally:
        triton_prefill.prefill_tile_config = prefill_config
        triton_prefill.PREFILL_LONGEST_FIRST = order
    return rows


DENSE_PREFILL_SETTINGS = ("off", "cudnn", "flash")


def dense_prefill_rows(caches: tuple[str, ...] = ("bf16", "fp8")) -> list[dict[str, Any]]:
    """Long prompts (P2's 32,000 tokens in one step and its chunks over cached context,
    P1's 4 x 2,048) through the whole backend with each ``PAGEDLLM_DENSE_PREFILL``
    setting, over a bf16 and an FP8 cache: off is the Triton prefill kernel, the others a
    library's fused attention by backend (its plans taken as paid: the path itself is
    timed). TFLOP/s over the causally visible keys; ``max_abs_diff`` against the Triton
    kernel's output."""
    rows: list[dict[str, Any]] = []
    setting, plan_cost = dense_prefill.DENSE_PREFILL, dense_prefill.PLAN_COST_S
    dense_prefill.PLAN_COST_S = 0.0
    try:
        for cache in caches:
            for seed, (label, seqs) in enumerate(LONG_PREFILL_CASES, start=40):
                step = make_step(seqs, seed=seed)
                if cache == "fp8":
                    step = fp8_kv_step(step)
                dense_prefill.DENSE_PREFILL = "off"
                kernel_out = forward(TritonAttentionBackend(), step, keep=True)()
                for name in DENSE_PREFILL_SETTINGS:
                    dense_prefill.DENSE_PREFILL = name
                    row: dict[str, Any] = dict(case=label, cache=cache, setting=name)
                    try:
                        out = forward(TritonAttentionBackend(), step, keep=True)()
                        row["max_abs_diff"] = float((out.float() - kernel_out.float()).abs().max())
                        row["ms"] = bench_ms(forward(TritonAttentionBackend(), step))
                    except Exception as exc:  # a backend that cannot take the shape
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    else:
                        row["tflop_s"] = round(causal_flops(step) / row["ms"] / 1e9, 1)
                        print(f"{label:24} {cache:4} {name:10} {row['ms']:8.3f} ms "
                              f"{row['tflop_s']:6.0f} TFLOP/s max |diff| {row['max_abs_diff']:.2e}")
                    rows.append(row)
                del step, kernel_out
                torch.cuda.empty_cache()
    finally:
        dense_prefill.DENSE_PREFILL, dense_prefill.PLAN_COST_S = setting, plan_cost
    return rows


def print_long_prefill(rows: list[dict[str, Any]]) -> None:
    """The engine's tile and the fastest three of each case."""
    engine = list(triton_prefill.prefill_tile_config(4096, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM,
                                                     torch.device("cuda")))
    for case in dict.fromkeys(r["case"] for r in rows):
        timed = sorted((r for r in rows if r["case"] == case and "ms" in r), key=lambda r: r["ms"])
        mine = [r for r in timed if r["tile"] == engine
                and r["longest_first"] == triton_prefill.PREFILL_LONGEST_FIRST]
        for r in timed[:3] + mine:
            tag = "  (engine)" if r in mine else ""
            print(f"{case:24} {r['ms']:8.3f} ms {r['tflop_s']:6.0f} TFLOP/s  tile {r['tile']} "
                  f"longest_first {r['longest_first']}{tag}")


def kv_layout_rows() -> list[dict[str, Any]]:
    """Decode attention over the cache as the engine lays it out, ``[blocks, block_size,
    heads, head_dim]`` (a block's page of one head is 16 rows 2 KB apart), against the same
    values laid out ``[blocks, heads, block_size, head_dim]`` (one contiguous 4 KB page per
    head), handed to the kernel as a view of the first's shape: only the strides differ.
    Outputs must be equal; times per tile, longest first as the engine launches them."""
    rows: list[dict[str, Any]] = []
    tiles = [(64, 4, 2), (32, 2, 2), (64, 4, 3), (128, 4, 3)]
    for label, seqs in w1_decode_mixes():
        step = make_step(seqs, seed=30)
        heads_major = step.kv_cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
        steps = {"block-major (engine)": step, "head-major pages": replace(step, kv_cache=heads_major)}
        order = triton_decode.longest_first(step.metadata.seq_lens)
        for tile in tiles:
            outputs = {}
            with decode_tile(tile):
                for layout, variant in steps.items():
                    launch = decode_only(variant, order=order)
                    outputs[layout] = launch().clone()
                    ms = bench_ms(launch)
                    rows.append(dict(case=label, layout=layout, block_n=tile[0], num_warps=tile[1],
                                     num_stages=tile[2], ms=ms, gb_s=kv_bytes(step) / ms / 1e6))
                    print(f"{label:24} {layout:22} tile {tile}: {ms * 1e3:7.1f} us "
                          f"{rows[-1]['gb_s'] / 1e3:5.2f} TB/s", flush=True)
            rows[-1]["equal_outputs"] = bool(torch.equal(*outputs.values()))
        del step, steps, heads_major
        torch.cuda.empty_cache()
    return rows


FP8_KV_SCALES = dict(k_scale=0.37, v_scale=0.61)
FP8_KV_TILES = ((64, 4, 2), (128, 4, 3), (128, 8, 3), (256, 4, 3), (256, 8, 2), (128, 4, 2))


def fp8_kv_step(step: Step) -> Step:
    """``step`` with its cache as an FP8 KV cache of ``FP8_KV_SCALES`` stores the context
    (448 where nothing was written: an FP8 cache holds finite values only)."""
    k, v = FP8_KV_SCALES["k_scale"], FP8_KV_SCALES["v_scale"]
    cache = torch.empty(step.kv_cache.shape, dtype=torch.float8_e4m3fn, device=step.kv_cache.device)
    for view, stored, scale in zip(paged_kv_views(cache), step.kv_cache, (k, v)):
        view.copy_((stored.float() / scale).nan_to_num(448.0).to(torch.float8_e4m3fn))
    return replace(step, kv_cache=cache)


def run_fp8_kv_check(name: str, seqs: list[tuple[int, int]], window: int | None,
                     seed: int) -> dict[str, Any]:
    """As ``run_check`` over an FP8 cache: the float32 reference attends over the same FP8
    cache (dequantized), and Triton must leave the reference's exact bytes behind."""
    step = fp8_kv_step(make_step(seqs, seed))
    md = step.metadata
    ref32 = TorchReferenceBackend().forward(
        step.query.float(), step.key.float(), step.value.float(), step.kv_cache.clone(), md,
        SCALE, window, **FP8_KV_SCALES)
    ref_cache = step.kv_cache.clone()
    ref = TorchReferenceBackend().forward(step.query, step.key, step.value, ref_cache, md, SCALE,
                                          window, **FP8_KV_SCALES)
    tri_cache = step.kv_cache.clone()
    out = TritonAttentionBackend().forward(step.query, step.key, step.value, tri_cache, md, SCALE,
                                           window, **FP8_KV_SCALES)
    torch.cuda.synchronize()
    triton_err = (out.float() - ref32).abs().max().item()
    ref_err = (ref.float() - ref32).abs().max().item()
    cache_exact = torch.equal(ref_cache.view(torch.uint8), tri_cache.view(torch.uint8))
    finite = bool(out.isfinite().all())
    ok = finite and cache_exact and triton_err <= max(2 * ref_err, 1e-2)
    return dict(case=f"fp8 KV: {name}", num_seqs=len(seqs), num_tokens=md.num_actual_tokens,
                max_seq_len=md.max_seq_len, sliding_window=window,
                triton_max_abs_err=triton_err, torch_bf16_max_abs_err=ref_err,
                cache_exact=cache_exact, finite=finite, ok=ok)


def fp8_kv_checks() -> list[dict[str, Any]]:
    """``run_fp8_kv_check`` on every case of ``check_cases``, printed as they finish."""
    rows = []
    for seed, (name, seqs, window) in enumerate(check_cases(), start=40):
        row = run_fp8_kv_check(name, seqs, window, seed)
        rows.append(row)
        print(f"{row['case']:60} {row['triton_max_abs_err']:11.2e} "
              f"{row['torch_bf16_max_abs_err']:12.2e} "
              f"{'exact' if row['cache_exact'] else 'DIFF':>6}  {'ok' if row['ok'] else 'FAIL'}",
              flush=True)
        torch.cuda.empty_cache()
    return rows


def fp8_kv_timing_rows() -> list[dict[str, Any]]:
    """Decode attention alone over a bf16 and an FP8 cache of the same contexts, per tile
    (the engine's split plan); GB/s counts the bytes each cache holds."""
    rows: list[dict[str, Any]] = []
    cases = [w1_decode_mixes()[0], ("decode 256 x 1024", [(1023, 1)] * 256),
             ("decode 1 x 8192", [(8191, 1)])]
    for label, seqs in cases:
        bf16 = make_step(seqs, seed=50)
        fp8 = fp8_kv_step(bf16)
        for cache, step, slot_rows in (("bfloat16", bf16, False), ("fp8, value rows", fp8, True),
                                       ("fp8", fp8, False)):
            for tile in FP8_KV_TILES:
                with decode_tile(tile):
                    ms = bench_ms(decode_only(step, slot_rows=slot_rows))
                rows.append(dict(case=label, cache=cache, block_n=tile[0],
                                 num_warps=tile[1], num_stages=tile[2], ms=ms,
                                 gb_s=kv_bytes(step) / ms / 1e6))
                print(f"{label:26} {cache:16} tile {tile}: {ms * 1e3:8.1f} us "
                      f"{rows[-1]['gb_s']:6.0f} GB/s", flush=True)
        del bf16, fp8, step
        torch.cuda.empty_cache()
    return rows


GEMV_SHAPES = [  # (projection, N, K) of Llama-3.1-8B
    ("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
    ("down", 4096, 14336), ("lm_head", 128256, 4096),
]
LAYER_PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


def gemv_configs() -> list[tuple[int, int, int, int, bool]]:
    dot = [(n, k, w, s, True) for n in (16, 32, 64) for k in (128, 256, 512)
           for w in (4, 8) for s in (3, 5)]
    # Lane-wise float32 accumulators: at most 64 per thread.
    fma = [(n, k, w, s, False) for n in (16, 32, 64) for k in (128, 256, 512)
           for w in (4, 8) for s in (1, 3) if n * k <= 2048 * w]
    return dot + fma


def gemv_rows(budget_s: float, save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """``small_batch_matmul`` against cuBLAS (``F.linear``): every tile at one row, the five
    fastest tensor-core tiles of each shape at 4 and 8 rows. L2 is flushed between runs, as a
    decode step reads each weight once."""
    from pagedllm.layers import triton_ops

    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget_s
    configured = triton_ops.small_batch_matmul_config
    gen = torch.Generator(device=DEVICE).manual_seed(40)
    try:
        for name, n, k in GEMV_SHAPES:
            weight = (torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(DTYPE)
            gb = n * k * weight.element_size() / 1e9
            for m in (1, 4, 8):
                x = torch.randn(m, k, generator=gen, device=DEVICE).to(DTYPE)
                want = F.linear(x, weight).float()
                ms = bench_ms(lambda: F.linear(x, weight))
                rows.append(dict(shape=name, rows=m, impl="cublas", ms=ms, tb_s=gb / ms))
                if m == 1:
                    candidates = gemv_configs()
                else:
                    timed = sorted((r for r in rows if r["shape"] == name and r["rows"] == 1
                                    and r.get("use_dot") and "ms" in r), key=lambda r: r["ms"])
                    candidates = [tuple(r["tile"]) for r in timed[:5]]
                for tile in candidates:
                    if time.monotonic() > deadline:
                        return rows
                    triton_ops.small_batch_matmul_config = lambda r, nn, kk, fp8=False, c=tile: c
                    row: dict[str, Any] = dict(shape=name, rows=m, impl="triton", tile=list(tile),
                                               use_dot=tile[4])
                    try:
                        err = (triton_ops.small_batch_matmul(x, weight).float() - want).abs().max().item()
                        row.update(max_abs_err=err, ms=bench_ms(lambda: triton_ops.small_batch_matmul(x, weight)))
                        row["tb_s"] = gb / row["ms"]
                    except Exception as exc:  # e.g. too much shared memory for the stages
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    rows.append(row)
                save(rows)
            del weight
            torch.cuda.empty_cache()
    finally:
        triton_ops.small_batch_matmul_config = configured
    return rows


GEMV_GRAPH_TILES = ((64, 512, 4, 3, True), (64, 256, 4, 5, True), (32, 512, 4, 3, True),
                    (32, 128, 4, 3, True), (64, 128, 4, 3, True), (64, 128, 8, 1, False))


def parse_gemv_tiles(text: str) -> tuple[tuple[int, int, int, int, bool], ...]:
    """``"32,1024,8,3,dot 16,512,4,3,dot"`` -> tiles (``BLOCK_N,BLOCK_K,warps,stages,dot|fma``)."""
    tiles = []
    for item in text.split():
        *ints, mode = item.split(",")
        tiles.append((*(int(v) for v in ints), mode == "dot"))
    return tuple(tiles)


def graph_us_per_launch(op: Callable[[torch.Tensor], Any], weights: list[torch.Tensor]) -> float:
    """Microseconds per ``op(w)`` when one CUDA graph runs it over every weight copy back to
    back (as a step runs its layers), the graph replayed 20 times."""
    for w in weights:
        op(w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            op(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (20 * len(weights))


GEMM_ROWS = (64, 96, 128, 136, 144, 160, 176, 192, 208, 224, 240, 256)


def gemm_rows(batch_rows=GEMM_ROWS) -> list[dict[str, Any]]:
    """cuBLAS on each layer projection at the decode batch sizes of a large batch (the
    CUDA graphs' padded sizes), inside graphs over weights that are not in L2: how the
    time grows with the rows (tile quantisation shows as steps)."""
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=DEVICE).manual_seed(43)
    for name, n, k in GEMV_SHAPES[:4]:
        copies = max(2, -(-400_000_000 // (n * k * 2)))
        weights = [(torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(DTYPE)
                   for _ in range(copies)]
        for m in batch_rows:
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(DTYPE)
            us = graph_us_per_launch(lambda w: F.linear(x, w), weights)
            rows.append(dict(shape=name, rows=m, us=us, tflop_s=2 * m * n * k / us / 1e6,
                             tb_s=n * k * 2 / us / 1e6))
            print(f"{name:8} rows {m:4} {us:8.1f} us {rows[-1]['tflop_s']:6.0f} TFLOP/s "
                  f"{rows[-1]['tb_s']:5.2f} TB/s")
        del weights
        torch.cuda.empty_cache()
    return rows


def gemv_graph_rows(fixed=GEMV_GRAPH_TILES) -> list[dict[str, Any]]:
    """Each projection as a decode step runs it: back to back inside a CUDA graph, cycling
    over enough weight copies that none is in L2 (as with 32 layers). Per launch, one row:
    cuBLAS, the configured tile, and the ``fixed`` tiles."""
    from pagedllm.layers import triton_ops

    rows: list[dict[str, Any]] = []
    configured = triton_ops.small_batch_matmul_config
    gen = torch.Generator(device=DEVICE).manual_seed(41)
    try:
        for name, n, k in GEMV_SHAPES[:4]:
            copies = max(2, -(-400_000_000 // (n * k * 2)))
            weights = [(torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(DTYPE)
                       for _ in range(copies)]
            x = torch.randn(1, k, generator=gen, device=DEVICE).to(DTYPE)
            variants: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
                ("cublas", lambda w: F.linear(x, w)),
                ("triton configured", lambda w: triton_ops.small_batch_matmul(x, w)),
            ]
            variants += [(f"triton {t}", lambda w: triton_ops.small_batch_matmul(x, w)) for t in fixed]
            for label, op in variants:
                tile = next((t for t in fixed if label == f"triton {t}"), None)
                triton_ops.small_batch_matmul_config = (
                    configured if tile is None else (lambda r, nn, kk, fp8=False, c=tile: c))
                try:
                    us = graph_us_per_launch(op, weights)
                    rows.append(dict(shape=name, impl=label, us=us, tb_s=n * k * 2 / us / 1e6))
                except Exception as exc:
                    rows.append(dict(shape=name, impl=label, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            del weights
            torch.cuda.empty_cache()
    finally:
        triton_ops.small_batch_matmul_config = configured
    for r in rows:
        print(f"{r['shape']:8} {r['impl']:42} " + (f"{r['us']:8.1f} us {r['tb_s']:5.2f} TB/s" if "us" in r else r["error"]))
    return rows


def gemv_fp8_configs() -> list[tuple[int, int, int, int, bool]]:
    dot = [(n, k, w, s, True) for n in (16, 32, 64, 128) for k in (256, 512, 1024)
           for w in (4, 8) for s in (2, 3, 4) if n * k <= 65536]
    fma = [(n, k, w, s, False) for n in (16, 32, 64) for k in (128, 256, 512)
           for w in (4, 8) for s in (1, 3) if n * k <= 2048 * w]
    return dot + fma


def gemv_fp8_rows(budget_s: float, save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """``small_batch_matmul`` with FP8 weights (W8A8, the input quantized in the kernel) on
    a layer's four projections as a decode step runs them (back to back in a CUDA graph,
    weights out of L2), over a grid of tiles at one row, the ten fastest at 4 rows;
    beside the bf16 kernel's configured tile and the FP8 configured tile."""
    from pagedllm.layers import triton_ops
    from pagedllm.quantization.fp8 import quantize_rows

    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget_s
    configured = triton_ops.small_batch_matmul_config
    gen = torch.Generator(device=DEVICE).manual_seed(44)
    try:
        for name, n, k in GEMV_SHAPES[:4]:
            copies = max(2, -(-400_000_000 // (n * k)))
            bf16 = [(torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(DTYPE)
                    for _ in range(max(2, copies // 2))]
            fp8 = [quantize_rows(w) for w in bf16]
            fp8 = (fp8 * (copies // len(fp8) + 1))[:copies]
            for m in (1, 4):
                x = torch.randn(m, k, generator=gen, device=DEVICE).to(DTYPE)
                triton_ops.small_batch_matmul_config = configured
                us = graph_us_per_launch(lambda w: triton_ops.small_batch_matmul(x, w), bf16)
                rows.append(dict(shape=name, rows=m, impl="bf16 configured", us=us,
                                 tb_s=n * k * 2 / us / 1e6))
                fp8_op = lambda w: triton_ops.small_batch_matmul(x, w[0], weight_scale=w[1])  # noqa: E731
                us = graph_us_per_launch(fp8_op, fp8)
                rows.append(dict(shape=name, rows=m, impl="fp8 configured", us=us,
                                 tb_s=n * k / us / 1e6))
                if m == 1:
                    candidates = gemv_fp8_configs()
                else:
                    timed = sorted((r for r in rows if r["shape"] == name and r["rows"] == 1
                                    and r["impl"] == "fp8 tile" and r["tile"][4] and "us" in r),
                                   key=lambda r: r["us"])
                    candidates = [tuple(r["tile"]) for r in timed[:10]]
                for tile in candidates:
                    if time.monotonic() > deadline:
                        return rows
                    triton_ops.small_batch_matmul_config = lambda r, nn, kk, fp8=False, c=tile: c
                    row: dict[str, Any] = dict(shape=name, rows=m, impl="fp8 tile", tile=list(tile))
                    try:
                        row["us"] = graph_us_per_launch(fp8_op, fp8)
                        row["tb_s"] = n * k / row["us"] / 1e6
                    except Exception as exc:  # e.g. too much shared memory for the stages
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    rows.append(row)
                save(rows)
            del bf16, fp8
            torch.cuda.empty_cache()
    finally:
        triton_ops.small_batch_matmul_config = configured
    return rows


def print_gemv_fp8(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'projection':10} {'rows':>4} {'bf16 us':>8} {'fp8 cfg us':>10} {'best fp8 us':>11} {'TB/s':>5}  tile")
    for name, _, _ in GEMV_SHAPES[:4]:
        for m in (1, 4):
            pick = {r["impl"]: r for r in rows if r["shape"] == name and r["rows"] == m
                    and r["impl"] != "fp8 tile"}
            timed = sorted((r for r in rows if r["shape"] == name and r["rows"] == m
                            and r["impl"] == "fp8 tile" and "us" in r), key=lambda r: r["us"])
            if len(pick) < 2 or not timed:
                continue
            print(f"{name:10} {m:4} {pick['bf16 configured']['us']:8.1f} "
                  f"{pick['fp8 configured']['us']:10.1f} {timed[0]['us']:11.1f} "
                  f"{timed[0]['tb_s']:5.2f}  {timed[0]['tile']}")


def fp8_gemm_rows() -> list[dict[str, Any]]:
    """Prompt and large-decode products of a layer's projections: bf16 cuBLAS against FP8
    W8A8 (``torch._scaled_mm`` with row-wise scales) and its input quantization (the Triton
    kernel and the torch ops), each timed alone (``bench_ms``), by rows."""
    from pagedllm.layers import triton_ops
    from pagedllm.quantization.fp8 import quantize_rows

    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=DEVICE).manual_seed(45)
    for name, n, k in GEMV_SHAPES[:4]:
        weight = (torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(DTYPE)
        wq, w_scale = quantize_rows(weight)
        for m in (256, 2048, 8192):
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(DTYPE)
            xq, x_scale = triton_ops.quantize_rows_fp8(x)
            row = dict(shape=name, rows=m)
            row["bf16_ms"] = bench_ms(lambda: F.linear(x, weight))
            row["scaled_mm_ms"] = bench_ms(lambda: torch._scaled_mm(
                xq, wq.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16))
            row["quant_triton_ms"] = bench_ms(lambda: triton_ops.quantize_rows_fp8(x))
            row["quant_torch_ms"] = bench_ms(lambda: quantize_rows(x))
            row["fp8_total_ms"] = row["scaled_mm_ms"] + row["quant_triton_ms"]
            rows.append(row)
            print(f"{name:8} rows {m:5}  bf16 {row['bf16_ms'] * 1e3:8.1f} us  scaled_mm "
                  f"{row['scaled_mm_ms'] * 1e3:8.1f} us  quant triton {row['quant_triton_ms'] * 1e3:7.1f}"
                  f" torch {row['quant_torch_ms'] * 1e3:7.1f} us  fp8/bf16 "
                  f"{row['fp8_total_ms'] / row['bf16_ms']:.2f}", flush=True)
        del weight, wq
        torch.cuda.empty_cache()
    return rows


def best_layer_tile(rows: list[dict[str, Any]]) -> tuple[list[int | bool], float] | None:
    """The one-row tile with the least total time over a layer's four projections."""
    totals: dict[tuple, list[float]] = {}
    for r in rows:
        if r["impl"] == "triton" and r["rows"] == 1 and r["shape"] in LAYER_PROJECTIONS and "ms" in r:
            totals.setdefault(tuple(r["tile"]), []).append(r["ms"])
    complete = {t: sum(v) for t, v in totals.items() if len(v) == len(LAYER_PROJECTIONS)}
    if not complete:
        return None
    tile = min(complete, key=complete.__getitem__)
    return list(tile), complete[tile]


def print_gemv(rows: list[dict[str, Any]], tile_out: Path | None) -> None:
    print(f"\n{'projection':10} {'rows':>4} {'cuBLAS ms':>10} {'TB/s':>6} {'best triton ms':>15} {'TB/s':>6}  tile")
    for name, _, _ in GEMV_SHAPES:
        for m in (1, 4, 8):
            cublas = [r for r in rows if r["shape"] == name and r["rows"] == m and r["impl"] == "cublas"]
            timed = sorted((r for r in rows if r["shape"] == name and r["rows"] == m
                            and r["impl"] == "triton" and "ms" in r), key=lambda r: r["ms"])
            if not cublas or not timed:
                continue
            c, t = cublas[0], timed[0]
            print(f"{name:10} {m:4} {c['ms']:10.4f} {c['tb_s']:6.2f} {t['ms']:15.4f} {t['tb_s']:6.2f}  "
                  f"{t['tile']} err {t['max_abs_err']:.2e}")
    best = best_layer_tile(rows)
    if best is not None:
        tile, total = best
        cublas = sum(r["ms"] for r in rows if r["impl"] == "cublas" and r["rows"] == 1
                     and r["shape"] in LAYER_PROJECTIONS)
        mode = "dot" if tile[4] else "fma"
        text = ",".join(str(v) for v in tile[:4]) + f",{mode}"
        print(f"one tile for a layer's four projections: {text}: {total * 1e3:.1f} us "
              f"(cuBLAS {cublas * 1e3:.1f} us)")
        if tile_out is not None:
            tile_out.write_text(text + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile configurations")
    parser.add_argument("--sweep-budget-s", type=float, default=150.0,
                        help="seconds after which the sweep starts no new configuration")
    parser.add_argument("--decode-order-sweep", action="store_true",
                        help="time decode on W1-like mixes, longest first or not, across splits and tiles")
    parser.add_argument("--gemv-sweep", action="store_true",
                        help="time small_batch_matmul's tiles against cuBLAS")
    parser.add_argument("--gemv-budget-s", type=float, default=200.0)
    parser.add_argument("--gemv-tile-out", type=Path, default=None,
                        help="write the best single tile here (PAGEDLLM_GEMV_TILE format)")
    parser.add_argument("--gemv-fp8-sweep", action="store_true",
                        help="time small_batch_matmul's tiles on FP8 weights in CUDA graphs")
    parser.add_argument("--fp8-gemm", action="store_true",
                        help="time bf16 cuBLAS against FP8 _scaled_mm and the input quantization by rows")
    parser.add_argument("--gemv-graph", action="store_true",
                        help="time the one-row projections back to back in CUDA graphs")
    parser.add_argument("--gemv-tiles", type=parse_gemv_tiles, default=GEMV_GRAPH_TILES,
                        help="--gemv-graph's tiles, e.g. '32,1024,8,3,dot 16,512,4,3,dot'")
    parser.add_argument("--gemm-rows", action="store_true",
                        help="time cuBLAS on the layer projections at decode batch sizes 64-256")
    parser.add_argument("--kv-layout", action="store_true",
                        help="time decode attention over the engine's cache layout and a head-major one")
    parser.add_argument("--decode-splits", action="store_true",
                        help="time decode attention by batch size over splits and tiles in CUDA graphs")
    parser.add_argument("--long-context", action="store_true",
                        help="prefill attention of long prompts over tiles and tile order, and "
                             "decode attention at long contexts over splits and tiles")
    parser.add_argument("--fp8-kv", action="store_true",
                        help="check the kernels over an FP8 KV cache and time decode over bf16 "
                             "and FP8 caches by tile")
    parser.add_argument("--skip-checks", action="store_true",
                        help="leave out the correctness checks and the standard timings")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_kernels_gpu.py needs a CUDA GPU; on the CPU run `pytest tests/kernels`.")
        return 2
    import triton

    results: dict[str, Any] = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        date=time.strftime("%Y-%m-%d"),
        config=dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                    block_size=BLOCK_SIZE, dtype=str(DTYPE).removeprefix("torch.")),
    )

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    print(f"{results['gpu']}  torch {results['torch']}  triton {results['triton']}")
    results["checks"] = []
    if not args.skip_checks:
        run_checks_and_timings(results, save)
    if args.fp8_kv:
        print(f"\n{'check':60} {'triton err':>11} {'bf16 ref err':>12} {'cache':>6}  result")
        results["checks"] += fp8_kv_checks()
        save()
        print("\ndecode attention over bf16 and FP8 KV caches, by tile")
        results["fp8_kv_timings"] = fp8_kv_timing_rows()
        save()

    if args.gemv_sweep:
        def save_gemv(rows: list[dict[str, Any]]) -> None:
            results["gemv"] = rows
            save()

        save_gemv(gemv_rows(args.gemv_budget_s, save_gemv))
        print_gemv(results["gemv"], args.gemv_tile_out)

    if args.gemv_fp8_sweep:
        def save_gemv_fp8(rows: list[dict[str, Any]]) -> None:
            results["gemv_fp8"] = rows
            save()

        save_gemv_fp8(gemv_fp8_rows(args.gemv_budget_s, save_gemv_fp8))
        print_gemv_fp8(results["gemv_fp8"])

    # (asked for, results key, title, rows): the timings that print as they go.
    timed_tables = (
        (args.gemv_graph, "gemv_graph", "one-row projections inside CUDA graphs, per launch",
         lambda: gemv_graph_rows(args.gemv_tiles)),
        (args.fp8_gemm, "fp8_gemm", "bf16 against FP8 W8A8 products by rows", fp8_gemm_rows),
        (args.gemm_rows, "gemm_rows",
         "layer projections (cuBLAS) by decode rows, inside CUDA graphs, per launch", gemm_rows),
        (args.kv_layout, "kv_layout", "decode attention by KV cache layout", kv_layout_rows),
        (args.decode_splits, "decode_splits",
         "decode attention by batch, inside CUDA graphs: the engine's plan and the fastest",
         decode_split_rows),
    )
    for wanted, key, title, rows in timed_tables:
        if wanted:
            print(f"\n{title}")
            results[key] = rows()
            save()

    if args.decode_order_sweep:
        def save_order(rows: list[dict[str, Any]]) -> None:
            results["decode_order"] = rows
            save()

        save_order(decode_order_rows(save_order))
        print("\ndecode order (fastest five of each case; then the defaults)")
        for case in dict.fromkeys(r["case"] for r in results["decode_order"]):
            timed = sorted((r for r in results["decode_order"] if r["case"] == case and "gb_s" in r),
                           key=lambda r: r["ms"])
            default = [r for r in timed if (r["block_n"], r["num_warps"], r["num_stages"]) == (64, 4, 2)
                       and r["num_splits"] == 1]
            for r in timed[:5] + default:
                print(f"{case:26} {r['ms']:8.3f} ms {r['gb_s']:6.0f} GB/s  tile {r['block_n']},"
                      f"{r['num_warps']},{r['num_stages']} splits {r['num_splits']} "
                      f"longest_first {r['longest_first']}")

    if args.long_context:
        def save_long(rows: list[dict[str, Any]]) -> None:
            results["long_prefill"] = rows
            save()

        print("\nfresh prompts: the Triton prefill kernel against torch's fused attention")
        results["dense_prefill"] = dense_prefill_rows()
        save()
        print("\nprefill attention of long prompts: the engine's tile and the fastest three")
        save_long(long_prefill_rows(args.sweep_budget_s, save_long))
        print_long_prefill(results["long_prefill"])
        print("\ndecode attention at long contexts, inside CUDA graphs: the engine's plan and the fastest")
        results["long_decode"] = long_decode_rows()
        save()
        print("\nbatch-1 decode beside its reads: the launch, the merge of the partials")
        results["decode_fixed_cost"] = decode_fixed_cost_rows()
        save()

    if args.sweep:
        sweep(results, args.sweep_budget_s, save)

    failed = [c["case"] for c in results["checks"] if not c["ok"]]
    print(f"\nwrote {args.out}; " + (f"FAILED: {', '.join(failed)}" if failed else "all checks passed"))
    return 1 if failed else 0


def run_checks_and_timings(results: dict[str, Any], save: Callable[[], None]) -> None:
    print(f"\n{'check':36} {'triton err':>11} {'bf16 ref err':>12} {'cache':>6}  result")
    for seed, (name, seqs, window) in enumerate(check_cases()):
        row = run_check(name, seqs, window, seed)
        results["checks"].append(row)
        save()
        print(f"{name:36} {row['triton_max_abs_err']:11.2e} {row['torch_bf16_max_abs_err']:12.2e} "
              f"{'exact' if row['cache_exact'] else 'DIFF':>6}  {'ok' if row['ok'] else 'FAIL'}")
        torch.cuda.empty_cache()

    print(f"\n{'timing':32} {'impl':34} {'ms':>8} {'rate':>14}")
    results["timings"] = timing_rows()
    save()
    for row in results["timings"]:
        rate = f"{row['gb_s']:.0f} GB/s" if "gb_s" in row else f"{row['tflop_s']:.0f} TFLOP/s"
        print(f"{row['case']:32} {row['impl']:34} {row['ms']:8.3f} {rate:>14}")


def sweep(results: dict[str, Any], budget_s: float, save: Callable[[], None]) -> None:
    """The tile sweep (``sweep_rows``), saved as it goes; prints the fastest of each case."""
    def save_sweep(rows: list[dict[str, Any]]) -> None:
        results["sweep"] = rows
        save()

    save_sweep(sweep_rows(budget_s, save_sweep))
    print("\nsweep (fastest three of each case)")
    for case in dict.fromkeys(r["case"] for r in results["sweep"]):
        timed = sorted((r for r in results["sweep"] if r["case"] == case and "ms" in r),
                       key=lambda r: r["ms"])
        device = torch.device("cuda")
        defaults = {triton_decode.decode_tile_config(HEAD_DIM, device, split)
                    for split in (False, True)}
        for r in timed:
            knobs = {k: v for k, v in r.items() if k not in ("case", "ms", "gb_s", "tflop_s")}
            is_default = tuple(knobs.values()) in defaults and case.startswith("decode")
            if r in timed[:3] or is_default:
                print(f"{case:34} {r['ms']:8.3f} ms  {knobs}" + ("  (a default)" if is_default else ""))


if __name__ == "__main__":
    sys.exit(main())
