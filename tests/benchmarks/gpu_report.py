"""Writing a GPU run's step records and building its report (``scripts/gpu_bench_report.py``),
for the tests of the report's steps."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATE = "2026-01-02"
# One W1 record's fields besides its throughput.
W1_ROW = dict(backend="pagedllm", num_prompts=4, output_tokens=20, elapsed_s=0.05)


def write_records(directory: Path, name: str, rows: list[dict]) -> None:
    """A step's JSON records, as the benchmark commands write them."""
    (directory / name).write_text(json.dumps([{"command": "pagedllm --model m", **r}
                                              for r in rows]))


def run_report(directory: Path, *args: str, dry: bool = False) -> tuple[list[dict], str]:
    """The report's records and printed table for the records in ``directory``."""
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_bench_report.py"), "--dir", str(directory),
         "--date", DATE, *(["--dry", "1"] if dry else []), *args],
        check=True, capture_output=True, text=True, env={"PAGEDLLM_COMMIT": "abc"})
    name = f"{DATE}-{'dry' if dry else 'h200'}.json"
    return json.loads((directory / name).read_text()), result.stdout


def load_script(name: str):
    """``scripts/<name>.py`` as a module, for tests of its functions."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
