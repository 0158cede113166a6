"""README.md and docs/architecture.md as a newcomer reads them: every serve flag documented,
every link resolving, every file the architecture map names present."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pagedllm.entrypoints.openai.cli_args import add_serve_args

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_every_serve_flag_is_in_the_readme():
    """Each flag of ``pagedllm serve`` appears as a flag (the serve table) or as the engine
    argument's keyword (the engine-argument table); refused flags are hidden and exempt."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if f"`{flag}" not in README and f"`--[no-]{flag[2:]}`" not in README and (
                f"`{action.dest}`" not in README):
            missing.append(flag)
    assert not missing


def test_relative_links_of_the_readme_point_to_files():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README)
    assert "docs/architecture.md" in links
    assert [link for link in links if not (REPO / link).exists()] == []


def test_files_named_in_the_architecture_map_exist():
    text = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:[\w]+/)*\w+\.py)`", text))
    sources = [p.relative_to(REPO).as_posix() for p in (REPO / "pagedllm").rglob("*.py")]
    assert len(named) > 20
    assert sorted(n for n in named if not any(s == n or s.endswith("/" + n) for s in sources)) == []
