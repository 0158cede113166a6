#!/usr/bin/env python3
"""Collect the JSON files of one ``scripts/gpu_bench.sh`` run into the results file.

Writes ``<dir>/<date>-h200.json`` (``<date>-dry.json`` for a dry run): a list of records
``{"workload", "model", "gpu", "commit", "date", "command", "output_tok_s",
"ratio_vs_hf_static", "ratio_vs_hf_cb", "ms_per_token", "prompt_tok_s"}`` plus the
details each workload has (peers measured side by side, step timing, W1 with synchronous
scheduling for comparison, target met or not, the KV cache's dtype and capacity in tokens),
and prints a table. The fp8 step's W1 runs (``--quantization fp8``, with and without
``--kv-cache-dtype fp8``) follow the others, the FP8 cache's with its capacity against the
bf16 cache's (``kv_capacity_vs_auto``). A step that failed or produced nothing gives a
record with ``error``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.benchmarks.common import git_commit  # noqa: E402

# Targets on the H200 (BENCHMARKS.md): (field, direction, value).
TARGETS = {
    ("W1", "big"): ("output_tok_s", ">=", 10_700),
    ("L1", "big"): ("ms_per_token", "<=", 4.4),
    ("P1", "big"): ("prompt_tok_s", ">=", 40_000),
    ("W1", "small"): ("output_tok_s", ">=", 20_000),
    ("P2", "big"): ("prompt_tok_s", ">=", 28_000),
    ("L2", "big"): ("tpot_ms", "<=", 5.2),
}
RATIO_TARGET = 25.0


def _load(path: Path) -> list[dict] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, list) else [data]




def _gpu() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - the report must not fail on a broken torch
        return "unknown"


def _command(record: dict, subcommand: str) -> str:
    """The benchmark's own command line (the module was run as ``python -m``)."""
    args = record.get("command", "pagedllm").split(" ", 1)
    return f"pagedllm bench {subcommand} " + (args[1] if len(args) > 1 else "")


def _base(workload: str, model: str, meta: dict) -> dict:
    return {"workload": workload, "model": model, **meta, "command": None,
            "output_tok_s": None, "ratio_vs_hf_static": None, "ratio_vs_hf_cb": None,
            "ms_per_token": None, "prompt_tok_s": None}


def _judge(record: dict, key: tuple[str, str]) -> None:
    field, direction, value = TARGETS[key]
    got = record.get(field)
    record["target"] = f"{field} {direction} {value}"
    if got is not None:
        record["target_met"] = got >= value if direction == ">=" else got <= value


def _throughput(rows: list[dict] | None, workload: str, model: str, meta: dict,
                hf_prompts: int | None) -> dict:
    record = _base(workload, model, meta)
    if not rows:
        record["error"] = "the step produced no result (see log.txt)"
        return record
    mine = [r for r in rows if r.get("backend") == "pagedllm" and "output_tok_s" in r]
    if not mine:
        record["error"] = "no pagedllm run finished (see log.txt)"
        return record
    full = max(mine, key=lambda r: r["num_prompts"])
    record.update(command=_command(full, "throughput"), output_tok_s=full["output_tok_s"],
                  num_prompts=full["num_prompts"], output_tokens=full["output_tokens"],
                  elapsed_s=full["elapsed_s"])
    for key in ("kv_cache_dtype", "kv_cache_tokens"):
        if key in full:
            record[key] = full[key]
    if "step_timing" in full:
        record["step_timing"] = full["step_timing"]
    peers = {r["backend"]: r for r in rows if r.get("backend") in ("hf", "hf-cb")}
    if peers:
        side = [r for r in mine if r["num_prompts"] == hf_prompts] or [full]
        subset = side[0]
        record["ratio_vs_hf_static"] = subset.get("ratio_vs_hf_static")
        record["ratio_vs_hf_cb"] = subset.get("ratio_vs_hf_cb")
        names = {"hf": "HF generate (static batches of 128)", "hf-cb": "HF continuous batching"}
        record["ratio_basis"] = (
            f"pagedllm and {' and '.join(names[p] for p in sorted(peers))} run side by side in "
            f"one process on the first {subset['num_prompts']} requests of the same list; a "
            f"peer stopped at its time limit is credited with the tokens it produced"
        )
        record["side_by_side"] = {
            "pagedllm": {"output_tok_s": subset["output_tok_s"], "num_prompts": subset["num_prompts"]},
            **{name: {k: p.get(k) for k in ("output_tok_s", "output_tokens", "elapsed_s",
                                            "truncated", "attn_implementation", "count", "error")
                      if p.get(k) is not None}
               for name, p in peers.items()},
        }
    return record


