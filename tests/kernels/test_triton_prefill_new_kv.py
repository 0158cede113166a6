"""Prefill attention reading a step's new keys from contiguous rows (``new_kv``), written by
the KV write beside the cache, and long chunks' cached contexts from rows widened once a
step: the same attention as reading every key from the pages, over an FP8 cache and a
cache in the model's dtype, for fresh prompts, chunks whose cached context ends inside a
key tile, prompts of several query tiles, and decodes in the batch."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.attention import triton_backend, triton_prefill
from pagedllm.layers.attention.kv_quant import paged_kv_views
from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
from pagedllm.layers.attention.triton_kv_write import rotate_and_write_kv, write_kv_cache
from pagedllm.layers.attention.triton_prefill import (
    paged_prefill_attention, plan_context_rows, products_dtype, widen_context_rows,
)
from pagedllm.quantization.fp8 import FP8_DTYPE
from tests.kernels.paged_batch import (
    TOLERANCE, batch_args, make_fp8_step, make_step, reference_attention,
)

SCALES = dict(k_scale=0.5, v_scale=2.0)
# (cached tokens, new tokens): fresh prompts, contexts ending mid-tile and on a tile's
# edge, a prompt of several query tiles, decodes.
SEQS = ((0, 37), (19, 21), (33, 1), (5, 16), (16, 9), (0, 1), (8, 3))


def _step(cache: str, seed: int):
    if cache == "fp8":
        return make_fp8_step(SEQS, seed=seed, **SCALES), SCALES
    return make_step(SEQS, seed=seed), {}


def _cached_rows(step) -> torch.Tensor:
    """``[2, T, Hkv, D]``: each new token's key and value as the cache stores them (FP8
    values unscaled), float32."""
    slots = step.metadata.slot_mapping
    page = step.kv_cache.shape[2]
    return torch.stack([c[slots // page, slots % page].float()
                        for c in paged_kv_views(step.kv_cache)])


def _prefill(step, scales, new_kv=None, **kwargs) -> torch.Tensor:
    """Prefill attention of the whole step (decodes too) into a new tensor."""
    md = step.metadata
    out = torch.zeros_like(step.query)
    paged_prefill_attention(step.query, *paged_kv_views(step.kv_cache), *batch_args(step), out,
                            num_tokens=md.num_actual_tokens, max_query_len=md.max_query_len,
                            scale=0.25, new_kv=new_kv, **scales, **kwargs)
    return out


def _rows_for(step, rows: int | None = None) -> torch.Tensor:
    return torch.full((2, rows or step.key.shape[0], *step.key.shape[1:]), float("nan"),
                      device=step.key.device,
                      dtype=products_dtype(step.query.dtype, step.kv_cache.dtype))


def _plan(step):
    md = step.metadata
    return plan_context_rows(md.query_start_loc_cpu, md.seq_lens_cpu, md.num_actual_tokens,
                             step.query.device)


@pytest.mark.parametrize("tiles", [(16, 16), (64, 32)], ids=["16x16", "64x32"])
@pytest.mark.parametrize("cache", ["fp8", "fp32"])
def test_new_keys_read_from_rows_give_the_attention_of_the_pages(cache, tiles) -> None:
    step, scales = _step(cache, seed=11)
    md = step.metadata
    rows = _rows_for(step)
    write_kv_cache(step.key, step.value, *paged_kv_views(step.kv_cache), md.slot_mapping,
                   **scales, fresh=rows)
    assert torch.equal(rows.float(), _cached_rows(step))
    block_m, block_n = tiles
    from_pages = _prefill(step, scales, block_m=block_m, block_n=block_n)
    want, _ = reference_attention(step, 0.25, None, **scales)
    torch.testing.assert_close(from_pages, want, **TOLERANCE[torch.float32])
    # The new tokens' slots overwritten: only a launch that reads them from the rows keeps
    # its output.
    slots, page = md.slot_mapping, step.kv_cache.shape[2]
    for view in paged_kv_views(step.kv_cache):
        view[slots // page, slots % page] = 0
    assert not torch.allclose(_prefill(step, scales, block_m=block_m, block_n=block_n), want)
    from_rows = _prefill(step, scales, rows, block_m=block_m, block_n=block_n)
    torch.testing.assert_close(from_rows, from_pages, rtol=1e-5, atol=1e-5)


def test_rotated_keys_kept_in_rows_are_the_cached_fp8_values() -> None:
    step = make_fp8_step(SEQS, seed=12, **SCALES)
    md = step.metadata
    turns = torch.randint(0, 4, (step.query.shape[0], step.query.shape[2] // 2),
                          generator=torch.Generator().manual_seed(3))
    cos = torch.tensor([1.0, 0.0, -1.0, 0.0])[turns].to(step.query.device)
    sin = torch.tensor([0.0, 1.0, 0.0, -1.0])[turns].to(step.query.device)
    rows = _rows_for(step)
    rotate_and_write_kv(step.query, step.key, step.value, cos, sin, *paged_kv_views(step.kv_cache),
                        md.slot_mapping, md.num_actual_tokens, **SCALES, fresh=rows)
    assert step.kv_cache.dtype == FP8_DTYPE
    assert torch.equal(rows.float(), _cached_rows(step))


@pytest.mark.parametrize("setting, cache, used", [
    ("fp8", "fp8", True), ("fp8", "fp32", False), ("all", "fp32", True), ("off", "fp8", False),
])
def test_the_backend_reads_new_keys_from_rows_where_the_setting_says(setting, cache, used,
                                                                     monkeypatch) -> None:
    monkeypatch.setattr(triton_prefill, "PREFILL_NEW_KV", setting)
    seen = []
    launch = triton_backend.paged_prefill_attention
    monkeypatch.setattr(triton_backend, "paged_prefill_attention",
                        lambda *a, **kw: seen.append(kw["new_kv"] is not None) or launch(*a, **kw))
    step, scales = _step(cache, seed=13)
    want, want_cache = reference_attention(step, 0.25, None, **scales)
    got = TritonAttentionBackend().forward(step.query, step.key, step.value, step.kv_cache,
                                           step.metadata, 0.25, None, **scales)
    assert seen == [used]
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    # A sliding window reads every key from the pages.
    step, scales = _step(cache, seed=14)
    TritonAttentionBackend().forward(step.query, step.key, step.value, step.kv_cache,
                                     step.metadata, 0.25, 6, **scales)
    assert seen == [used, False]


def test_rows_of_the_wrong_dtype_or_beside_a_window_are_refused() -> None:
    step, scales = _step("fp8", seed=15)
    rows = _rows_for(step)
    with pytest.raises(ValueError, match="sliding window"):
        _prefill(step, scales, rows, sliding_window=4)
    with pytest.raises(ValueError, match="new_kv must be"):
        _prefill(step, scales, rows.to(torch.float16))
    with pytest.raises(ValueError, match="fresh must be"):
        write_kv_cache(step.key, step.value, *paged_kv_views(step.kv_cache),
                       step.metadata.slot_mapping, **scales, fresh=rows[:, :3])


@pytest.mark.parametrize("tiles", [(16, 16), (64, 32)], ids=["16x16", "64x32"])
@pytest.mark.parametrize("cache", ["fp8", "fp32"])
def test_contexts_widened_into_rows_give_the_attention_of_the_pages(cache, tiles,
                                                                    monkeypatch) -> None:
    monkeypatch.setattr(triton_prefill, "CONTEXT_ROWS_MIN_QUERY", 8)
    step, scales = _step(cache, seed=16)
    md = step.metadata
    plan = _plan(step)
    # Chunks of 8+ new tokens over a context are widened, in batch order, after the rows
    # of the step's tokens; (8, 3) is too short and reads its pages.
    assert plan.starts.tolist() == [-1, 88, -1, 107, 112, -1, -1]
    assert plan.rows_needed == md.num_actual_tokens + 19 + 5 + 16 == 128
    rows = _rows_for(step, plan.rows_needed)
    write_kv_cache(step.key, step.value, *paged_kv_views(step.kv_cache), md.slot_mapping,
                   **scales, fresh=rows)
    block_m, block_n = tiles
    want = _prefill(step, scales, block_m=block_m, block_n=block_n)
    widen_context_rows(*paged_kv_views(step.kv_cache), md.block_tables, plan, rows)
    # The widened sequences' pages overwritten: their context must come from the rows.
    page = step.kv_cache.shape[2]
    for b in (1, 3, 4):
        table, context = md.block_tables[b], SEQS[b][0]
        for pos in range(context):
            step.kv_cache[:, table[pos // page], pos % page] = 0
    got = _prefill(step, scales, rows, block_m=block_m, block_n=block_n,
                   context_rows=plan.starts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_widened_contexts_stop_at_their_token_cap(monkeypatch) -> None:
    monkeypatch.setattr(triton_prefill, "CONTEXT_ROWS_MIN_QUERY", 8)
    monkeypatch.setattr(triton_prefill, "CONTEXT_ROWS_MAX_TOKENS", 24)
    step, _ = _step("fp8", seed=17)
    plan = _plan(step)
    assert plan.starts.tolist() == [-1, 88, -1, 107, -1, -1, -1]  # 19 + 5 fit, 16 more do not
    assert plan.seqs.tolist() == [1, 3]
    assert (plan.lens.tolist(), plan.firsts.tolist()) == ([19, 5], [88, 107])
    monkeypatch.setattr(triton_prefill, "CONTEXT_ROWS_MIN_QUERY", 64)
    assert _plan(step) is None


@pytest.mark.parametrize("new_kv, switch, cache, widens", [
    ("fp8", True, "fp8", True), ("fp8", True, "fp32", False), ("all", True, "fp32", True),
    ("fp8", False, "fp8", False),
])
def test_the_backend_widens_long_chunks_contexts_where_it_keeps_rows(new_kv, switch, cache,
                                                                      widens, monkeypatch) -> None:
    monkeypatch.setattr(triton_prefill, "PREFILL_NEW_KV", new_kv)
    monkeypatch.setattr(triton_prefill, "PREFILL_CONTEXT_ROWS", switch)
    monkeypatch.setattr(triton_prefill, "CONTEXT_ROWS_MIN_QUERY", 8)
    widened = []
    widen = triton_backend.widen_context_rows
    monkeypatch.setattr(triton_backend, "widen_context_rows",
                        lambda *a: widened.append(a[3].seqs.tolist()) or widen(*a))
    step, scales = _step(cache, seed=18)
    want, want_cache = reference_attention(step, 0.25, None, **scales)
    got = TritonAttentionBackend().forward(step.query, step.key, step.value, step.kv_cache,
                                           step.metadata, 0.25, None, **scales)
    assert widened == ([[1, 3, 4]] if widens else [])
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_an_engine_over_an_fp8_cache_decodes_the_same_tokens_with_rows_or_pages(
        tmp_path, monkeypatch) -> None:
    """A tiny Llama on the Triton backend with an FP8 cache, chunked prompts (12-token
    steps) and prefix hits: greedy tokens with new-key rows and widened contexts equal those
    read from the pages alone."""
    from pagedllm.layers.attention import selector
    from tests.kernels.engine_runs import chunked_prefix_greedy_tokens, tiny_llama

    path = tiny_llama(tmp_path)
    monkeypatch.setenv(selector.BACKEND_ENV, "triton")
    monkeypatch.setattr(triton_prefill, "CONTEXT_ROWS_MIN_QUERY", 4)
    widened = []
    widen = triton_backend.widen_context_rows
    monkeypatch.setattr(triton_backend, "widen_context_rows",
                        lambda *a: widened.append(a[3].seqs.shape[0]) or widen(*a))
    runs = {}
    for setting, context_rows in (("off", False), ("fp8", True)):
        monkeypatch.setattr(triton_prefill, "PREFILL_NEW_KV", setting)
        monkeypatch.setattr(triton_prefill, "PREFILL_CONTEXT_ROWS", context_rows)
        runs[setting] = chunked_prefix_greedy_tokens(path, kv_cache_dtype="fp8")
    assert widened and runs["fp8"] == runs["off"]


def test_widening_contexts_without_new_key_rows_is_refused_at_start() -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, PAGEDLLM_PREFILL_CONTEXT_ROWS="1", PAGEDLLM_PREFILL_NEW_KV="off")
    done = subprocess.run([sys.executable, "-c", "import pagedllm.layers.attention.triton_prefill"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "PAGEDLLM_PREFILL_NEW_KV=off" in done.stderr
