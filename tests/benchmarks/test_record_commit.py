"""The commit a benchmark record names (``benchmarks.common.git_commit``): the checkout's
HEAD, marked ``-dirty`` when the code that ran is not the commit's; the revision of a
package ``scripts/ab_prepare.sh`` extracted; or what ``PAGEDLLM_COMMIT`` says."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pagedllm.benchmarks.common as common


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def _package_copy(root: Path, monkeypatch):
    """``common.py`` at ``root/pagedllm/benchmarks/``, imported from there."""
    target = root / "pagedllm" / "benchmarks" / "common.py"
    target.parent.mkdir(parents=True)
    shutil.copy(common.__file__, target)
    spec = importlib.util.spec_from_file_location(f"copy_{abs(hash(root))}", target)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_a_record_names_head_and_says_when_the_tree_differs(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_COMMIT", raising=False)
    module = _package_copy(tmp_path, monkeypatch)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert module.git_commit() == head
    (tmp_path / "untracked.sh").write_text("echo\n")  # files git does not track: still clean
    assert module.git_commit() == head
    source = tmp_path / "pagedllm" / "benchmarks" / "common.py"
    source.write_text(source.read_text() + "\n# changed\n")
    assert module.git_commit() == f"{head}-dirty"
    monkeypatch.setenv("PAGEDLLM_COMMIT", "abc1234")
    assert module.git_commit() == "abc1234"


def test_an_extracted_revision_names_its_own_commit_not_the_checkouts(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text(".ab/\n")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    extracted = tmp_path / ".ab" / "0123abc"
    module = _package_copy(extracted, monkeypatch)
    assert module.git_commit() is None  # inside the checkout, but not its code
    (extracted / "REVISION").write_text("0123abc\n")
    assert module.git_commit() == "0123abc"
