#!/usr/bin/env python3
"""The helpers of ``scripts/gpu_bench_multi.sh``: greedy tokens of one parallel layout,
their comparison with one GPU's, and the run's report.

    gpu_bench_multi.py greedy  ENGINE FLAGS [--num-prompts --input-len --output-len]
                               --out FILE
        Greedy decoding (``ignore_eos``) of W1's requests (the prompts and output lengths
        ``bench throughput`` draws from ``--seed``), with the top ``--logprobs`` log
        probabilities of every generated position; one engine, so one layout per process.
    gpu_bench_multi.py compare --reference FILE --candidate FILE [--exact | --near-tie X]
                               --out FILE
        Sequence by sequence: equal, or diverged at a position where the two runs' best
        tokens are a near-tie: each run's log probability of its own token exceeds its
        log probability of the other run's token by at most ``--near-tie`` nats (a token
        outside a run's top ``--logprobs`` counts as infinitely far). With ``--exact``
        every sequence must be equal (float32); the divergences are reported either way.
        Exits 1 when the comparison fails.
    gpu_bench_multi.py report  --dir OUT --date DATE --gpus N [--dry 1] [--big MODEL]
        Collects the run's files into ``<date>-h200x<N>.json`` (``<date>-dry-x<N>.json``
        for a dry run) and prints the tables: correctness per layout, then W1/L1/P1 per
        model, weights and layout, each beside the same model's TP=1 figure, with the
        targets of llama-3.1-8b at TP=2 (W1 at least 1.7x, L1 at most 0.6x TP=1).

The run's files are named ``KIND-MODEL-VARIANT-tpT-ppP.json``: KIND ``greedy``,
``correct``, ``w1`` (``bench throughput``) or ``lat`` (``bench latency``), VARIANT the
dtype or weights (float32, bf16, fp8).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench_report import _gpu  # noqa: E402 - the report's helpers, one place

from pagedllm.benchmarks.common import git_commit  # noqa: E402

NAME = re.compile(r"^(?P<kind>greedy|correct|w1|lat)-(?P<model>.+)-(?P<variant>[a-z0-9]+)"
                  r"-tp(?P<tp>\d+)-pp(?P<pp>\d+)\.json$")
# Multi-GPU targets of the big model at TP=2 against TP=1 in the same run:
# workload -> (field, comparison, ratio).
SCALING_TARGETS = {"W1": ("output_tok_s", ">=", 1.7), "L1": ("ms_per_token", "<=", 0.6)}
FIELDS = {"W1": "output_tok_s", "L1": "ms_per_token", "P1": "prompt_tok_s"}
UNITS = {"output_tok_s": "output tok/s", "ms_per_token": "ms/token", "prompt_tok_s": "prompt tok/s"}


def greedy(argv: list[str]) -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.common import parallel_sizes, parse_range, synthetic_requests
    from pagedllm.benchmarks.throughput import fit_lengths
    from pagedllm.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser(prog="gpu_bench_multi.py greedy")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=parse_range, default=None)
    parser.add_argument("--output-len", type=parse_range, default=None)
    parser.add_argument("--logprobs", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()
    input_len, output_len, note = fit_lengths(args.input_len, args.output_len,
                                              config.model_config.max_model_len)
    if note:
        print(note, flush=True)
    requests = synthetic_requests(args.num_prompts, input_len, output_len,
                                  config.model_config.vocab_size, args.seed)
    llm = LLM(**vars(engine_args))
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": r.prompt_token_ids} for r in requests],
        [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True,
                        logprobs=args.logprobs) for r in requests], use_tqdm=False)
    elapsed = time.perf_counter() - start
    sequences = [{"prompt_len": len(r.prompt_token_ids),
                  "token_ids": list(o.outputs[0].token_ids),
                  "logprobs": [[[token, lp.logprob] for token, lp in position.items()]
                               for position in o.outputs[0].logprobs or []]}
                 for r, o in zip(requests, outputs)]
    record = {"model": config.model_config.path.name, "dtype": str(config.model_config.dtype),
              **parallel_sizes(config), "num_prompts": len(requests),
              "input_len": list(input_len), "output_len": list(output_len), "seed": args.seed,
              "elapsed_s": round(elapsed, 3), "command": " ".join(sys.argv),
              "sequences": sequences}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record))
    print(f"{len(requests)} sequences, {sum(len(s['token_ids']) for s in sequences)} tokens "
          f"in {elapsed:.1f} s; wrote {args.out}")
    llm.llm_engine.engine_core.shutdown()
    return 0


def compare_runs(reference: dict, candidate: dict, near_tie: float, exact: bool) -> dict:
    """The comparison record of two ``greedy`` runs on the same requests."""
    if [s["prompt_len"] for s in reference["sequences"]] != \
            [s["prompt_len"] for s in candidate["sequences"]]:
        raise ValueError("the two runs did not decode the same requests (prompt lengths "
                         "differ): give both the same --seed and workload flags.")
    equal = near_ties = mismatches = 0
    divergences = []
    for index, (ref, cand) in enumerate(zip(reference["sequences"], candidate["sequences"])):
        a, b = ref["token_ids"], cand["token_ids"]
        if a == b:
            equal += 1
            continue
        position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        gap = math.inf
        if position < min(len(a), len(b)):
            gap = max(_gap(ref["logprobs"], position, a[position], b[position]),
                      _gap(cand["logprobs"], position, b[position], a[position]))
        tie = gap <= near_tie
        near_ties += tie
        mismatches += not tie
        divergences.append({"sequence": index, "position": position,
                            "reference_token": a[position] if position < len(a) else None,
                            "candidate_token": b[position] if position < len(b) else None,
                            "gap": None if math.isinf(gap) else round(gap, 6)})
    gaps = [d["gap"] for d in divergences if d["gap"] is not None]
    return {
        "model": reference["model"], "dtype": reference["dtype"],
        "tensor_parallel_size": candidate["tensor_parallel_size"],
        "pipeline_parallel_size": candidate["pipeline_parallel_size"],
        "reference": {k: reference[k] for k in ("tensor_parallel_size", "pipeline_parallel_size")},
        "sequences": len(reference["sequences"]), "equal": equal, "near_ties": near_ties,
        "mismatches": mismatches, "rule": "exact" if exact else f"near-tie <= {near_tie} nats",
        "max_gap": max(gaps, default=None),
        "passed": equal == len(reference["sequences"]) if exact else mismatches == 0,
        "divergences": divergences[:50],
    }


def _gap(logprobs: list, position: int, own: int, other: int) -> float:
    """How far ``other`` trails ``own`` in one run's log probabilities at ``position``."""
    if position >= len(logprobs):
        return math.inf
    top = dict((int(token), lp) for token, lp in logprobs[position])
    if own not in top or other not in top:
        return math.inf
    return top[own] - top[other]


