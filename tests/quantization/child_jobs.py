"""Quantization tools' jobs run in a child process: the tools are heavy to import and set
up logging of their own. ``run_jobs(module, jobs)`` runs ``python -m module`` with the jobs
as JSON (paths as strings); the module calls ``main(function)``, which calls ``function``
with each job's fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable


def run_jobs(module: str, jobs: list[tuple], **environment: str) -> None:
    payload = json.dumps([[str(src), str(out), *rest] for src, out, *rest in jobs])
    subprocess.run([sys.executable, "-m", module, payload], check=True, capture_output=True,
                   timeout=600, cwd=Path(__file__).resolve().parents[2],
                   env={**os.environ, **environment})


def main(function: Callable[..., None]) -> None:
    for job in json.loads(sys.argv[1]):
        function(*job)
