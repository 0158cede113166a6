"""docs/deploy.md and the --metrics-compat help name every vLLM series the server exports,
and the page's relative links resolve."""

from __future__ import annotations

import argparse
import re

from pagedllm.entrypoints.openai.cli_args import add_serve_args
from pagedllm.metrics import VLLM_NAMES
from tests.deploy.manifests import REPO

DOC = REPO / "docs" / "deploy.md"


def _documented(family: str) -> str:
    """A family's name as the docs write it: counters with ``_total``."""
    counters = ("prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                "prefix_cache_queries", "prefix_cache_hits", "spec_decode_num_drafts",
                "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                "spec_decode_num_accepted_tokens_per_pos")
    return family + "_total" if family.split(":")[1] in counters else family


def test_deploy_doc_maps_every_vllm_name():
    text = DOC.read_text()
    for family, vllm_names in VLLM_NAMES.items():
        row = next(line for line in text.splitlines()
                   if line.startswith(f"| `{_documented(family)}` |"))
        for vllm_name in vllm_names:
            assert f"`{_documented(vllm_name)}`" in row


def test_metrics_compat_help_names_every_mapped_series():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    (action,) = [a for a in parser._actions if "--metrics-compat" in a.option_strings]
    for family, vllm_names in VLLM_NAMES.items():
        assert _documented(family).split(":")[1] in action.help
        for vllm_name in vllm_names:
            assert vllm_name.split(":")[1] in action.help


def test_relative_links_of_the_deploy_doc_resolve():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", DOC.read_text())
    assert links
    assert [link for link in links if not (DOC.parent / link).exists()] == []
