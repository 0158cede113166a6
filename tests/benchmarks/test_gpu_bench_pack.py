"""The GPU machine sends back at most 8 files from $OUT: a GPU run leaves its log and one
archive of everything else (scripts/gpu_bench_common.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(out: Path, **env: str) -> None:
    env = {**os.environ, "GPU_BENCH_DRY": "1", "GPU_BENCH_STEPS": "none", "OUT": str(out),
           "PYTHON": sys.executable, "PYTHONPATH": str(REPO), **env}
    result = subprocess.run(["bash", "scripts/gpu_bench.sh"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_a_packed_run_leaves_the_log_and_one_archive_of_the_rest(tmp_path) -> None:
    _run(tmp_path, GPU_BENCH_PACK="1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "results.tgz"]
    with tarfile.open(tmp_path / "results.tgz") as archive:
        names = archive.getnames()
    assert "steps.txt" in names and any(n.endswith("-dry.json") for n in names)  # the report


def test_the_ab_step_runs_both_sides_with_the_engine_arguments_given(tmp_path) -> None:
    """``GPU_BENCH_AB_ARGS`` reaches L1 and W1 on both sides of a setting's A/B (here FP8
    weights, as an FP8 switch's A/B needs); a run that is not packed keeps its files loose."""
    _run(tmp_path, GPU_BENCH_STEPS="ab", GPU_BENCH_AB="PAGEDLLM_FP8_DEFERRED_SCALES=0",
         GPU_BENCH_AB_ARGS="--quantization fp8")
    names = {p.name for p in tmp_path.iterdir()}
    assert "results.tgz" not in names and {"log.txt", "steps.txt", "ab.txt"} <= names
    ab = (tmp_path / "ab.txt").read_text()
    assert "DEFERRED_SCALES=0: without" in ab and "DEFERRED_SCALES=0: with " in ab
    assert ab.count(" L1 ") == 2 and ab.count(" pagedllm ") == 2
    assert (tmp_path / "log.txt").read_text().count("fp8 projections") == 4


def test_the_ab_step_times_decode_batches_of_a_few_sequences(tmp_path) -> None:
    """A decode-batch A/B (``GPU_BENCH_AB_BATCH_SIZES``) times L1 at each batch size, and no
    W1 with ``GPU_BENCH_AB_W1=0``."""
    _run(tmp_path, GPU_BENCH_STEPS="ab", GPU_BENCH_AB_ROUNDS="1", GPU_BENCH_AB_BATCH_SIZES="1 3",
         GPU_BENCH_AB_W1="0")
    rows = [line.split() for line in (tmp_path / "ab.txt").read_text().splitlines()
            if line.split()[:1] == ["L1"]]
    assert [row[1] for row in rows] == ["1", "3"]
    assert " pagedllm " not in (tmp_path / "ab.txt").read_text()


def test_the_structured_step_times_the_small_models_masks_on_one_four_and_the_default_threads(
        tmp_path) -> None:
    """After the constrained W1 runs, the small model's masks alone on the host
    (``bench_structured_masks.py``), with 1 and 4 fill threads and the engine's default,
    and the default threads taking rows from one queue."""
    _run(tmp_path, GPU_BENCH_STEPS="structured", STRUCTURED_AB="")
    for threads in ("1", "4", "default", "rows"):
        text = (tmp_path / f"structured-masks-{threads}.txt").read_text()
        assert "mask every row" in text and "dearest row" in text, text
    assert "1 fill threads" in (tmp_path / "structured-masks-1.txt").read_text()
    assert "4 fill threads" in (tmp_path / "structured-masks-4.txt").read_text()
    assert "rows from one queue" in (tmp_path / "structured-masks-rows.txt").read_text()
    assert "parallel call" in (tmp_path / "structured-masks-default.txt").read_text()
