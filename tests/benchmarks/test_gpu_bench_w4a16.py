"""The GPU run's w4a16 step: its records sit beside the bf16 ones of the same run, with
the ratio and the 4-bit targets (L1 at most 0.40x, P1 at least 0.9x, W1 at least 1.0x)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_w4a16_records_carry_their_ratio_to_bf16_and_the_target(tmp_path) -> None:
    def write(name: str, rows: list[dict]) -> None:
        (tmp_path / name).write_text(json.dumps([{"command": "pagedllm --model m", **r}
                                                 for r in rows]))

    w1 = dict(backend="pagedllm", num_prompts=4, output_tokens=20, elapsed_s=0.05)
    write("w1-big.json", [dict(w1, output_tok_s=400.0)])
    write("latency-big.json", [dict(workload="L1", ms_per_token=4.0),
                               dict(workload="P1", prompt_tok_s=40000.0)])
    write("w4a16-w1-big.json", [dict(w1, output_tok_s=420.0)])
    write("w4a16-latency-big.json", [dict(workload="L1", ms_per_token=2.0),
                                     dict(workload="P1", prompt_tok_s=30000.0)])
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_bench_report.py"), "--dir", str(tmp_path),
         "--date", "2026-01-02", "--big", "big", "--small", "small"],
        check=True, capture_output=True, text=True, env={"PAGEDLLM_COMMIT": "abc"})
    records = json.loads((tmp_path / "2026-01-02-h200.json").read_text())
    w4a16 = {r["workload"]: r for r in records if r.get("variant") == "w4a16"}
    assert (w4a16["L1"]["ratio_vs_bf16"], w4a16["L1"]["target_met"]) == (0.5, False)
    assert (w4a16["P1"]["ratio_vs_bf16"], w4a16["P1"]["target_met"]) == (0.75, False)
    assert (w4a16["W1"]["ratio_vs_bf16"], w4a16["W1"]["target_met"]) == (1.05, True)
    assert "at most 0.4x bf16: NOT met" in result.stdout


def test_a_run_without_the_w4a16_step_has_no_w4a16_records(tmp_path) -> None:
    subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_bench_report.py"), "--dir",
                    str(tmp_path), "--date", "2026-01-02", "--dry", "1"],
                   check=True, capture_output=True, env={"PAGEDLLM_COMMIT": "abc"})
    records = json.loads((tmp_path / "2026-01-02-dry.json").read_text())
    assert not [r for r in records if r.get("variant") == "w4a16"]
