"""Switches from the environment: set ones are read as given, and a value outside the
switch's own (1 or 0; a choice's names; an integer's range) is refused by name rather than
silently taken as the default."""

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
    monkeypatch.setenv("PAGEDLLM_ARGMAX_LANES", value)
    with pytest.raises(ValueError, match="PAGEDLLM_ARGMAX_LANES"):
        switch("PAGEDLLM_ARGMAX_LANES", False)


@pytest.fixture
def fresh_gemv_rows():
    triton_ops.gemv_max_rows.cache_clear()
    yield triton_ops.gemv_max_rows
    triton_ops.gemv_max_rows.cache_clear()


def test_an_integer_switch_takes_its_range_and_refuses_the_rest(monkeypatch, fresh_gemv_rows):
    name = triton_ops.GEMV_MAX_ROWS_ENV
    monkeypatch.delenv(name, raising=False)
    assert fresh_gemv_rows() == triton_ops.DEFAULT_GEMV_MAX_ROWS
    for value in ("0", "16"):
        monkeypatch.setenv(name, value)
        fresh_gemv_rows.cache_clear()
        assert fresh_gemv_rows() == int(value)
    for value in ("17", "-1", "two", "4.0"):
        monkeypatch.setenv(name, value)
        fresh_gemv_rows.cache_clear()
        with pytest.raises(ValueError, match=f"{name}='{value}': give an integer from 0 to 16"):
            fresh_gemv_rows()


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
    from pagedllm.structured.backend import fills_by_rows

    monkeypatch.delenv("PAGEDLLM_GRAMMAR_FILL", raising=False)
    assert not fills_by_rows()
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_FILL", "ROWS")
    assert fills_by_rows()
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_FILL", "threads")
    with pytest.raises(ValueError, match="PAGEDLLM_GRAMMAR_FILL='threads': give one of par, rows"):
        fills_by_rows()


def test_fp8_tiles_widen_before_the_products_only_where_asked_and_compiled(monkeypatch):
    """``PAGEDLLM_FP8_KV_WIDEN=staged`` applies to float16 products over an FP8 cache,
    compiled (the interpreter runs no inline assembly); other values are refused."""
    from pagedllm.layers.attention.triton_common import widens_staged

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PAGEDLLM_FP8_KV_WIDEN", raising=False)
    assert not widens_staged(True)
    monkeypatch.setenv("PAGEDLLM_FP8_KV_WIDEN", "Staged")
    assert widens_staged(True) and not widens_staged(False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not widens_staged(True)
    monkeypatch.setenv("PAGEDLLM_FP8_KV_WIDEN", "registers")
    with pytest.raises(ValueError, match="PAGEDLLM_FP8_KV_WIDEN='registers': give one of"):
        widens_staged(False)

def test_programmatic_dependent_launch_is_a_switch_of_the_gpu_only(monkeypatch, caplog):
    """Kernels launch early (the ``PDL`` constexpr and Triton's ``launch_pdl`` together) on
    a GPU of compute capability 9.0+, unless ``PAGEDLLM_PDL=0``; never on the CPU, under
    the interpreter or on an older GPU (asked for there with ``=1``, said once in the log);
    a value the switch does not take is refused even where it would not apply."""
    from pagedllm.layers import pdl

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _: capability[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "an older GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def options(device, value):
        monkeypatch.setenv("PAGEDLLM_PDL", value)
        pdl.pdl_enabled.cache_clear()
        pdl.launch_options.cache_clear()
        return pdl.launch_options(device)

    try:
        assert options(gpu, "") == {"PDL": True, "launch_pdl": True}  # the default
        assert options(gpu, "0") == {"PDL": False}
        assert options(gpu, "1") == {"PDL": True, "launch_pdl": True}
        assert options(cpu, "1") == {"PDL": False}
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert options(gpu, "") == {"PDL": False}
        monkeypatch.delenv("TRITON_INTERPRET")
        capability[0] = (8, 0)
        assert options(gpu, "") == {"PDL": False}
        assert "is ignored" not in caplog.text
        assert options(gpu, "1") == {"PDL": False}
        assert "PAGEDLLM_PDL=1 is ignored on an older GPU" in caplog.text
        with pytest.raises(ValueError, match="PAGEDLLM_PDL='on': give 1"):
            options(cpu, "on")
    finally:
        monkeypatch.delenv("PAGEDLLM_PDL")
        pdl.pdl_enabled.cache_clear()
        pdl.launch_options.cache_clear()
