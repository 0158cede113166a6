"""On/off switches from the environment: set ones are read as given, and a value that is
neither 1 nor 0 is refused by name rather than silently taken as off."""

from __future__ import annotations

import pytest

from pagedllm.structured.manager import prefetch_masks_wanted
from pagedllm.switches import switch
from pagedllm.worker.cuda_graphs import mixed_graphs_enabled


def test_a_switch_is_on_off_or_its_default(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_MIXED_GRAPHS", raising=False)
    assert not mixed_graphs_enabled()
    monkeypatch.setenv("PAGEDLLM_MIXED_GRAPHS", "1")
    assert mixed_graphs_enabled()
    monkeypatch.delenv("PAGEDLLM_PREFETCH_MASKS", raising=False)
    assert prefetch_masks_wanted("cuda") and not prefetch_masks_wanted("cpu")
    monkeypatch.setenv("PAGEDLLM_PREFETCH_MASKS", "0")
    assert not prefetch_masks_wanted("cuda")


@pytest.mark.parametrize("value", ["true", "yes", "2"])
def test_a_switch_set_to_anything_else_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("PAGEDLLM_MIXED_GRAPHS", value)
    with pytest.raises(ValueError, match=f"PAGEDLLM_MIXED_GRAPHS='{value}': give 1"):
        mixed_graphs_enabled()
    monkeypatch.setenv("PAGEDLLM_FP8_HALF_SUMS", value)
    with pytest.raises(ValueError, match="PAGEDLLM_FP8_HALF_SUMS"):
        switch("PAGEDLLM_FP8_HALF_SUMS", False)