def _latency(rows: list[dict] | None, model: str, meta: dict,
             names: tuple[str, str] = ("L1", "P1")) -> list[dict]:
    """The L1 and P1 records of a ``bench latency`` run, named ``names``."""
    out = []
    for (workload, field), name in zip((("L1", "ms_per_token"), ("P1", "prompt_tok_s")), names):
        record = _base(name, model, meta)
        row = next((r for r in rows or [] if r.get("workload") == workload), None)
        if row is None:
            record["error"] = "the step produced no result (see log.txt)"
        else:
            record.update(command=_command(row, "latency"), **{field: row[field]})
            for key in ("tpot_ms", "batch_size", "input_len", "output_len", "prompt_len",
                        "latencies_s", "step_timing", "profile"):
                if key in row:
                    record[key] = row[key]
        out.append(record)
    return out


def _long(directory: Path, model: str, meta: dict, dry: bool) -> list[dict]:
    """The long step's L2 and P2 (``long-<model>.json``), judged against their targets,
    then P2 in each chunk size (``long-chunk<N>-<model>.json``, variant ``chunk N``), then
    P2 and P1 with each A/B setting (``long-ab<i>-<P2|P1>-<model>.json``, variant the
    setting of ``long-ab<i>.setting``); none when the step did not run."""
    if not (directory / f"long-{model}.json").is_file():
        return []
    records = _latency(_load(directory / f"long-{model}.json"), model, meta, ("L2", "P2"))
    if not dry:
        for record in records:
            _judge(record, (record["workload"], "big"))
    chunked = sorted(directory.glob(f"long-chunk*-{model}.json"),
                     key=lambda p: int(p.name.removeprefix("long-chunk").split("-")[0]))
    for path in chunked:
        record = _latency(_load(path), model, meta, ("L2", "P2"))[1]
        record["variant"] = "chunk " + path.name.removeprefix("long-chunk").split("-")[0]
        records.append(record)
    for setting_path in sorted(directory.glob("long-ab*.setting")):
        tag = setting_path.name.removesuffix(".setting")
        for workload, names in (("P2", ("L2", "P2")), ("P1", ("L1", "P1"))):
            path = directory / f"{tag}-{workload}-{model}.json"
            record = _latency(_load(path), model, meta, names)[1]
            record["variant"] = setting_path.read_text().strip()
            records.append(record)
    return records


# Targets of 4-bit weights against bf16 in the same run: L1 time per token at most, W1
# and P1 throughput at least this share.
W4A16_TARGETS = {"L1": ("ms_per_token", 0.40, "at most"), "P1": ("prompt_tok_s", 0.9, "at least"),
                 "W1": ("output_tok_s", 1.0, "at least")}


def _w4a16(directory: Path, model: str, meta: dict, bf16: dict[str, dict]) -> list[dict]:
    """The w4a16 step's L1, P1 and W1 (dummy 4-bit weights, ``--quantization gptq``), each
    with its ratio to the bf16 record of the same workload in the same run and whether
    ``W4A16_TARGETS`` holds; none when the step did not run."""
    if not any(directory.glob(f"w4a16-*-{model}.json")):
        return []
    records = _latency(_load(directory / f"w4a16-latency-{model}.json"), model, meta)
    records.append(_throughput(_load(directory / f"w4a16-w1-{model}.json"), "W1", model, meta,
                               None))
    for record in records:
        field, target, sense = W4A16_TARGETS[record["workload"]]
        record.update(quantization="gptq 4-bit, groups of 128 (dummy weights)", variant="w4a16")
        base = bf16[record["workload"]].get(field)
        if record.get(field) and base:
            ratio = record[field] / base
            record["ratio_vs_bf16"] = round(ratio, 3)
            record["target"] = f"{sense} {target}x bf16"
            record["target_met"] = ratio <= target if sense == "at most" else ratio >= target
    return records


