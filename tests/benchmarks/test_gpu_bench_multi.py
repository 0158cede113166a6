"""The multi-GPU run (scripts/gpu_bench_multi.sh): greedy runs compared exactly or up to
near-ties, the report's ratios to TP=1 and the TP=2 targets, and bench records naming
their parallel layout."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.benchmarks import throughput
from tests.benchmarks.gpu_report import load_script

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "scripts" / "gpu_bench_multi.py"



def _run(tp: int, sequences: list[tuple[list[int], list[dict[int, float]]]]) -> dict:
    """A greedy run's record: per sequence its tokens and top log probabilities."""
    return {"model": "m", "dtype": "bfloat16", "tensor_parallel_size": tp,
            "pipeline_parallel_size": 1,
            "sequences": [{"prompt_len": 5, "token_ids": tokens,
                           "logprobs": [[[t, lp] for t, lp in top.items()] for top in tops]}
                          for tokens, tops in sequences]}


def test_divergences_pass_only_as_near_ties_and_never_when_exact() -> None:
    compare_runs = load_script("gpu_bench_multi").compare_runs
    same = ([3, 4], [{3: -1.0, 9: -2.0}, {4: -1.0, 8: -3.0}])
    reference = _run(1, [same, ([5, 6], [{5: -1.000, 7: -1.005}, {6: -1.0}]),
                         ([5, 6], [{5: -1.0, 7: -1.5}, {6: -1.0}])])
    candidate = _run(2, [same, ([7, 7], [{7: -1.000, 5: -1.004}, {7: -1.0}]),
                         ([7, 6], [{7: -1.0, 5: -1.001}, {6: -1.0}])])
    result = compare_runs(reference, candidate, near_tie=0.01, exact=False)
    assert (result["equal"], result["near_ties"], result["mismatches"]) == (1, 1, 1)
    assert not result["passed"] and result["max_gap"] == pytest.approx(0.5)
    assert [(d["sequence"], d["position"]) for d in result["divergences"]] == [(1, 0), (2, 0)]
    ties_only = _run(2, [same, ([7, 7], [{7: -1.000, 5: -1.004}, {7: -1.0}]),
                         ([5, 6], [{5: -1.0}, {6: -1.0}])])
    assert compare_runs(reference, ties_only, near_tie=0.01, exact=False)["passed"]
    assert not compare_runs(reference, ties_only, near_tie=0.01, exact=True)["passed"]
    assert compare_runs(reference, reference, near_tie=0.0, exact=True)["passed"]
    with pytest.raises(ValueError, match="same requests"):
        compare_runs(reference, _run(2, [same]), near_tie=0.01, exact=False)


def _write(directory: Path, name: str, rows: list[dict]) -> None:
    (directory / name).write_text(json.dumps([{"command": "pagedllm --model m", **r}
                                              for r in rows]))


def _report(directory: Path, dry: str = "0") -> tuple[list[dict], str]:
    result = subprocess.run(
        [sys.executable, str(HELPER), "report", "--dir", str(directory), "--date", "2026-01-02",
         "--gpus", "2", "--dry", dry, "--big", "big"],
        check=True, capture_output=True, text=True, env={"PAGEDLLM_COMMIT": "abc"})
    name = "2026-01-02-" + ("dryx2.json" if dry == "1" else "h200x2.json")
    return json.loads((directory / name).read_text()), result.stdout


def test_report_sets_each_layout_beside_tp1_with_the_tp2_targets(tmp_path) -> None:
    def w1(tp: int, pp: int, tok_s: float) -> dict:
        return dict(workload="throughput", backend="pagedllm", tensor_parallel_size=tp,
                    pipeline_parallel_size=pp, num_prompts=4, output_tok_s=tok_s)

    def lat(tp: int, ms: float, tok_s: float) -> list[dict]:
        return [dict(workload="L1", tensor_parallel_size=tp, ms_per_token=ms),
                dict(workload="P1", tensor_parallel_size=tp, prompt_tok_s=tok_s)]

    _write(tmp_path, "w1-big-bf16-tp1-pp1.json", [w1(1, 1, 1000.0)])
    _write(tmp_path, "w1-big-bf16-tp2-pp1.json", [w1(2, 1, 1800.0)])
    _write(tmp_path, "w1-big-bf16-tp1-pp2.json", [w1(1, 2, 1500.0)])
    _write(tmp_path, "lat-big-bf16-tp1-pp1.json", lat(1, 10.0, 40000.0))
    _write(tmp_path, "lat-big-bf16-tp2-pp1.json", lat(2, 7.0, 60000.0))
    _write(tmp_path, "w1-llama-3.1-70b-fp8-tp2-pp1.json", [w1(2, 1, 900.0)])
    (tmp_path / "correct-big-float32-tp2-pp1.json").write_text(json.dumps(
        {"model": "big", "dtype": "float32", "tensor_parallel_size": 2,
         "pipeline_parallel_size": 1, "sequences": 4, "equal": 4, "near_ties": 0,
         "mismatches": 0, "max_gap": None, "rule": "exact", "passed": True,
         "divergences": []}))
    records, stdout = _report(tmp_path)
    perf = {(r["workload"], r["model"], r["variant"], r["tensor_parallel_size"],
             r["pipeline_parallel_size"]): r for r in records if r["workload"] != "greedy"}
    tp2_w1, tp2_l1 = perf["W1", "big", "bf16", 2, 1], perf["L1", "big", "bf16", 2, 1]
    assert (tp2_w1["ratio_vs_tp1"], tp2_w1["target_met"]) == (1.8, True)
    assert (tp2_l1["ratio_vs_tp1"], tp2_l1["target_met"]) == (0.7, False)
    assert perf["P1", "big", "bf16", 2, 1]["ratio_vs_tp1"] == 1.5
    assert "target" not in perf["P1", "big", "bf16", 2, 1]
    assert perf["W1", "big", "bf16", 1, 2]["ratio_vs_tp1"] == 1.5
    assert "ratio_vs_tp1" not in perf["W1", "llama-3.1-70b", "fp8", 2, 1]  # no TP=1 run
    assert [r["passed"] for r in records if r["workload"] == "greedy"] == [True]
    assert "<= 0.6x TP=1: NOT met" in stdout and ">= 1.7x TP=1: met" in stdout
    dry = [r for r in _report(tmp_path, dry="1")[0] if r.get("tensor_parallel_size") == 2]
    assert not [r for r in dry if "target" in r]  # a dry run judges nothing


def test_a_record_of_another_layout_than_its_file_name_is_refused(tmp_path) -> None:
    _write(tmp_path, "w1-big-bf16-tp2-pp1.json",
           [dict(workload="throughput", backend="pagedllm", output_tok_s=1.0)])
    with pytest.raises(subprocess.CalledProcessError) as excinfo:
        _report(tmp_path)
    assert "another layout" in excinfo.value.stderr


def test_throughput_records_name_the_tensor_parallel_size(tmp_path) -> None:
    """bench throughput passes -tp to the engine (two ranks over gloo) and says so."""
    out = tmp_path / "w1.json"
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    throughput.run(parser.parse_args([
        "--model", "pagedllm-demo", "--load-format", "dummy", "--num-prompts", "3",
        "--input-len", "4:9", "--output-len", "3:5", "--max-model-len", "32",
        "--num-kv-blocks", "32", "--block-size", "8", "-tp", "2", "--output-json", str(out)]))
    records = json.loads(out.read_text())
    record = records[-1] if isinstance(records, list) else records
    assert (record["tensor_parallel_size"], record["pipeline_parallel_size"]) == (2, 1)
