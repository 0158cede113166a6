"""The GPU run's moe step: Mixtral's W1 sits beside the dense model's W1 of the same run,
with the ratio and the target (at least 0.6x); the smaller MoE's W1 is recorded too. And
the MoE tile sweep (``scripts/bench_fused_moe.py --sweep``), run on tiny shapes."""

from __future__ import annotations

import json

from tests.benchmarks.gpu_report import W1_ROW, load_script, run_report, write_records

ARGS = ("--big", "big", "--small", "small", "--moe", "mix", "--moe-small", "a3b")


def test_moe_w1_carries_its_ratio_to_the_dense_w1_and_the_target(tmp_path) -> None:
    write_records(tmp_path, "w1-big.json", [dict(W1_ROW, output_tok_s=1000.0)])
    write_records(tmp_path, "moe-w1-mix.json", [dict(W1_ROW, output_tok_s=550.0)])
    write_records(tmp_path, "moe-w1-a3b.json", [dict(W1_ROW, output_tok_s=1500.0)])
    write_records(tmp_path, "moe-latency-mix.json", [dict(workload="L1", ms_per_token=9.0),
                                                     dict(workload="P1", prompt_tok_s=20000.0)])
    records, stdout = run_report(tmp_path, *ARGS)
    moe = {(r["workload"], r["model"]): r for r in records if r.get("variant") == "moe"}
    assert (moe["W1", "mix"]["ratio_vs_dense"], moe["W1", "mix"]["target_met"]) == (0.55, False)
    assert moe["W1", "a3b"]["output_tok_s"] == 1500.0
    assert moe["L1", "mix"]["ms_per_token"] == 9.0 and moe["P1", "mix"]["prompt_tok_s"] == 20000.0
    assert "at least 0.6x big: NOT met" in stdout


def test_a_run_without_the_moe_step_has_no_moe_records(tmp_path) -> None:
    records, _ = run_report(tmp_path, *ARGS)
    assert not [r for r in records if r.get("variant") == "moe"]


def test_the_tile_sweep_runs_end_to_end_on_tiny_shapes_and_writes_its_rows(tmp_path,
                                                                          capsys) -> None:
    bench = load_script("bench_fused_moe")
    out = tmp_path / "sweep.json"
    bench.main(["--sweep", "--tiny", "--out", str(out), "--budget-s", "600"])
    rows = json.loads(out.read_text())
    pairs = {(r["shape"], r["tokens"]) for r in rows}
    assert pairs == {(s, t) for s in bench.TINY_SHAPES for t in (1, 8)}
    for pair in pairs:
        kinds = sorted(r["kind"] for r in rows if (r["shape"], r["tokens"]) == pair)
        assert kinds == ["candidate"] * len(bench.TINY_CANDIDATES) + ["configured", "loop"]
    assert all(r["ok"] and r["ms"] > 0 and r["error"] is None for r in rows)
    assert {r["tile"] for r in rows if r["kind"] == "candidate"} == \
        {t.spec() for t in bench.TINY_CANDIDATES}
    table = capsys.readouterr().out.strip().splitlines()[-len(pairs) - 1:]
    assert table[0].split() == ["shape", "tokens", "bucket", "configured", "ms", "best", "tile",
                                "ms", "loop", "ms"]
    assert [line.split()[:2] for line in table[1:]] == \
        [[s, str(t)] for s in bench.TINY_SHAPES for t in (1, 8)]


def test_the_sweep_stops_at_its_budget_with_the_rows_it_has(tmp_path) -> None:
    bench = load_script("bench_fused_moe")
    out = tmp_path / "sweep.json"
    bench.main(["--sweep", "--tiny", "--out", str(out), "--budget-s", "0"])
    assert json.loads(out.read_text()) == []
