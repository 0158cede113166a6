"""Switches from the environment: set ones are read as given, and a value outside the
switch's own (1 or 0; a choice's names) is refused by name rather than silently taken as
the default."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers import triton_ops
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


def test_the_switches_on_by_default_are_read_alike(monkeypatch):
    from pagedllm.layers.attention.triton_decode import wants_longest_first

    monkeypatch.delenv("PAGEDLLM_DECODE_LONGEST_FIRST", raising=False)
    assert wants_longest_first(64) and not wants_longest_first(63)
    monkeypatch.setenv("PAGEDLLM_DECODE_LONGEST_FIRST", "0")
    assert not wants_longest_first(64)
    monkeypatch.setenv("PAGEDLLM_DECODE_LONGEST_FIRST", "off")
    with pytest.raises(ValueError, match="PAGEDLLM_DECODE_LONGEST_FIRST='off': give 1"):
        wants_longest_first(64)
    monkeypatch.setenv("PAGEDLLM_FUSED_OPS", "false")
    triton_ops.fused_ops_enabled.cache_clear()
    try:
        with pytest.raises(ValueError, match="PAGEDLLM_FUSED_OPS='false': give 1"):
            triton_ops.fused_ops_enabled()
    finally:
        monkeypatch.delenv("PAGEDLLM_FUSED_OPS")
        triton_ops.fused_ops_enabled.cache_clear()


def test_a_choice_takes_its_names_only(monkeypatch):
    from pagedllm.layers.attention.triton_common import uses_fp16_dot

    fp8 = torch.float8_e4m3fn
    monkeypatch.delenv("PAGEDLLM_FP8_KV_DOT", raising=False)
    assert uses_fp16_dot(torch.bfloat16, fp8) and not uses_fp16_dot(torch.bfloat16, torch.bfloat16)
    monkeypatch.setenv("PAGEDLLM_FP8_KV_DOT", "BF16")
    assert not uses_fp16_dot(torch.bfloat16, fp8)
    monkeypatch.setenv("PAGEDLLM_FP8_KV_DOT", "fp32")
    with pytest.raises(ValueError, match="PAGEDLLM_FP8_KV_DOT='fp32': give one of fp16, bf16"):
        uses_fp16_dot(torch.bfloat16, fp8)


def test_programmatic_dependent_launch_is_a_switch_of_the_gpu_only(monkeypatch):
    """``PAGEDLLM_PDL=1``: kernels launch early only on a GPU that has it; off (the
    default), or on the CPU, a kernel's ``PDL`` constexpr is off and no ``launch_pdl`` is
    passed; a value the switch does not take is refused even where it would not apply."""
    from pagedllm.layers import pdl

    cpu = torch.device("cpu")
    monkeypatch.delenv("PAGEDLLM_PDL", raising=False)
    pdl.pdl_enabled.cache_clear()
    pdl.launch_options.cache_clear()
    try:
        assert pdl.launch_options(cpu) == {"PDL": False}
        monkeypatch.setenv("PAGEDLLM_PDL", "1")
        pdl.pdl_enabled.cache_clear()
        pdl.launch_options.cache_clear()
        assert pdl.launch_options(cpu) == {"PDL": False}
        monkeypatch.setenv("PAGEDLLM_PDL", "on")
        pdl.pdl_enabled.cache_clear()
        with pytest.raises(ValueError, match="PAGEDLLM_PDL='on': give 1"):
            pdl.pdl_enabled(cpu)
    finally:
        monkeypatch.delenv("PAGEDLLM_PDL")
        pdl.pdl_enabled.cache_clear()
        pdl.launch_options.cache_clear()
