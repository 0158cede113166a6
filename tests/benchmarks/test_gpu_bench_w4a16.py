"""The GPU run's w4a16 step: its records sit beside the bf16 ones of the same run, with
the ratio and the 4-bit targets (L1 at most 0.40x, P1 at least 0.9x, W1 at least 1.0x)."""

from __future__ import annotations

from tests.benchmarks.gpu_report import W1_ROW, run_report, write_records


def test_w4a16_records_carry_their_ratio_to_bf16_and_the_target(tmp_path) -> None:
    write_records(tmp_path, "w1-big.json", [dict(W1_ROW, output_tok_s=400.0)])
    write_records(tmp_path, "latency-big.json", [dict(workload="L1", ms_per_token=4.0),
                                                 dict(workload="P1", prompt_tok_s=40000.0)])
    write_records(tmp_path, "w4a16-w1-big.json", [dict(W1_ROW, output_tok_s=420.0)])
    write_records(tmp_path, "w4a16-latency-big.json", [dict(workload="L1", ms_per_token=2.0),
                                                       dict(workload="P1", prompt_tok_s=30000.0)])
    records, stdout = run_report(tmp_path, "--big", "big", "--small", "small")
    w4a16 = {r["workload"]: r for r in records if r.get("variant") == "w4a16"}
    assert (w4a16["L1"]["ratio_vs_bf16"], w4a16["L1"]["target_met"]) == (0.5, False)
    assert (w4a16["P1"]["ratio_vs_bf16"], w4a16["P1"]["target_met"]) == (0.75, False)
    assert (w4a16["W1"]["ratio_vs_bf16"], w4a16["W1"]["target_met"]) == (1.05, True)
    assert "at most 0.4x bf16: NOT met" in stdout


def test_a_run_without_the_w4a16_step_has_no_w4a16_records(tmp_path) -> None:
    records, _ = run_report(tmp_path, dry=True)
    assert not [r for r in records if r.get("variant") == "w4a16"]
