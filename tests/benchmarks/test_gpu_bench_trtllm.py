"""TensorRT-LLM's H200 FP8 table beside ours (scripts/gpu_bench_trtllm.sh): a record per
shape with TRT-LLM's figure, the ratio and the scale of the run, the table printed last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "scripts" / "gpu_bench_trtllm.py"


def test_dry_run_writes_a_record_per_shape_beside_trtllm_with_its_scale(tmp_path) -> None:
    env = {**os.environ, "GPU_BENCH_DRY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
           "PYTHONPATH": str(REPO), "PAGEDLLM_COMMIT": "abc", "TRTLLM_DTYPES": "fp8",
           "TRTLLM_SHAPES": "128/128", "TRTLLM_SCALE": "0.5", "TRTLLM_ARGS": "--max-num-seqs 8"}
    result = subprocess.run(["bash", "scripts/gpu_bench_trtllm.sh"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads((tmp_path / "trtllm-128-128.json").read_text())
    fp8 = record["fp8"]
    assert (record["scale"], record["trtllm_output_tok_s"], record["engine_flags"]) == (
        0.5, 27911, "--max-num-seqs 8")
    assert fp8["ratio_vs_trtllm"] == round(fp8["output_tok_s"] / 27911, 3)
    assert fp8["kv_cache_dtype"].startswith("float8")
    assert "--quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 8" in fp8["command"]
    assert "bf16" not in record  # TRTLLM_DTYPES picked the column
    table = result.stdout[result.stdout.index("=== fp8: exit 0"):]
    assert "128/128" in table and "not run or not finished: 2048/128" in table


def _helper(*args: str) -> str:
    return subprocess.run([sys.executable, str(HELPER), *args], check=True, capture_output=True,
                          text=True, env={**os.environ, "PAGEDLLM_COMMIT": "abc"}).stdout


def test_the_plan_scales_each_shapes_requests_and_refuses_unknown_shapes() -> None:
    shapes, limit = _helper("plan", "--dtype", "fp8", "--scale", "0.1").split()
    assert shapes == ("128/128x3000,2048/128x300,1000/1000x300,500/2000x300,"
                      "2048/2048x150")
    assert int(limit) > 120
    assert _helper("plan", "--dtype", "bf16", "--scale", "0.0001",
                   "--shapes", "2048/2048").split()[0] == "2048/2048x1"
    with pytest.raises(subprocess.CalledProcessError) as refused:
        _helper("plan", "--dtype", "fp8", "--shapes", "128/256")
    assert "the shapes are 128/128" in refused.value.stderr


def test_report_sets_fp8_beside_bf16_and_trtllm(tmp_path) -> None:
    def write(dtype: str, tok_s: float) -> None:
        (tmp_path / f"trtllm-{dtype}.json").write_text(json.dumps([
            {"shape": "1000/1000", "num_prompts": 300, "output_tok_s": tok_s, "elapsed_s": 10.0,
             "command": f"pagedllm {dtype}", "preemptions": 3 if dtype == "bf16" else 0,
             "preempted_tokens": 4500 if dtype == "bf16" else 0}]))

    write("fp8", 17744.0)
    write("bf16", 8872.0)
    stdout = _helper("report", "--dir", str(tmp_path), "--date", "2026-01-02", "--scale", "0.1")
    record = json.loads((tmp_path / "trtllm-1000-1000.json").read_text())
    assert (record["fp8"]["ratio_vs_trtllm"], record["bf16"]["ratio_vs_trtllm"]) == (1.0, 0.5)
    assert (record["fp8_vs_bf16"], record["scale"]) == (2.0, 0.1)
    assert json.loads((tmp_path / "2026-01-02-h200-trtllm.json").read_text()) == [record]
    assert "1000/1000       300    0.1    17744     17744.0      1.0x      8872.0      0.5x" in stdout
    assert record["bf16"]["preempted_tokens"] == 4500
    assert "preemptions dropped (computed again): 1000/1000 bf16 4,500" in stdout


def test_an_h100_run_is_set_beside_trtllms_h100_table(tmp_path) -> None:
    (tmp_path / "trtllm-fp8.json").write_text(json.dumps([
        {"shape": "500/2000", "num_prompts": 1500, "output_tok_s": 17660.0, "elapsed_s": 10.0,
         "command": "pagedllm fp8"}]))
    stdout = _helper("report", "--dir", str(tmp_path), "--date", "2026-01-02", "--scale", "0.5",
                     "--dtypes", "fp8", "--reference", "h100")
    record = json.loads((tmp_path / "trtllm-500-2000.json").read_text())
    assert (record["trtllm_gpu"], record["trtllm_output_tok_s"]) == ("H100", 17660)
    assert record["fp8"]["ratio_vs_trtllm"] == 1.0
    assert json.loads((tmp_path / "2026-01-02-h100-trtllm.json").read_text()) == [record]
    assert "its H100 table" in stdout


def test_the_reference_follows_the_gpu_measured() -> None:
    sys.path.insert(0, str(HELPER.parent))
    from gpu_bench_trtllm import reference_table

    assert reference_table("auto", "NVIDIA H100 80GB HBM3")[0] == "h100"
    assert reference_table("auto", "NVIDIA H200")[1]["128/128"] == 27911
    assert reference_table("h200", "NVIDIA H100 80GB HBM3")[1]["1000/1000"] == 17744