def compare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_bench_multi.py compare")
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--candidate", type=Path, required=True)
    parser.add_argument("--near-tie", type=float, default=0.0)
    parser.add_argument("--exact", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = compare_runs(json.loads(args.reference.read_text()),
                          json.loads(args.candidate.read_text()), args.near_tie, args.exact)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{_layout(result)} vs TP=1, {result['dtype']}: {result['equal']}/"
          f"{result['sequences']} equal, {result['near_ties']} near-ties, "
          f"{result['mismatches']} mismatches ({result['rule']}): "
          f"{'passed' if result['passed'] else 'FAILED'}")
    return 0 if result["passed"] else 1


def _layout(record: dict) -> str:
    tp, pp = record["tensor_parallel_size"], record["pipeline_parallel_size"]
    return f"TP={tp}" + (f" x PP={pp}" if pp > 1 else "")


def collect(directory: Path, big: str, dry: bool, meta: dict) -> list[dict]:
    """The run's records: correctness per layout, then one record per workload, model,
    variant and layout, with its ratio to the same model and variant at TP=1."""
    correct, perf = [], {}
    for path in sorted(directory.glob("*.json")):
        match = NAME.match(path.name)
        if not match or match["kind"] == "greedy":
            continue
        data = json.loads(path.read_text())
        layout = (int(match["tp"]), int(match["pp"]))
        if match["kind"] == "correct":
            correct.append({"workload": "greedy", **meta,
                            **{k: v for k, v in data.items() if k != "divergences"},
                            "first_divergences": data["divergences"][:5]})
            continue
        rows = data if isinstance(data, list) else [data]
        for row in rows:
            workload = row.get("workload")
            if workload == "throughput":
                if row.get("backend") != "pagedllm" or "output_tok_s" not in row:
                    continue
                workload = "W1"
            if workload not in FIELDS:
                continue
            key = (workload, match["model"], match["variant"], layout)
            if (row.get("tensor_parallel_size", 1), row.get("pipeline_parallel_size", 1)) \
                    != layout:
                raise ValueError(f"{path.name} holds a run of another layout: "
                                 f"{row.get('tensor_parallel_size')} x "
                                 f"{row.get('pipeline_parallel_size')}")
            perf[key] = {"workload": workload, "model": match["model"],
                         "variant": match["variant"], "tensor_parallel_size": layout[0],
                         "pipeline_parallel_size": layout[1], "gpus": layout[0] * layout[1],
                         **meta, "command": row.get("command"),
                         FIELDS[workload]: row[FIELDS[workload]]}
    for workload, model, variant, layout in perf:
        record = perf[workload, model, variant, layout]
        base = perf.get((workload, model, variant, (1, 1)))
        field = FIELDS[workload]
        if base is not None and layout != (1, 1) and base[field]:
            record["ratio_vs_tp1"] = round(record[field] / base[field], 3)
        if model == big and variant == "bf16" and layout == (2, 1) \
                and workload in SCALING_TARGETS and not dry:
            _, direction, target = SCALING_TARGETS[workload]
            record["target"] = f"{direction} {target}x TP=1"
            ratio = record.get("ratio_vs_tp1")
            if ratio is not None:
                record["target_met"] = ratio >= target if direction == ">=" else ratio <= target
    return correct + [perf[key] for key in sorted(perf, key=_order)]


