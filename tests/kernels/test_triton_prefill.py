"""The Triton varlen prefill kernel against the torch reference backend."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.attention.triton_kv_write import write_kv_cache
from pagedllm.layers.attention.triton_prefill import paged_prefill_attention
from tests.kernels.paged_batch import HALF_DTYPES, TOLERANCE, batch_args, make_step, reference_attention

# (cached tokens, new tokens): fresh prompts of odd lengths, chunks on top of cached
# context that start on a block boundary or just before a key-tile boundary, a decode
# beside them, and a prompt spanning several query tiles.
SEQS = ((0, 13), (8, 8), (5, 3), (0, 1), (14, 5), (0, 37))


def _run(step, window=None, *, scale=0.25, skip_decodes=False, block_m=None, block_n=None):
    md = step.metadata
    write_kv_cache(step.key, step.value, step.kv_cache[0], step.kv_cache[1], md.slot_mapping)
    out = torch.zeros_like(step.query)
    paged_prefill_attention(
        step.query, step.kv_cache[0], step.kv_cache[1], *batch_args(step), out,
        num_tokens=md.num_actual_tokens,
        max_query_len=md.max_query_len,
        scale=scale,
        sliding_window=window,
        skip_decodes=skip_decodes,
        block_m=block_m,
        block_n=block_n,
    )
    return out


@pytest.mark.parametrize(
    "num_heads, num_kv_heads",
    [(4, 2), (4, 1), (6, 2), (2, 2)],
    ids=["gqa", "mqa", "gqa-group-of-3", "mha"],
)
def test_prefill_matches_reference_for_grouped_query_heads(num_heads, num_kv_heads) -> None:
    step = make_step(SEQS, num_heads=num_heads, num_kv_heads=num_kv_heads)
    expected, _ = reference_attention(step, 0.25, None)
    torch.testing.assert_close(_run(step), expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 16), (64, 32)])
@pytest.mark.parametrize("window", [1, 4, 9, 20])
def test_prefill_respects_sliding_window(window, block_m, block_n) -> None:
    """Windows shorter and longer than a key tile, with tiles of 8 to 32 queries."""
    step = make_step(SEQS, seed=1)
    expected, _ = reference_attention(step, 0.25, window)
    out = _run(step, window, block_m=block_m, block_n=block_n)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    "block_size, block_m, block_n",
    [(4, 16, 16), (8, 32, 16), (32, 16, 16), (1, 16, 32)],
    ids=["tile-spans-4-blocks", "tile-spans-2-blocks", "block-spans-2-tiles", "block-of-one"],
)
def test_prefill_is_exact_across_block_and_tile_boundaries(block_size, block_m, block_n) -> None:
    step = make_step(SEQS, block_size=block_size, seed=2)
    expected, _ = reference_attention(step, 0.25, None)
    out = _run(step, block_m=block_m, block_n=block_n)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_head_dim_that_is_not_a_power_of_two() -> None:
    step = make_step(((3, 9), (0, 5)), head_dim=24, seed=4)
    expected, _ = reference_attention(step, 0.2, None)
    torch.testing.assert_close(_run(step, scale=0.2), expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_prefill_matches_fp32_reference(dtype) -> None:
    step = make_step(((0, 13), (8, 8), (4, 1)), seed=5, dtype=dtype)
    expected, _ = reference_attention(step, 0.25, None)
    out = _run(step)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


def test_chunked_prefill_over_cached_context_equals_one_shot_prefill() -> None:
    """A 23-token prompt prefilled as chunks of 9, 9 and 5, each step reading the earlier
    chunks from the cache, gives the same attention output as one whole-prompt step."""
    whole = make_step(((0, 23),), seed=6)
    expected = _run(whole)
    cache = whole.kv_cache.clone()
    cache[:] = float("nan")
    md = whole.metadata
    table = md.block_tables
    outs = []
    for start, end in ((0, 9), (9, 18), (18, 23)):
        chunk = type(whole)(
            cache,
            type(md)(
                num_actual_tokens=end - start,
                slot_mapping=md.slot_mapping[start:end],
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=table.device),
                seq_lens=torch.tensor([end], dtype=torch.int32, device=table.device),
                block_tables=table,
                max_query_len=end - start,
                max_seq_len=end,
                block_size=md.block_size,
                query_start_loc_cpu=[0, end - start],
                seq_lens_cpu=[end],
            ),
            whole.query[start:end], whole.key[start:end], whole.value[start:end],
            whole.spare_block,
        )
        outs.append(_run(chunk))
    torch.testing.assert_close(torch.cat(outs), expected, **TOLERANCE[torch.float32])


def test_skip_decodes_leaves_query_length_one_rows_to_the_decode_kernel() -> None:
    step = make_step(((4, 5), (9, 1), (0, 3), (2, 1)), seed=7)
    out = _run(step, skip_decodes=True)
    expected, _ = reference_attention(step, 0.25, None)
    decode_rows = torch.tensor([5, 9], device=out.device)
    prefill_rows = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8], device=out.device)
    assert torch.count_nonzero(out[decode_rows]) == 0
    torch.testing.assert_close(out[prefill_rows], expected[prefill_rows], **TOLERANCE[torch.float32])



def test_sequences_marked_with_no_length_are_left_to_whoever_took_them() -> None:
    """A prompt whose ``seq_lens`` entry is 0 (taken by ``dense_prefill``) keeps its rows of
    ``out`` untouched, beside a skipped decode; the other prompts match the reference."""
    step = make_step(((4, 5), (9, 1), (0, 3), (2, 6)), seed=8)
    md = step.metadata
    write_kv_cache(step.key, step.value, step.kv_cache[0], step.kv_cache[1], md.slot_mapping)
    out = torch.zeros_like(step.query)
    marked = md.seq_lens.clone()
    marked[2] = 0
    paged_prefill_attention(
        step.query, step.kv_cache[0], step.kv_cache[1], md.block_tables, marked,
        md.query_start_loc, out, num_tokens=md.num_actual_tokens,
        max_query_len=md.max_query_len, scale=0.25, skip_decodes=True)
    expected, _ = reference_attention(step, 0.25, None)
    computed = torch.tensor([0, 1, 2, 3, 4, 9, 10, 11, 12, 13, 14], device=out.device)
    assert torch.count_nonzero(out[5:9]) == 0  # the decode, the marked prompt
    torch.testing.assert_close(out[computed], expected[computed], **TOLERANCE[torch.float32])
