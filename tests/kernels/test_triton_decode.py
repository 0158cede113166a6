"""The Triton decode kernel (single pass and split-K) against the torch reference backend."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from pagedllm.layers.attention import layer as attention_layer
from pagedllm.layers.attention import triton_decode
from pagedllm.layers.attention.backend import set_forward_context
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.attention.torch_ref import TorchReferenceBackend
from pagedllm.layers.attention.triton_decode import (
    MAX_SPLITS,
    MIN_PARTITION_TOKENS,
    NewKV,
    paged_decode_attention,
    plan_decode_splits,
)
from pagedllm.layers.attention.triton_kv_write import write_kv_cache
from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.quantization.fp8 import Fp8Sums
from tests.kernels.launch_keys import LaunchKeys
from tests.kernels.paged_batch import (
    DEVICE,
    HALF_DTYPES,
    TOLERANCE,
    batch_args,
    make_fp8_step,
    make_step,
    reference_attention,
)

# Decodes at contexts on both sides of block boundaries (block size 4), a first token,
# and a long one that spans many partitions.
DECODES = ((0, 1), (3, 1), (4, 1), (7, 1), (15, 1), (70, 1))


def _run(step, window=None, *, num_splits=None, block_n=None, scale=0.25, max_seq_len=None,
         order=None):
    md = step.metadata
    write_kv_cache(step.key, step.value, step.kv_cache[0], step.kv_cache[1], md.slot_mapping)
    out = torch.zeros_like(step.query)
    paged_decode_attention(
        step.query, step.kv_cache[0], step.kv_cache[1], *batch_args(step), out,
        max_seq_len=md.max_seq_len if max_seq_len is None else max_seq_len,
        scale=scale,
        sliding_window=window,
        num_splits=num_splits,
        block_n=block_n,
        order=order,
    )
    return out


@pytest.mark.parametrize("num_splits", [1, 3, 5], ids=["one-pass", "split-3", "split-5"])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads", [(4, 2), (8, 1), (6, 2)], ids=["gqa", "mqa", "gqa-group-of-3"]
)
def test_decode_matches_reference(num_heads, num_kv_heads, num_splits) -> None:
    step = make_step(DECODES, num_heads=num_heads, num_kv_heads=num_kv_heads)
    expected, _ = reference_attention(step, 0.25, None)
    out = _run(step, num_splits=num_splits)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_in_any_start_order_matches_reference(num_splits) -> None:
    """The launch order of the sequences (longest first, or any permutation) changes
    nothing but the schedule."""
    step = make_step(DECODES + ((33, 1), (2, 1)), seed=4)
    expected, _ = reference_attention(step, 0.25, None)
    order = triton_decode.longest_first(step.metadata.seq_lens)
    assert order.tolist() == sorted(range(8), key=lambda b: -step.metadata.seq_lens_cpu[b])
    torch.testing.assert_close(_run(step, num_splits=num_splits, order=order), expected,
                               **TOLERANCE[torch.float32])
    shuffled = torch.tensor([3, 0, 7, 5, 1, 6, 2, 4], dtype=torch.int32, device=order.device)
    torch.testing.assert_close(_run(step, num_splits=num_splits, order=shuffled), expected,
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [1, 5, 40])
def test_decode_respects_sliding_window(window, num_splits) -> None:
    """With splits, partitions wholly before the window are empty and must drop out."""
    step = make_step(DECODES, seed=1)
    expected, _ = reference_attention(step, 0.25, window)
    out = _run(step, window, num_splits=num_splits)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("window", [None, 100])
def test_merge_of_many_partitions_in_chunks_and_counters_reset(window) -> None:
    """64 partitions of head_dim 128 merge 16 at a time (the chunks' maxima differ), and
    the arrival counters are zero again after each launch: a second launch is exact too."""
    step = make_step(((300, 1), (5, 1)), num_heads=8, num_kv_heads=2, head_dim=128, seed=6)
    expected, _ = reference_attention(step, 0.25, window)
    for _ in range(2):
        out = _run(step, window, num_splits=MAX_SPLITS, block_n=16)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert not triton_decode.arrival_counters(step.query.device, 4).any()


@pytest.mark.parametrize("window", [None, 40])
def test_one_partition_is_written_directly_beside_merged_ones(window) -> None:
    """64 splits of 16-token tiles: 10 keys fill one partition, whose program writes the
    output without a merge; 100 and 300 keys merge 7 and 19 partitions (under the window,
    4 and 3); the counters are zero after each launch."""
    step = make_step(((9, 1), (99, 1), (299, 1)), block_size=16, seed=11)
    expected, _ = reference_attention(step, 0.25, window)
    for _ in range(2):
        out = _run(step, window, num_splits=64, block_n=16, max_seq_len=4096)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert not triton_decode.arrival_counters(step.query.device, 6).any()


def test_more_partitions_than_a_short_sequence_fills() -> None:
    """Short sequences beside a long one leave most of their partitions empty."""
    step = make_step(((1, 1), (2, 1), (90, 1)), block_size=8, seed=2)
    expected, _ = reference_attention(step, 0.25, None)
    out = _run(step, num_splits=6, block_n=16)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_is_exact_for_any_block_size(block_size) -> None:
    step = make_step(DECODES, block_size=block_size, seed=3)
    expected, _ = reference_attention(step, 0.25, None)
    torch.testing.assert_close(_run(step, num_splits=2), expected, **TOLERANCE[torch.float32])


def test_head_dim_that_is_not_a_power_of_two() -> None:
    step = make_step(DECODES, head_dim=40, seed=4)
    expected, _ = reference_attention(step, 0.15, None)
    out = _run(step, num_splits=2, scale=0.15)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_decode_matches_fp32_reference(dtype) -> None:
    step = make_step(DECODES, seed=5, dtype=dtype)
    expected, _ = reference_attention(step, 0.25, None)
    for num_splits in (1, 3):
        out = _run(step, num_splits=num_splits)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


# Contexts of 1, 17, 33 and 100 tokens (block size 16): the first and a second tile, a
# page boundary, and several tiles.
SHORT_DECODES = ((0, 1), (16, 1), (32, 1), (99, 1))


@pytest.mark.parametrize("num_splits", [8, 64, None], ids=["split-8", "split-64", "planned"])
def test_partitions_follow_each_length_under_a_loose_max_seq_len(num_splits, monkeypatch) -> None:
    """As in a CUDA graph captured for a long ``max_model_len``: the bound (4096) is far
    above every context, so most partitions of every sequence are empty."""
    monkeypatch.setattr(triton_decode, "_multiprocessor_count", lambda device: 132)  # an H200
    step = make_step(SHORT_DECODES, num_heads=8, num_kv_heads=2, block_size=16, seed=7)
    expected, _ = reference_attention(step, 0.25, None)
    out = _run(step, num_splits=num_splits, max_seq_len=4096)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_a_short_and_a_long_context_share_the_splits() -> None:
    """Each sequence cuts its own context into the splits: 700 tokens in four partitions of
    176, 5 tokens in one tile of the first partition."""
    step = make_step(((4, 1), (699, 1)), num_heads=4, num_kv_heads=2, block_size=16, seed=8)
    expected, _ = reference_attention(step, 0.25, None)
    out = _run(step, num_splits=4, block_n=16)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("window", [3, 100, 300])
def test_sliding_window_with_partitions_sized_per_sequence(window) -> None:
    """The window (from ``seq_len - window``) empties the 700-token context's first
    partitions and clips the one it starts in; a loose ``max_seq_len`` changes nothing."""
    step = make_step(((4, 1), (699, 1)), block_size=16, seed=9)
    expected, _ = reference_attention(step, 0.25, window)
    out = _run(step, window, num_splits=4, block_n=16, max_seq_len=4096)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("num_splits", [1, 3, 64], ids=["one-pass", "split-3", "split-64"])
def test_decode_ropes_and_caches_the_new_tokens_itself(num_splits, window, dtype) -> None:
    """With ``new_kv`` the launch takes unrotated queries and keys: it must give what the
    torch rope, the cache write and the attention give, output and cache alike. Contexts
    end inside every partition (64 splits of 16-token tiles over up to 71 tokens), and the
    last rows are padding past ``num_actual_tokens``: rotated nowhere, cached nowhere."""
    step = make_step(DECODES + ((9, 1),), seed=10, dtype=dtype)
    md = step.metadata
    n = md.num_actual_tokens - 1  # the last sequence's row is padding
    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    cos, sin = rope(md.seq_lens.long() - 1, dtype)

    fp32 = step.to(torch.float32)
    want_cache = fp32.kv_cache.clone()
    query, key = (RotaryEmbedding.apply(x, cos.float(), sin.float()) for x in (fp32.query, fp32.key))
    want = TorchReferenceBackend().forward(query, key, fp32.value, want_cache, md, 0.25, window)
    last_slot, block_size = int(md.slot_mapping[n]), step.kv_cache.shape[2]
    want_cache[:, last_slot // block_size, last_slot % block_size] = float("nan")

    out = torch.zeros_like(step.query)
    paged_decode_attention(
        step.query, step.kv_cache[0], step.kv_cache[1], *batch_args(step), out,
        max_seq_len=md.max_seq_len, scale=0.25, sliding_window=window, num_splits=num_splits,
        block_n=16, new_kv=NewKV(step.key, step.value, md.slot_mapping, cos, sin, n),
    )
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out[:n].float(), want[:n], **tolerance)
    torch.testing.assert_close(step.kv_cache.float().nan_to_num(7.0), want_cache.nan_to_num(7.0),
                               **tolerance)


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_a_decode_step_takes_the_qkv_products_sums_and_scales_them_itself(fp8_cache,
                                                                         monkeypatch) -> None:
    """``PAGEDLLM_QKV_SUMS``: a decode step's q, k and v come as an FP8 product's sums with
    their row and column scales, and the decode launch scales them as it reads them. Its
    output and cache must be those of the scaled values, bit for bit (the same roundings:
    ``Fp8Sums.scaled``), over a bf16 or an FP8 cache. A step with prompts, or the switch
    off, takes no sums, and sums given there are refused."""
    monkeypatch.setattr(attention_layer, "QKV_SUMS", True)
    make = functools.partial(make_fp8_step, k_scale=0.5, v_scale=0.25) if fp8_cache else make_step
    step = make(DECODES, num_heads=4, num_kv_heads=2, seed=11, dtype=torch.bfloat16)
    md = step.metadata
    tokens, heads, kv_heads, dim = step.query.shape[0], 4, 2, 16
    width = (heads + 2 * kv_heads) * dim
    # Integer sums and scales of distinct powers of two: a scale taken from another row or
    # column shows, and the products need no rounding (Triton's interpreter rounds float32
    # to bf16 by truncation, torch to nearest).
    gen = torch.Generator().manual_seed(12)
    sums = torch.randint(-64, 65, (tokens, width), generator=gen).to(torch.bfloat16).to(DEVICE)
    row = (2.0 ** -(torch.arange(tokens) % 5 + 3)).reshape(-1, 1).to(DEVICE)
    col = (2.0 ** -(torch.randperm(width, generator=gen) % 7 + 1)).reshape(-1, 1).to(DEVICE)
    scaled = Fp8Sums(sums, row, col).scaled()
    rope = RotaryEmbedding(dim, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    rotary = rope(md.seq_lens.long() - 1, torch.bfloat16)
    attn = Attention(heads, dim, kv_heads, scale=0.25, layer_idx=0)
    attn.backend = TritonAttentionBackend()
    attn.k_scale, attn.v_scale = (0.5, 0.25) if fp8_cache else (1.0, 1.0)

    def attend(qkv: torch.Tensor, cache: torch.Tensor, **kwargs) -> torch.Tensor:
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
        with set_forward_context(md, [cache]):
            return attn(q, k, v, rotary=rotary, **kwargs)

    want_cache, got_cache = step.kv_cache.clone(), step.kv_cache.clone()
    want = attend(scaled, want_cache)
    with set_forward_context(md, [got_cache]):
        assert attn.takes_sums() and not attn.takes_sums(outputs=object())
    got = attend(sums, got_cache, sums_scales=(row, col))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))

    prompts = make_step(((3, 4), (9, 1)), seed=13).metadata
    with set_forward_context(prompts, [got_cache]):
        assert not attn.takes_sums()
    monkeypatch.setattr(attention_layer, "QKV_SUMS", False)
    with set_forward_context(md, [got_cache]):
        assert not attn.takes_sums()
    with pytest.raises(ValueError, match="takes_sums"):
        attend(sums, got_cache, sums_scales=(row, col))


def test_sequences_with_longer_queries_are_left_to_the_prefill_kernel() -> None:
    step = make_step(((5, 1), (3, 4), (9, 1)), seed=6)
    expected, _ = reference_attention(step, 0.25, None)
    out = _run(step, num_splits=2)
    assert torch.count_nonzero(out[1:5]) == 0
    torch.testing.assert_close(out[[0, 5]], expected[[0, 5]], **TOLERANCE[torch.float32])


def test_a_large_batch_is_not_split() -> None:
    assert plan_decode_splits(256, 8, 1024, num_sms=132) == 1


def test_one_long_sequence_is_split_into_partitions_of_the_minimum_length_or_more() -> None:
    num_splits = plan_decode_splits(1, 8, 8000, num_sms=132)
    assert 16 <= num_splits <= MAX_SPLITS
    assert num_splits <= -(-8000 // MIN_PARTITION_TOKENS)


def test_short_contexts_are_not_split_below_the_minimum_partition() -> None:
    assert plan_decode_splits(1, 1, 200, num_sms=132) == 1


def test_a_graph_bound_plans_one_wave_of_programs() -> None:
    """A graph's ``max_seq_len = max_model_len`` plans for the longest context: the most
    splits whose programs fit one wave of ``DECODE_PROGRAMS_PER_SM`` per multiprocessor
    (at most ``MAX_SPLITS``); the kernel then sizes each sequence's partitions from its
    own length."""
    from pagedllm.layers.attention.triton_decode import DECODE_PROGRAMS_PER_SM

    slots = DECODE_PROGRAMS_PER_SM * 132
    for num_seqs in (1, 2, 3, 4, 8, 16):
        splits = plan_decode_splits(num_seqs, 8, 131072, num_sms=132)
        assert 8 * num_seqs * splits <= slots < 8 * num_seqs * (splits + 1) or splits == MAX_SPLITS
    assert plan_decode_splits(1, 1, 131072, num_sms=132) == MAX_SPLITS
    assert plan_decode_splits(0, 8, 0, num_sms=132) == 1


def test_num_splits_out_of_range_is_rejected() -> None:
    step = make_step(((3, 1),))
    with pytest.raises(ValueError, match="num_splits"):
        _run(step, num_splits=MAX_SPLITS + 1)


def test_decode_tiles_can_be_overridden_from_the_environment(monkeypatch) -> None:
    from pagedllm.layers.attention import triton_decode

    cuda = torch.device("cuda")
    monkeypatch.setenv(triton_decode.DECODE_TILE_ENV, "32,2,3")
    monkeypatch.setenv(triton_decode.DECODE_SPLIT_TILE_ENV, "")
    triton_decode._tile_override.cache_clear()
    try:
        assert triton_decode.decode_tile_config(128, cuda, split=False) == (32, 2, 3)
        assert triton_decode.decode_tile_config(128, cuda, split=True) == (128, 4, 2)
        fp8_split = triton_decode.decode_tile_config(128, cuda, split=True, fp8_cache=True)
        assert fp8_split == (128, 4, 2)
        monkeypatch.setenv(triton_decode.DECODE_TILE_ENV, "48,2,2")
        triton_decode._tile_override.cache_clear()
        with pytest.raises(ValueError, match="PAGEDLLM_DECODE_TILE='48,2,2'"):
            triton_decode.decode_tile_config(128, cuda, split=False)
    finally:
        triton_decode._tile_override.cache_clear()


def test_an_fp8_cache_takes_the_short_tile_only_where_every_context_is_short(monkeypatch) -> None:
    """A one-pass launch over an FP8 cache whose bound is within ``SHORT_DECODE_CONTEXT``
    takes the 64-key tile, an unbounded or longer one the 128-key tile; so decode graphs
    of an FP8 cache are captured a second time under that bound, those of a bf16 cache
    (one tile at any context) are not."""
    for name in (triton_decode.DECODE_TILE_ENV, triton_decode.DECODE_SPLIT_TILE_ENV):
        monkeypatch.delenv(name, raising=False)
    triton_decode._tile_override.cache_clear()
    monkeypatch.setattr(triton_decode, "_h100", lambda device: False)
    cuda, short = torch.device("cuda"), triton_decode.SHORT_DECODE_CONTEXT
    tile = functools.partial(triton_decode.decode_tile_config, 128, cuda)
    assert tile(False, fp8_cache=True, max_seq_len=short)[0] == 64
    assert tile(False, fp8_cache=True, max_seq_len=short + 1)[0] == 128
    assert tile(False, fp8_cache=True)[0] == 128
    assert tile(True, fp8_cache=True, max_seq_len=short)[0] == 128  # split partitions
    assert triton_decode.short_decode_context(128, cuda, fp8_cache=True) == short
    assert triton_decode.short_decode_context(128, cuda, fp8_cache=False) is None
    assert triton_decode.short_decode_context(128, torch.device("cpu"), fp8_cache=True) is None
    # An H100 reads an FP8 cache fastest in the 64-key tile whatever the contexts: one
    # tile, so no second capture of the decode graphs.
    monkeypatch.setattr(triton_decode, "_h100", lambda device: True)
    assert tile(False, fp8_cache=True) == tile(False, fp8_cache=True, max_seq_len=short)
    assert tile(False, fp8_cache=True) == (64, 2, 2)
    assert tile(True, fp8_cache=True)[0] == 128 and tile(False)[0] == 64
    assert triton_decode.short_decode_context(128, cuda, fp8_cache=True) is None


@pytest.mark.parametrize("num_seqs", [1, 5, 64, 200])
def test_longest_first_is_a_stable_descending_sort(num_seqs) -> None:
    """Many equal lengths (ties keep index order) across several programs of the kernel."""
    lengths = torch.randint(1, 20, (num_seqs,), generator=torch.Generator().manual_seed(num_seqs))
    order = triton_decode.longest_first(lengths.to(torch.int32).to(DEVICE))
    want = sorted(range(num_seqs), key=lambda b: (-int(lengths[b]), b))
    assert order.dtype == torch.int32 and order.tolist() == want


def test_split_count_and_batch_size_compile_no_new_variant(monkeypatch) -> None:
    """A step's split count and batch size change the grid only: one compiled variant
    serves every split count >= 2, another the one-pass launch. A variant per count would
    compile mid-run, stalling a server's step for about a second."""
    keys = LaunchKeys(monkeypatch, triton_decode, "_decode_kernel")
    one_pass, split = set(), set()
    for decodes in (DECODES, DECODES[:2], ((70, 1),) * 3):
        step = make_step(decodes, num_heads=8, num_kv_heads=2, head_dim=128, seed=7)
        tables = step.metadata.block_tables  # padded to 16 blocks, as a real step's
        step.metadata = dataclasses.replace(step.metadata, block_tables=torch.nn.functional.pad(
            tables, (0, -tables.shape[1] % 16)))
        for num_splits in (1, 2, 3, 16, 17, 64):  # powers of two and not, low and high
            _run(step, num_splits=num_splits, block_n=16, max_seq_len=4096)
            (one_pass if num_splits == 1 else split).add(keys.keys.pop())
    assert len(one_pass) == 1 and len(split) == 1 and one_pass != split


def test_caches_of_different_strides_are_refused() -> None:
    """The kernels address a key and its value from one block offset: the two caches must
    be the halves of one tensor, laid out alike or with slot-major values."""
    step = make_step(((3, 1),))
    key_cache = step.kv_cache[0]
    value_cache = step.kv_cache[1].transpose(0, 1).contiguous().transpose(0, 1)
    assert value_cache.shape == key_cache.shape and value_cache.stride() != key_cache.stride()
    with pytest.raises(ValueError, match="share their block stride"):
        paged_decode_attention(step.query, key_cache, value_cache, *batch_args(step),
                               torch.zeros_like(step.query), max_seq_len=4, scale=0.25)


def test_a_register_cap_reaches_only_cuda_launches(monkeypatch) -> None:
    """``PAGEDLLM_DECODE_MAX_REGISTERS`` compiles CUDA launches with ptxas' ``maxnreg``;
    unset, the compiler chooses, and the interpreter never takes the option."""
    assert triton_decode._register_cap(torch.device("cuda")) == {}
    monkeypatch.setattr(triton_decode, "MAX_REGISTERS", 96)
    assert triton_decode._register_cap(torch.device("cuda")) == {"maxnreg": 96}
    assert triton_decode._register_cap(torch.device("cpu")) == {}
