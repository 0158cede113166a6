#!/usr/bin/env python3
"""The helpers of ``scripts/gpu_bench_trtllm.sh``: TensorRT-LLM's published FP8 tables for
Llama-3.1-8B on one H200 and one H100, the shapes of a run, and its report.

    gpu_bench_trtllm.py plan --dtype fp8|bf16 [--scale S] [--shapes "128/128 2048/128"]
                             [--dry 1]
        Prints two words: the ``bench throughput --shapes`` argument of the shapes asked
        for (each shape's request count times ``--scale``, at least 1), and the run's time
        limit in seconds (start-up plus twice the time the H200 records predict). A dry
        run (the CPU, the demo model) divides the lengths by 32 and sends 2 requests.
    gpu_bench_trtllm.py report --dir OUT --date DATE [--scale S] [--dry 1]
                               [--dtypes "fp8 bf16"] [--engine-flags "..."]
                               [--reference auto|h200|h100]
        Reads ``trtllm-<dtype>.json`` (one record per shape), writes one record per shape
        to ``trtllm-<in>-<out>.json`` (ours per dtype, TRT-LLM's, the ratios) and all of
        them to ``<date>-<reference>-trtllm.json`` (``<date>-dry-trtllm.json`` for a dry
        run), and prints the table. The reference is TRT-LLM's table for the GPU the run
        measured (``auto``: an H100 by its device name, else the H200's, issue 26's target).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench_report import _gpu, dispatch, print_steps  # noqa: E402 - one place

from pagedllm.benchmarks.common import git_commit  # noqa: E402

# TensorRT-LLM's performance overview, PyTorch backend, Llama-3.1-8B FP8 at TP1, max
# throughput: shape (prompt/output tokens) -> (requests, output tokens per second) on one
# H200 SXM; the same shapes and request counts on one H100 SXM.
TRTLLM = {
    "128/128": (30_000, 27_911),
    "2048/128": (3_000, 3_538),
    "1000/1000": (3_000, 17_744),
    "500/2000": (3_000, 20_770),
    "2048/2048": (1_500, 12_194),
}
TRTLLM_H100 = {"128/128": 28_312, "2048/128": 3_450, "1000/1000": 15_220, "500/2000": 17_660,
               "2048/2048": 9_305}


def reference_table(reference: str, gpu: str) -> tuple[str, dict[str, int]]:
    """TRT-LLM's output tok/s per shape for ``reference`` ("h200", "h100", or "auto": the
    H100's table when ``gpu`` names an H100, else the H200's), and the table's name."""
    if reference == "auto":
        reference = "h100" if "H100" in gpu.upper() else "h200"
    if reference == "h100":
        return reference, TRTLLM_H100
    return reference, {shape: tok_s for shape, (_, tok_s) in TRTLLM.items()}
# Our H200 figures (docs/benchmarks.md, 2026-12-01) that predict a run's length: prompt
# tokens per second (P1) and output tokens per second at large batches (T1 for FP8 with
# the FP8 cache; bf16 scaled by W1's bf16/FP8 ratio, 10,427 / 11,782).
RATES = {"fp8": (62_562, 11_408), "bf16": (42_998, 10_096)}
FLAGS = {"fp8": "--quantization fp8 --kv-cache-dtype fp8", "bf16": ""}
START_S = 120  # one engine's start-up, warm-up and workload generation, with room
DRY_DIVISOR, DRY_REQUESTS, DRY_LIMIT_S = 32, 2, 300


def _selected(text: str | None) -> list[str]:
    names = text.split() if text else list(TRTLLM)
    unknown = [n for n in names if n not in TRTLLM]
    if unknown:
        raise SystemExit(f"TRTLLM_SHAPES: unknown shape(s) {' '.join(unknown)}; "
                         f"the shapes are {' '.join(TRTLLM)}.")
    return names


def num_requests(shape: str, scale: float) -> int:
    """The requests a run sends for ``shape``: TRT-LLM's count times ``scale``, at least 1."""
    return max(1, round(TRTLLM[shape][0] * scale))


def predicted_seconds(shape: str, dtype: str, scale: float) -> float:
    """The H200's time for the shape's requests at our recorded rates (prefill + decode)."""
    prompt_len, output_len = map(int, shape.split("/"))
    count = num_requests(shape, scale)
    prompt_rate, output_rate = RATES[dtype]
    return count * (prompt_len / prompt_rate + output_len / output_rate)


def plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_bench_trtllm.py plan")
    parser.add_argument("--dtype", choices=sorted(FLAGS), required=True)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--dry", default="0")
    args = parser.parse_args(argv)
    if args.scale <= 0:
        raise SystemExit(f"TRTLLM_SCALE must be > 0, got {args.scale}.")
    shapes = _selected(args.shapes)
    if args.dry == "1":
        items = []
        for shape in shapes:
            prompt_len, output_len = (max(1, int(n) // DRY_DIVISOR) for n in shape.split("/"))
            items.append(f"{prompt_len}/{output_len}x{DRY_REQUESTS}")
        print(",".join(items), DRY_LIMIT_S)
        return 0
    items = [f"{shape}x{num_requests(shape, args.scale)}" for shape in shapes]
    seconds = sum(predicted_seconds(shape, args.dtype, args.scale) for shape in shapes)
    print(",".join(items), round(START_S + 2 * seconds))
    return 0


def collect(directory: Path, dtypes: list[str], scale: float, dry: bool, meta: dict,
            reference: dict[str, int]) -> list[dict]:
    """One record per shape run: ours per dtype beside TRT-LLM's (``reference``: output
    tok/s per shape), and FP8 over bf16."""
    runs: dict[str, dict[str, dict]] = {}
    for dtype in dtypes:
        path = directory / f"trtllm-{dtype}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        for row in data if isinstance(data, list) else [data]:
            if "shape" in row and "output_tok_s" in row:
                runs.setdefault(row["shape"], {})[dtype] = row
    records = []
    for shape, (trt_requests, _) in TRTLLM.items():
        trt_tok_s = reference[shape]
        # A dry run's shapes are the table's, shortened.
        ours = runs.get(_dry_shape(shape) if dry else shape)
        if not ours:
            continue
        record = {"workload": "trtllm-shape", "shape": shape, **meta, "scale": scale,
                  "trtllm_num_prompts": trt_requests, "trtllm_output_tok_s": trt_tok_s}
        for dtype, row in ours.items():
            record[dtype] = {
                "num_prompts": row["num_prompts"], "output_tok_s": row["output_tok_s"],
                "ratio_vs_trtllm": round(row["output_tok_s"] / trt_tok_s, 3),
                "elapsed_s": row["elapsed_s"], "kv_cache_dtype": row.get("kv_cache_dtype"),
                "kv_cache_tokens": row.get("kv_cache_tokens"), "command": row.get("command"),
                "step_timing": row.get("step_timing"), "preemptions": row.get("preemptions"),
                "preempted_tokens": row.get("preempted_tokens"),
            }
            if dry:
                record[dtype]["shape_run"] = row["shape"]
        if "fp8" in ours and "bf16" in ours:
            fp8, bf16 = ours["fp8"]["output_tok_s"], ours["bf16"]["output_tok_s"]
            record["fp8_vs_bf16"] = round(fp8 / bf16, 3)
        records.append(record)
    return records


def _dry_shape(shape: str) -> str:
    return "/".join(str(max(1, int(n) // DRY_DIVISOR)) for n in shape.split("/"))


def report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_bench_trtllm.py report")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--date", required=True)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--dry", default="0")
    parser.add_argument("--dtypes", default="fp8 bf16")
    parser.add_argument("--engine-flags", default="")
    parser.add_argument("--reference", choices=("auto", "h200", "h100"), default="auto")
    args = parser.parse_args(argv)
    dry = args.dry == "1"
    dtypes = args.dtypes.split()
    gpu = "cpu (dry run)" if dry else _gpu()
    reference, trt_tok_s = reference_table(args.reference, gpu)
    meta = {"model": "pagedllm-demo" if dry else "llama-3.1-8b", "gpu": gpu,
            "commit": git_commit(), "date": args.date, "engine_flags": args.engine_flags,
            "trtllm_gpu": reference.upper()}
    records = collect(args.dir, dtypes, args.scale, dry, meta, trt_tok_s)
    for record in records:
        name = "trtllm-" + record["shape"].replace("/", "-") + ".json"
        (args.dir / name).write_text(json.dumps(record, indent=2) + "\n")
    summary = args.dir / f"{args.date}-{'dry' if dry else reference}-trtllm.json"
    summary.write_text(json.dumps(records, indent=2) + "\n")
    print(f"\nwrote {summary}  (gpu: {meta['gpu']}, commit: {meta['commit']}, scale "
          f"{args.scale}: each shape's requests x {args.scale}; engine flags: "
          f"{args.engine_flags or 'none (the defaults)'})")
    print(f"TRT-LLM's figures: its {reference.upper()} table")
    header = f"{'shape':>10} {'requests':>9} {'scale':>6} {'TRT-LLM':>8}"
    for dtype in dtypes:
        header += f" {dtype + ' tok/s':>11} {dtype + '/TRT':>9}"
    print(header + (f" {'fp8/bf16':>8}" if {"fp8", "bf16"} <= set(dtypes) else ""))
    for record in records:
        counts = {record[d]["num_prompts"] for d in dtypes if d in record}
        line = (f"{record['shape']:>10} {'/'.join(map(str, sorted(counts))):>9} "
                f"{record['scale']:>6} {record['trtllm_output_tok_s']:>8}")
        for dtype in dtypes:
            run = record.get(dtype)
            line += (f" {run['output_tok_s']:>11} {str(run['ratio_vs_trtllm']) + 'x':>9}" if run
                     else f" {'-':>11} {'-':>9}")
        if {"fp8", "bf16"} <= set(dtypes):
            line += f" {str(record.get('fp8_vs_bf16', '-')) + 'x':>8}"
        print(line)
    dropped = [f"{r['shape']} {d} {r[d]['preempted_tokens']:,}" for r in records for d in dtypes
               if r.get(d, {}).get("preempted_tokens")]
    if dropped:
        print("computed tokens that preemptions dropped (computed again): " + "; ".join(dropped))
    missing = [s for s in TRTLLM if s not in {r["shape"] for r in records}]
    if missing:
        print(f"not run or not finished: {' '.join(missing)}")
    print(f"TRT-LLM ran {', '.join(f'{s} x {TRTLLM[s][0]:,}' for s in TRTLLM)} requests "
          "(FP8 weights and cache, its PyTorch backend); target: at least 1.0x on every shape"
          + (" (a dry run judges nothing)" if dry else ""))
    print_steps(args.dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(dispatch({"plan": plan, "report": report}, __doc__))
