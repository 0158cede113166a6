"""The GPU run's moe step: Mixtral's W1 sits beside the dense model's W1 of the same run,
with the ratio and the target (at least 0.6x); the smaller MoE's W1 is recorded too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _report(directory: Path) -> tuple[list[dict], str]:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_bench_report.py"), "--dir", str(directory),
         "--date", "2026-01-02", "--big", "big", "--small", "small", "--moe", "mix",
         "--moe-small", "a3b"],
        check=True, capture_output=True, text=True, env={"PAGEDLLM_COMMIT": "abc"})
    return json.loads((directory / "2026-01-02-h200.json").read_text()), result.stdout


def test_moe_w1_carries_its_ratio_to_the_dense_w1_and_the_target(tmp_path) -> None:
    def write(name: str, rows: list[dict]) -> None:
        (tmp_path / name).write_text(json.dumps([{"command": "pagedllm --model m", **r}
                                                 for r in rows]))

    w1 = dict(backend="pagedllm", num_prompts=4, output_tokens=20, elapsed_s=0.05)
    write("w1-big.json", [dict(w1, output_tok_s=1000.0)])
    write("moe-w1-mix.json", [dict(w1, output_tok_s=550.0)])
    write("moe-w1-a3b.json", [dict(w1, output_tok_s=1500.0)])
    write("moe-latency-mix.json", [dict(workload="L1", ms_per_token=9.0),
                                   dict(workload="P1", prompt_tok_s=20000.0)])
    records, stdout = _report(tmp_path)
    moe = {(r["workload"], r["model"]): r for r in records if r.get("variant") == "moe"}
    assert (moe["W1", "mix"]["ratio_vs_dense"], moe["W1", "mix"]["target_met"]) == (0.55, False)
    assert moe["W1", "a3b"]["output_tok_s"] == 1500.0
    assert moe["L1", "mix"]["ms_per_token"] == 9.0 and moe["P1", "mix"]["prompt_tok_s"] == 20000.0
    assert "at least 0.6x big: NOT met" in stdout


def test_a_run_without_the_moe_step_has_no_moe_records(tmp_path) -> None:
    records, _ = _report(tmp_path)
    assert not [r for r in records if r.get("variant") == "moe"]