# Mixtral-8x7B (about 13B active parameters) against llama-3.1-8b's W1 in the same run.
MOE_W1_TARGET = 0.6


def _moe(directory: Path, model: str, small: str, meta: dict, dense_w1: dict) -> list[dict]:
    """The moe step's L1, P1 and W1 on ``model`` and W1 on ``small``; ``model``'s W1 carries
    its ratio to ``dense_w1`` and whether ``MOE_W1_TARGET`` holds. None when the step did
    not run."""
    if not any(directory.glob("moe-*.json")):
        return []
    records = _latency(_load(directory / f"moe-latency-{model}.json"), model, meta)
    w1 = _throughput(_load(directory / f"moe-w1-{model}.json"), "W1", model, meta, None)
    base = dense_w1.get("output_tok_s")
    if w1.get("output_tok_s") and base:
        ratio = w1["output_tok_s"] / base
        w1.update(ratio_vs_dense=round(ratio, 3), target=f"at least {MOE_W1_TARGET}x "
                  f"{dense_w1['model']}", target_met=ratio >= MOE_W1_TARGET)
    records += [w1, _throughput(_load(directory / f"moe-w1-{small}.json"), "W1", small, meta,
                                None)]
    for record in records:
        record["variant"] = "moe"
    return records


def _serve(directory: Path, models: tuple[str, ...], meta: dict) -> list[dict]:
    """The serve step's records (scripts/gpu_bench_serve.py), without the nested bench
    records and profile (they stay in serve-<model>.json)."""
    records = []
    for model in models:
        for row in _load(directory / f"serve-{model}.json") or []:
            summary = {k: v for k, v in row.items() if k not in ("offline", "http", "profiles")}
            records.append({**_base("serve", model, meta), **summary,
                            "output_tok_s": row["http_output_tok_s"],
                            "target": f"http_vs_offline >= {row['target']}",
                            "target_met": row["met"]})
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--date", required=True)
    parser.add_argument("--dry", default="0")
    parser.add_argument("--big", default="llama-3.1-8b")
    parser.add_argument("--small", default="qwen3-0.6b")
    parser.add_argument("--moe", default="mixtral-8x7b")
    parser.add_argument("--moe-small", default="qwen3-30b-a3b")
    parser.add_argument("--hf-prompts", type=int, default=None)
    args = parser.parse_args()
    dry = args.dry == "1"
    meta = {"gpu": _gpu() + (" (dry run)" if dry else ""), "commit": git_commit(), "date": args.date}

    records = [_throughput(_load(args.dir / f"w1-{args.big}.json"), "W1", args.big, meta,
                           args.hf_prompts)]
    records += _latency(_load(args.dir / f"latency-{args.big}.json"), args.big, meta)
    records.append(_throughput(_load(args.dir / f"w1-small-{args.small}.json"), "W1", args.small,
                               meta, None))
    for record, model in ((records[0], args.big), (records[3], args.small)):
        sync = _load(args.dir / f"sync-w1-{model}.json")
        sync = [r for r in sync or [] if r.get("backend") == "pagedllm" and "output_tok_s" in r]
        if sync and record.get("output_tok_s"):
            # The same workload with the step loop synchronous, in the same run.
            record["output_tok_s_sync_scheduling"] = sync[0]["output_tok_s"]
            record["async_scheduling_speedup"] = round(
                record["output_tok_s"] / sync[0]["output_tok_s"], 3)
    if not dry:
        for record, key in zip(records, (("W1", "big"), ("L1", "big"), ("P1", "big"), ("W1", "small"))):
            _judge(record, key)
        w1 = records[0]
        if w1.get("ratio_vs_hf_static") is not None:
            w1["ratio_target_met"] = w1["ratio_vs_hf_static"] >= RATIO_TARGET
    records += _long(args.dir, args.big, meta, dry)
    fp8 = {}
    for cache, variant, stem in (("auto", "fp8", "fp8"), ("fp8", "fp8+kv", "fp8-kv")):
        path = args.dir / f"{stem}-w1-{args.big}.json"
        fp8[cache] = _throughput(_load(path), "W1", args.big, meta, None)
        fp8[cache].update(quantization="fp8", variant=variant)
        records.append(fp8[cache])
    block_w1 = args.dir / f"fp8-block-w1-{args.big}.json"
    if block_w1.is_file():  # block-wise FP8 weights (hf-overrides), beside per-channel
        block = _throughput(_load(block_w1), "W1", args.big, meta, None)
        block.update(quantization="fp8", variant="fp8-block")
        records.append(block)
    if fp8["auto"].get("kv_cache_tokens") and fp8["fp8"].get("kv_cache_tokens"):
        fp8["fp8"]["kv_capacity_vs_auto"] = round(
            fp8["fp8"]["kv_cache_tokens"] / fp8["auto"]["kv_cache_tokens"], 3)
    records += _w4a16(args.dir, args.big, meta,
                      {"W1": records[0], "L1": records[1], "P1": records[2]})
    records += _moe(args.dir, args.moe, args.moe_small, meta, records[0])
    served = _serve(args.dir, (args.big, args.small), meta)
    records += served
    name = f"{args.date}-{'dry' if dry else 'h200'}.json"
    (args.dir / name).write_text(json.dumps(records, indent=2) + "\n")

    print(f"\nwrote {args.dir / name}  (gpu: {meta['gpu']}, commit: {meta['commit']})")
    print(f"{'workload':>8} {'model':>14} {'output tok/s':>13} {'x HF static':>12} "
          f"{'x HF cb':>8} {'ms/token':>9} {'TPOT ms':>8} {'prompt tok/s':>13}  target")
    for r in records:
        if "kv_capacity_vs_auto" in r:
            print(f"  W1 {r['model']} --quantization fp8: KV cache {fp8['auto']['kv_cache_tokens']} "
                  f"tokens ({fp8['auto'].get('kv_cache_dtype')}), {r['kv_cache_tokens']} with "
                  f"--kv-cache-dtype fp8 ({r.get('kv_cache_dtype')}): x{r['kv_capacity_vs_auto']}")
        if "async_scheduling_speedup" in r:
            print(f"  W1 {r['model']}: asynchronous scheduling {r['output_tok_s']} vs synchronous "
                  f"{r['output_tok_s_sync_scheduling']} output tok/s: x{r['async_scheduling_speedup']}")
    for r in records:
        def cell(key: str) -> str:
            return "-" if r.get(key) is None else str(r[key])
        verdict = r.get("error") or (
            f"{r['target']}: {'met' if r.get('target_met') else 'NOT met'}" if "target" in r else "")
        workload = r["workload"] + (f" {r['variant']}" if "variant" in r else "")
        print(f"{workload:>8} {r['model']:>14} {cell('output_tok_s'):>13} "
              f"{cell('ratio_vs_hf_static'):>12} {cell('ratio_vs_hf_cb'):>8} "
              f"{cell('ms_per_token'):>9} {cell('tpot_ms'):>8} {cell('prompt_tok_s'):>13}  {verdict}")
    if served:
        from gpu_bench_serve import table

        print("\nHTTP (bench serve) beside offline (bench throughput), same workload:")
        print(table(served))
    print_steps(args.dir)
    return 0


def dispatch(commands: dict, usage: str) -> int:
    """``script.py COMMAND ARGS...``: run ``commands[COMMAND](ARGS)``, or print ``usage``."""
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(usage)
        return 2
    return commands[sys.argv[1]](sys.argv[2:])


def print_steps(directory: Path) -> None:
    """The run's ``steps.txt`` on one line: each step's name, exit code and seconds."""
    steps = directory / "steps.txt"
    if steps.is_file():
        print("steps (name, exit code, seconds): " + "; ".join(steps.read_text().split("\n")).strip("; "))


if __name__ == "__main__":
    raise SystemExit(main())
