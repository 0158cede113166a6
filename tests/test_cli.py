"""The ``pagedllm`` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys


def pagedllm(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_generate_prints_prompt_and_completion_with_the_bundled_model():
    result = pagedllm("--log-level", "WARNING", "generate", "def add(a, b):", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def add(a, b):")
    assert "[length, 8 tokens]" in result.stdout or "[stop," in result.stdout


def test_refused_feature_exits_with_a_clear_message():
    result = pagedllm("generate", "x", "--tensor-parallel-size", "2")
    assert result.returncode == 2
    assert "tensor_parallel_size=2 is not supported" in result.stderr


def test_bench_throughput_writes_a_json_record(tmp_path):
    out = tmp_path / "tp.json"
    result = pagedllm("--log-level", "WARNING", "bench", "throughput", "--num-prompts", "4",
                      "--input-len", "8:16", "--output-len", "4:8", "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["num_prompts"] == 4 and record["output_tok_s"] > 0
    assert 4 * 4 <= record["output_tokens"] <= 4 * 8


def test_bench_overhead_reports_step_cost(tmp_path):
    out = tmp_path / "overhead.json"
    result = pagedllm("bench", "overhead", "--num-requests", "16", "--steps", "5",
                      "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["num_requests"] == 16 and record["step_total_ms"] > 0


def test_bench_overhead_times_penalty_metadata_both_ways(tmp_path):
    out = tmp_path / "overhead.json"
    result = pagedllm("bench", "overhead", "--num-requests", "8", "--steps", "3", "--penalties",
                      "--vocab-size", "256", "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["vocab_size"] == 256
    assert record["penalty_metadata_kept_ms"] > 0 and record["penalty_metadata_afresh_ms"] > 0
    assert "penalty metadata per step" in result.stdout
