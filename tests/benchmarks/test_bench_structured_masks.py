"""``scripts/bench_structured_masks.py``: the host's mask work for a step of constrained rows,
and what its fill threads could make of it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.benchmarks.gpu_report import REPO, load_script


def test_makespan_deals_each_job_to_the_first_worker_free():
    makespan = load_script("bench_structured_masks").makespan
    assert makespan([3.0, 1.0, 1.0, 1.0], 2) == 3.0
    assert makespan([1.0, 1.0, 1.0, 3.0], 2) == 4.0  # the dear job dealt last waits
    assert makespan([5.0, 1.0], 4) == 5.0  # never faster than the dearest job
    assert makespan([2.0] * 6, 1) == 12.0
    assert makespan([], 3) == 0.0


def test_the_script_times_every_way_and_the_rows_one_by_one():
    env = {**os.environ, "PAGEDLLM_GRAMMAR_FILL_THREADS": "2"}
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_structured_masks.py"), "--tokenizer",
         str(REPO / "pagedllm" / "model_files" / "pagedllm-demo"), "--rows", "8", "--steps", "3"],
        check=True, capture_output=True, text=True, timeout=300, env=env)
    means = {name.strip(): float(mean) for name, mean in re.findall(
        r"^\s*(.+?): median\s+[\d.]+ ms/step, mean\s+([\d.]+) ms/step", result.stdout, re.M)}
    assert set(means) == {"mask every row", "check, mask the refused",
                          "check, candidates, mask the rest", "rows' sum", "dearest row",
                          "dealt", "dearest first"}, result.stdout
    assert "2 fill threads" in result.stdout
    assert means["dearest row"] <= means["dealt"] <= means["rows' sum"]
