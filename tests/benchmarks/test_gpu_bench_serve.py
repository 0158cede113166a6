"""The HTTP path beside the offline engine (scripts/gpu_bench_serve.py, gpu_bench.sh's serve
step): one record with both runs, their ratio against the 0.97 target and each process's
CPU seconds; several clients merged over their common window; the report's serve rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.gpu_report import load_script, run_report

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "scripts" / "gpu_bench_serve.py"



def test_serve_beside_offline_on_the_demo_model(tmp_path) -> None:
    """A real server (two API processes) and both bench commands, the load split over two
    client processes: the record holds both runs' figures and their ratio, every request
    completed, and the server is gone after."""
    result = subprocess.run(
        [sys.executable, str(HELPER), "--model", "pagedllm-demo", "--out", str(tmp_path),
         "--num-prompts", "6", "--input-len", "8", "--output-len", "4", "--clients", "2",
         "--api-server-counts", "2",
         "--startup-timeout-s", "120"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [record] = json.loads((tmp_path / "serve-pagedllm-demo.json").read_text())
    assert record["api_server_count"] == 2  # a server of two API processes
    assert record["event_loop"] == "uvloop"  # as uvicorn[standard] installs it
    assert (record["http"]["completed"], record["http"]["failed"]) == (6, 0)
    assert record["http"]["total_output_tokens"] == record["offline"]["output_tokens"] == 24
    assert record["http_vs_offline"] == round(
        record["http_output_tok_s"] / record["offline_output_tok_s"], 3)
    assert record["met"] == (record["http_vs_offline"] >= 0.97)
    assert record["cpu_seconds"]["api"] > 0 and record["cpu_seconds"]["client"] > 0
    for run in ("offline", "server_core"):  # both runs' steps, timed
        steps = record["steps"][run]
        assert steps["busy_s"] > 0 and steps["decode"]["steps"] >= 3, (run, steps)
        timeline = record["timeline"][run]  # the server's core also had warm-up requests
        assert timeline["requests_added"] >= 6, timeline
        assert 0 <= timeline["first_step_s"] < timeline["last_output_s"], timeline
        assert timeline["steps_busy_s"] + timeline["idle_s"] == pytest.approx(
            timeline["last_output_s"] - timeline["first_step_s"], abs=1e-3)
    # The server core's time between steps: waiting for requests, messages, outputs sent.
    between = [record["timeline"]["server_core"][k] for k in ("waiting_s", "messages_s", "send_s")]
    assert min(between) >= 0 and sum(between) <= record["timeline"]["server_core"]["idle_s"] + 1e-3
    assert record["clients"] == 2 and record["profiles"] == {
        "api": None, "core": None, "client": None}  # no --py-spy-seconds
    assert "pagedllm-demo" in result.stdout.splitlines()[-1]
    still_up = subprocess.run(["pgrep", "-f", f"serve pagedllm-demo.*{tmp_path.name}"],
                              capture_output=True, check=False)
    assert still_up.returncode == 1


def test_clients_merge_over_their_common_window() -> None:
    helper = load_script("gpu_bench_serve")
    first = {"start_time": 100.0, "duration_s": 10.0, "completed": 3, "failed": 0,
             "total_input_tokens": 30, "total_output_tokens": 300, "ttft_ms": {"median": 1}}
    second = {**first, "start_time": 101.0, "duration_s": 11.0, "completed": 2, "failed": 1,
              "total_output_tokens": 200}
    merged = helper._merge([first, second])
    assert merged["duration_s"] == 12.0  # 100.0 -> 112.0
    assert (merged["completed"], merged["failed"], merged["total_output_tokens"]) == (5, 1, 500)
    assert merged["output_throughput"] == round(500 / 12.0, 2)
    assert merged["ttft_ms"] == {"median": 1} and merged["clients"] == 2
    assert helper._merge([first]) == first  # one client: its record as it is


def test_rounds_are_summed_up_by_their_medians() -> None:
    helper = load_script("gpu_bench_serve")
    rows = [{"model": "small", "api_server_count": count, "offline_output_tok_s": offline,
             "http_output_tok_s": http}
            for count, offline, http in [(1, 100.0, 80.0), (2, 100.0, 99.0), (1, 140.0, 90.0),
                                         (2, 140.0, 120.0), (1, 120.0, 85.0), (2, 120.0, 110.0)]]
    one, two = helper.median_table(rows).splitlines()[1:]
    assert one.split() == ["small", "1", "3", "120", "85", f"{85 / 120:.3f}"]
    assert two.split() == ["small", "2", "3", "120", "110", f"{110 / 120:.3f}"]


def test_profile_summary_shares_frames_inclusive_and_at_the_top() -> None:
    raw = ("main (a.py:1);loop (a.py:2);send (b.py:3) 6\n"
           "main (a.py:1);loop (a.py:2) 2\n"
           "main (a.py:1);parse (c.py:4);loop (a.py:2) 2\n")
    summary = load_script("gpu_bench_serve").summarize_profile(raw, top=3)
    assert summary["samples"] == 10
    assert sorted(summary["inclusive"][:2]) == [["loop (a.py:2)", 1.0], ["main (a.py:1)", 1.0]]
    assert summary["inclusive"][2] == ["send (b.py:3)", 0.6]
    assert summary["self"] == [["send (b.py:3)", 0.6], ["loop (a.py:2)", 0.4]]


def test_report_sets_the_serve_rows_beside_their_target(tmp_path) -> None:
    row = {"workload": "serve-vs-offline", "model": "small", "offline_output_tok_s": 1000.0,
           "http_output_tok_s": 900.0, "http_vs_offline": 0.9, "target": 0.97, "met": False,
           "cpu_seconds": {"api": 1.0, "core": 2.0, "client": 3.0},
           "ttft_ms": {"median": 10.0, "p99": 20.0}, "tpot_ms": {"median": 1.0, "p99": 2.0},
           "offline": {"big": "record"}, "http": {"big": "record"}, "profiles": {"api": None}}
    (tmp_path / "serve-small.json").write_text(json.dumps(row))
    records, stdout = run_report(tmp_path, "--big", "big", "--small", "small")
    serve = [r for r in records if r["workload"] == "serve-vs-offline"]
    assert len(serve) == 1 and serve[0]["output_tok_s"] == 900.0
    assert (serve[0]["target"], serve[0]["target_met"]) == ("http_vs_offline >= 0.97", False)
    assert "offline" not in serve[0] and "profiles" not in serve[0]
    assert "small" in stdout.split("HTTP (bench serve) beside offline")[1]
    assert "1.0 / 2.0 / 3.0  (target 0.97)" in stdout
