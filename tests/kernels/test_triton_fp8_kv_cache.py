"""The Triton kernels over an FP8 KV cache (``--kv-cache-dtype fp8``) against the torch
reference backend: the same bytes written, the same attention read back.

On the CPU (Triton's interpreter) keys and values lie on the FP8 grid of their scales
(``paged_batch.on_fp8_grid``) and rotary embeddings turn by quarter turns, so no value
needs rounding: the interpreter rounds float32 -> float8e4nv wrongly. On a GPU the last
test also checks rounding itself, on arbitrary values.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.attention.kv_quant import paged_kv_views
from pagedllm.layers.attention.triton_common import FP8_KV_WIDEN_ENV
from pagedllm.layers.attention.torch_ref import TorchReferenceBackend
from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
from pagedllm.layers.attention.triton_decode import NewKV, paged_decode_attention
from pagedllm.layers.attention.triton_kv_write import rotate_and_write_kv, write_kv_cache
from pagedllm.layers.attention.triton_prefill import paged_prefill_attention
from pagedllm.quantization.fp8 import FP8_DTYPE
from tests.kernels.paged_batch import (
    DEVICE, TOLERANCE, batch_args, make_fp8_step, make_step, reference_attention,
)

K_SCALE, V_SCALE = 0.5, 2.0  # powers of two: scaling moves no value off the grid
SCALES = dict(k_scale=K_SCALE, v_scale=V_SCALE)
MIXED = ((0, 11), (9, 4), (17, 1), (0, 1), (30, 1), (6, 7))
DECODES = ((0, 1), (3, 1), (4, 1), (7, 1), (15, 1), (70, 1))


def _same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _at_slots(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached keys and values at ``slots`` (``[n, Hkv, D]`` each), as float32."""
    page = kv_cache.shape[2]
    return tuple(c[slots // page, slots % page].float() for c in paged_kv_views(kv_cache))


def _quarter_turns(num_tokens: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """Rotary ``(cos, sin)`` of angles that are multiples of 90 degrees: exact rotations."""
    turns = torch.randint(0, 4, (num_tokens, head_dim // 2), generator=torch.Generator().manual_seed(seed))
    cos = torch.tensor([1.0, 0.0, -1.0, 0.0])[turns]
    sin = torch.tensor([0.0, 1.0, 0.0, -1.0])[turns]
    return cos.to(DEVICE, dtype), sin.to(DEVICE, dtype)


def test_write_stores_keys_and_values_divided_by_their_scales() -> None:
    step = make_fp8_step(MIXED, **SCALES)
    _, want_cache = reference_attention(step, 0.25, None, **SCALES)
    slots = step.metadata.slot_mapping
    write_kv_cache(step.key, step.value, *paged_kv_views(step.kv_cache), slots, **SCALES)
    assert step.kv_cache.dtype == FP8_DTYPE
    assert _same_bytes(step.kv_cache, want_cache)
    keys, values = _at_slots(step.kv_cache, slots)
    assert torch.equal(keys, step.key / K_SCALE)
    assert torch.equal(values, step.value / V_SCALE)


def test_values_past_the_fp8_range_are_stored_as_448() -> None:
    step = make_fp8_step(((0, 5),), **SCALES)
    key = torch.full_like(step.key, 1000.0 * K_SCALE)
    value = torch.full_like(step.value, -1e6)
    slots = step.metadata.slot_mapping
    write_kv_cache(key, value, *paged_kv_views(step.kv_cache), slots, **SCALES)
    keys, values = _at_slots(step.kv_cache, slots)
    assert (keys == 448.0).all()
    assert (values == -448.0).all()


def test_fp8_values_are_slot_major_and_other_caches_keep_slot_rows() -> None:
    """A value written at slot ``s`` of block ``b`` lies at byte ``[b, h, d, s]`` of an FP8
    cache's value half, and at ``[b, s, h, d]`` of a cache in the model's dtype."""
    step = make_fp8_step(((0, 6),), **SCALES)
    write_kv_cache(step.key, step.value, *paged_kv_views(step.kv_cache), step.metadata.slot_mapping,
                   **SCALES)
    page = step.kv_cache.shape[2]
    raw = step.kv_cache[1].reshape(-1, *step.kv_cache.shape[3:], page)  # [blocks, Hkv, D, page]
    for t, slot in enumerate(step.metadata.slot_mapping.tolist()):
        stored = raw[slot // page, :, :, slot % page].float() * V_SCALE
        assert torch.equal(stored, step.value[t])
    plain = make_step(((0, 6),))
    key_cache, value_cache = paged_kv_views(plain.kv_cache)
    assert value_cache.stride() == key_cache.stride() == plain.kv_cache[1].stride()


@pytest.mark.parametrize("backend", [TorchReferenceBackend, TritonAttentionBackend])
def test_nan_keys_and_values_are_stored_as_zero(backend) -> None:
    """An FP8 cache holds finite values only: value tiles read a page's slots past the last
    token, weighted zero, and a NaN there would poison the next owner of the page."""
    step = make_fp8_step(((0, 5),), **SCALES)
    key, value = step.key.clone(), step.value.clone()
    key[1, 0, 3] = value[2, 1, 0] = float("nan")
    if backend is TorchReferenceBackend:
        backend.write_kv(key, value, step.kv_cache, step.metadata.slot_mapping, **SCALES)
    else:
        write_kv_cache(key, value, *paged_kv_views(step.kv_cache), step.metadata.slot_mapping,
                       **SCALES)
    keys, values = _at_slots(step.kv_cache, step.metadata.slot_mapping)
    assert keys[1, 0, 3] == 0 and values[2, 1, 0] == 0
    assert keys.isfinite().all() and values.isfinite().all()
    assert torch.equal(keys.nan_to_num(0.0), key.nan_to_num(0.0) / K_SCALE)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-3"])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_over_an_fp8_cache_matches_the_reference(num_splits, window) -> None:
    step = make_fp8_step(DECODES, num_heads=8, num_kv_heads=2, seed=1, **SCALES)
    want, _ = reference_attention(step, 0.25, window, **SCALES)
    torch.testing.assert_close(_decode(step, num_splits, window), want,
                               **TOLERANCE[torch.float32])


def _decode(step, num_splits: int, window: int | None = None) -> torch.Tensor:
    """The step's new keys and values written to its FP8 cache, then decode attention."""
    md = step.metadata
    write_kv_cache(step.key, step.value, *paged_kv_views(step.kv_cache), md.slot_mapping, **SCALES)
    out = torch.zeros_like(step.query)
    paged_decode_attention(step.query, *paged_kv_views(step.kv_cache), *batch_args(step), out,
                           max_seq_len=md.max_seq_len, scale=0.25, sliding_window=window,
                           num_splits=num_splits, **SCALES)
    return out


@pytest.mark.parametrize("window", [None, 6])
def test_prefill_over_an_fp8_cache_matches_the_reference(window) -> None:
    step = make_fp8_step(MIXED, seed=2, **SCALES)
    want, _ = reference_attention(step, 0.25, window, **SCALES)
    md = step.metadata
    write_kv_cache(step.key, step.value, *paged_kv_views(step.kv_cache), md.slot_mapping, **SCALES)
    out = torch.zeros_like(step.query)
    paged_prefill_attention(step.query, *paged_kv_views(step.kv_cache), *batch_args(step), out,
                            num_tokens=md.num_actual_tokens, max_query_len=md.max_query_len,
                            scale=0.25, sliding_window=window, **SCALES)
    torch.testing.assert_close(out, want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("rotary", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decodes-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_backend_step_over_an_fp8_cache_matches_the_reference(dtype, seqs, rotary) -> None:
    """Every launch of a step (the write, or the rope fused into the write or into the
    decode kernel; prefill; decode) against the reference backend: output and cache bytes."""
    step = make_fp8_step(seqs, seed=3, dtype=dtype, **SCALES)
    rope = _quarter_turns(step.query.shape[0], step.query.shape[2], dtype) if rotary else None
    want_cache = step.kv_cache.clone()
    want = TorchReferenceBackend().forward(
        step.query.float(), step.key.float(), step.value.float(), want_cache, step.metadata, 0.25,
        None, rotary=None if rope is None else tuple(x.float() for x in rope), **SCALES)
    got = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, None, rotary=rope,
        **SCALES)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])
    assert _same_bytes(step.kv_cache, want_cache)


def test_rotate_and_write_and_the_decode_rope_store_the_same_fp8_bytes() -> None:
    step = make_fp8_step(DECODES, seed=4, **SCALES)
    md = step.metadata
    cos, sin = _quarter_turns(step.query.shape[0], step.query.shape[2], torch.float32, seed=5)
    fused_cache = step.kv_cache.clone()
    rotate_and_write_kv(step.query, step.key, step.value, cos, sin, *paged_kv_views(fused_cache),
                        md.slot_mapping, md.num_actual_tokens, **SCALES)
    out = torch.zeros_like(step.query)
    paged_decode_attention(
        step.query, *paged_kv_views(step.kv_cache), *batch_args(step), out,
        max_seq_len=md.max_seq_len, scale=0.25, num_splits=3, block_n=16,
        new_kv=NewKV(step.key, step.value, md.slot_mapping, cos, sin, md.num_actual_tokens),
        **SCALES)
    assert _same_bytes(step.kv_cache, fused_cache)


def test_scales_are_ignored_by_a_cache_in_the_model_dtype() -> None:
    step = make_step(MIXED, seed=6)
    want, want_cache = reference_attention(step, 0.25, None)
    got = TritonAttentionBackend().forward(step.query, step.key, step.value, step.kv_cache,
                                           step.metadata, 0.25, None, **SCALES)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    assert torch.equal(step.kv_cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter runs no inline assembly")
@pytest.mark.parametrize("widen", ["operand", "staged"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-3"])
def test_gpu_decode_of_bf16_queries_over_an_fp8_cache_matches_the_reference(
        widen, num_splits, monkeypatch) -> None:
    """bf16 queries take float16 products over an FP8 cache, its tiles widened at the
    products' operand loads or before them (``PAGEDLLM_FP8_KV_WIDEN``): both attend as the
    reference does."""
    monkeypatch.setenv(FP8_KV_WIDEN_ENV, widen)
    step = make_fp8_step(DECODES, num_heads=8, num_kv_heads=2, seed=5, dtype=torch.bfloat16,
                         **SCALES)
    want, _ = reference_attention(step, 0.25, None, **SCALES)
    torch.testing.assert_close(_decode(step, num_splits).float(), want.float(),
                               **TOLERANCE[torch.bfloat16])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter rounds to float8 wrongly")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_write_rounds_arbitrary_values_as_torch_does(dtype) -> None:
    """Round to nearest even, subnormals included, with a scale that is no power of two."""
    step = make_step(MIXED, seed=7, dtype=dtype)
    k_scale, v_scale = 0.0371, 0.113
    cache = step.kv_cache.to(FP8_DTYPE)
    want = cache.clone()
    TorchReferenceBackend.write_kv(step.key * 40, step.value / 64, want, step.metadata.slot_mapping,
                                   k_scale, v_scale)
    write_kv_cache(step.key * 40, step.value / 64, *paged_kv_views(cache),
                   step.metadata.slot_mapping,
                   k_scale, v_scale)
    assert _same_bytes(cache, want)