def _order(key: tuple) -> tuple:
    """Model, variant, layout, then W1, L1, P1."""
    workload, model, variant, layout = key
    return (model, variant, layout, list(FIELDS).index(workload))


def report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_bench_multi.py report")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--date", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--dry", default="0")
    parser.add_argument("--big", default="llama-3.1-8b")
    args = parser.parse_args(argv)
    dry = args.dry == "1"
    meta = {"gpu": _gpu() + (" (dry run)" if dry else ""), "gpus_on_machine": args.gpus,
            "commit": git_commit(), "date": args.date}
    records = collect(args.dir, args.big, dry, meta)
    name = f"{args.date}-{'dry' if dry else 'h200'}x{args.gpus}.json"
    (args.dir / name).write_text(json.dumps(records, indent=2) + "\n")
    print(f"\nwrote {args.dir / name}  (gpu: {meta['gpu']} x {args.gpus}, "
          f"commit: {meta['commit']})")
    correct = [r for r in records if r["workload"] == "greedy"]
    if correct:
        print(f"{'correctness':>14} {'model':>20} {'dtype':>9} {'equal':>9} {'near-ties':>9} "
              f"{'mismatches':>10} {'max gap':>9}  verdict")
    for r in correct:
        print(f"{_layout(r):>14} {r['model']:>20} {r['dtype']:>9} "
              f"{r['equal']:>4}/{r['sequences']:<4} {r['near_ties']:>9} {r['mismatches']:>10} "
              f"{'-' if r['max_gap'] is None else r['max_gap']:>9}  "
              f"{'passed' if r['passed'] else 'FAILED'} ({r['rule']})")
    print(f"{'workload':>8} {'model':>20} {'weights':>7} {'layout':>12} {'figure':>22} "
          f"{'x TP=1':>7}  target")
    for r in (r for r in records if r["workload"] != "greedy"):
        field = FIELDS[r["workload"]]
        verdict = ""
        if "target" in r:
            verdict = f"{r['target']}: {'met' if r.get('target_met') else 'NOT met'}"
        print(f"{r['workload']:>8} {r['model']:>20} {r['variant']:>7} {_layout(r):>12} "
              f"{str(r[field]) + ' ' + UNITS[field]:>22} "
              f"{r.get('ratio_vs_tp1', '-'):>7}  {verdict}")
    steps = args.dir / "steps.txt"
    if steps.is_file():
        print("steps (name, exit code, seconds): "
              + "; ".join(steps.read_text().split("\n")).strip("; "))
    return 0


def main() -> int:
    commands = {"greedy": greedy, "compare": compare, "report": report}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(__doc__)
        return 2
    return commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    raise SystemExit(main())
