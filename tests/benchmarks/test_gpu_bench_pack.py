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


def test_a_dry_run_keeps_its_files_loose(tmp_path) -> None:
    _run(tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert "results.tgz" not in names and {"log.txt", "steps.txt"} <= names
