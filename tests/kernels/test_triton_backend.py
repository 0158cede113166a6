"""The Triton backend end to end: mixed steps, padding, successive steps, dtypes."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
from tests.kernels.paged_batch import DEVICE, HALF_DTYPES, TOLERANCE, make_step, reference_attention

# A fresh prompt, a chunk on top of cached context, decodes at several context lengths.
MIXED = ((0, 11), (9, 4), (17, 1), (0, 1), (30, 1), (6, 7))
DECODES_ONLY = ((17, 1), (0, 1), (30, 1), (5, 1))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_mixed_prefill_and_decode_step_matches_reference(num_heads, num_kv_heads, window) -> None:
    step = make_step(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads)
    expected, expected_cache = reference_attention(step, 0.25, window)
    out = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, window
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert torch.equal(step.kv_cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seqs", [MIXED, DECODES_ONLY], ids=["mixed", "decodes-only"])
def test_soft_capped_scores_match_the_reference(seqs, window) -> None:
    """Gemma 2's attention soft-capping in the prefill and decode kernels; the cap is
    low enough to bend most scores (their scale here is about 1)."""
    step = make_step(seqs, seed=4)
    expected, _ = reference_attention(step, 0.25, window, logits_soft_cap=0.5)
    uncapped, _ = reference_attention(step, 0.25, window)
    out = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, window,
        logits_soft_cap=0.5,
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert not torch.allclose(expected, uncapped, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_mixed_step_matches_fp32_reference(dtype) -> None:
    step = make_step(MIXED, seed=1, dtype=dtype)
    expected, _ = reference_attention(step, 0.25, None)
    out = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, None
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


def test_padding_rows_past_num_actual_tokens_are_not_cached_or_attended() -> None:
    """A runner pads a step to a captured shape; padded rows point at a spare slot."""
    step = make_step(MIXED, seed=2)
    n = step.query.shape[0]
    expected, _ = reference_attention(step, 0.25, None)
    pad = 3
    md = step.metadata
    spare_slot = step.spare_block * md.block_size
    md.slot_mapping = torch.cat(
        [md.slot_mapping, torch.full((pad,), spare_slot, dtype=torch.int64, device=md.slot_mapping.device)]
    )

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.randn(pad, *x.shape[1:], device=x.device)])

    out = TritonAttentionBackend().forward(
        padded(step.query), padded(step.key), padded(step.value), step.kv_cache, md, 0.25, None
    )
    torch.testing.assert_close(out[:n], expected, **TOLERANCE[torch.float32])
    assert torch.count_nonzero(out[n:]) == 0
    assert step.kv_cache[:, step.spare_block].isnan().all()


def test_one_backend_serves_successive_steps_of_different_shapes() -> None:
    """Routing derived for one step (does it hold decodes?) must not leak into the next."""
    backend = TritonAttentionBackend()
    steps = (((0, 5), (2, 3)), MIXED, ((40, 1), (3, 1)), ((4, 6),))
    for seed, seqs in enumerate(steps):
        step = make_step(seqs, seed=seed)
        expected, _ = reference_attention(step, 0.25, 4)
        out = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, 4)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_output_is_contiguous_for_strided_query_views() -> None:
    """Queries usually arrive as a column slice of one fused QKV projection."""
    step = make_step(MIXED, seed=3)
    num_tokens, num_heads, head_dim = step.query.shape
    fused = torch.cat([step.query.flatten(1), step.key.flatten(1)], dim=1)
    query = fused[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    expected, _ = reference_attention(step, 0.25, None)
    out = TritonAttentionBackend().forward(
        query, step.key, step.value, step.kv_cache, step.metadata, 0.25, None
    )
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_a_large_decode_batch_starts_its_longest_sequences_first(monkeypatch) -> None:
    from pagedllm.layers.attention import triton_backend, triton_decode

    orders = []

    def spy(*args, order=None, **kwargs):
        orders.append(order)
        return triton_decode.paged_decode_attention(*args, order=order, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_decode_attention", spy)
    lengths = torch.randint(0, 40, (triton_decode.LONGEST_FIRST_MIN_SEQS + 6,),
                            generator=torch.Generator().manual_seed(5)).tolist()
    step = make_step(tuple((n, 1) for n in lengths) + ((3, 5),), seed=6)
    expected, _ = reference_attention(step, 0.25, None)
    backend = TritonAttentionBackend()
    for _ in range(2):  # two layers of one step share the order
        out = backend.forward(step.query, step.key, step.value, step.kv_cache.clone(),
                              step.metadata, 0.25, None)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert orders[0] is orders[1]
    started = [step.metadata.seq_lens_cpu[b] for b in orders[0].tolist()]
    assert started == sorted(step.metadata.seq_lens_cpu, reverse=True)

    monkeypatch.setenv(triton_decode.LONGEST_FIRST_ENV, "0")
    step = make_step(tuple((n, 1) for n in lengths), seed=7)
    backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, None)
    assert orders[-1] is None


@pytest.mark.parametrize("seqs", [MIXED, DECODES_ONLY], ids=["mixed", "decodes-only"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "fused-ops-off"])
@pytest.mark.parametrize("window", [None, 6])
def test_rotary_applied_by_the_backend_matches_the_reference(window, fused, seqs, monkeypatch,
                                                              request) -> None:
    """Unrotated q and k with ``rotary=(cos, sin)``: the Triton backend rotates them in the
    cache-write kernel, or for a step of decodes alone in the decode kernel (with
    PAGEDLLM_FUSED_OPS=0, by the torch rope before the plain write); output and cache agree
    with the reference backend's rope."""
    from pagedllm.layers import triton_ops
    from pagedllm.layers.attention import triton_backend
    from pagedllm.layers.attention.torch_ref import TorchReferenceBackend
    from pagedllm.layers.rotary import RotaryEmbedding

    fused_calls = []
    original = triton_backend.rotate_and_write_kv
    monkeypatch.setattr(triton_backend, "rotate_and_write_kv",
                        lambda *a, **kw: fused_calls.append(1) or original(*a, **kw))
    if not fused:
        monkeypatch.setenv(triton_ops.FUSED_OPS_ENV, "0")
    triton_ops.fused_ops_enabled.cache_clear()
    request.addfinalizer(triton_ops.fused_ops_enabled.cache_clear)  # later tests read it afresh

    step = make_step(seqs, num_heads=4, num_kv_heads=2, head_dim=16, seed=8)
    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}).to(step.query.device)
    positions = torch.arange(step.query.shape[0], device=step.query.device) * 7 % 41
    rotary = rope(positions, step.query.dtype)
    want_cache = step.kv_cache.clone()
    want = TorchReferenceBackend().forward(
        step.query, step.key, step.value, want_cache, step.metadata, 0.25, window, rotary=rotary
    )
    got = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, window, rotary=rotary
    )
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    torch.testing.assert_close(step.kv_cache.nan_to_num(7.0), want_cache.nan_to_num(7.0),
                               rtol=1e-6, atol=1e-6)
    assert len(fused_calls) == (1 if fused and seqs is MIXED else 0)


def last_token_rows(step, seqs: list[int]):
    """``OutputRows`` of the last new tokens of ``seqs`` (indices of the step's sequences)."""
    from pagedllm.layers.attention.backend import OutputRows

    qsl = step.metadata.query_start_loc_cpu
    rows = torch.tensor([qsl[b + 1] - 1 for b in seqs], dtype=torch.int64, device=DEVICE)
    return OutputRows.last_tokens(step.metadata, seqs, rows)


@pytest.mark.parametrize("backend", ["triton", "torch_ref"])
@pytest.mark.parametrize("cache, rope", [("fp32", True), ("fp32", False), ("fp8", False)],
                         ids=["rope", "no-rope", "fp8-cache"])
@pytest.mark.parametrize("window", [None, 6])
def test_output_rows_alone_attend_and_every_row_is_cached(backend, cache, rope, window) -> None:
    """A model's last layer passes the step's output rows (the last new token of each
    sampling sequence): the backend caches every row as before, and its rows are those of
    the whole step's attention, in the rows' order; with none, it caches and returns none.
    (An FP8 cache without rope: rotated keys would need the rounding the interpreter gets
    wrong, see ``on_fp8_grid``.)"""
    from pagedllm.layers.attention.torch_ref import TorchReferenceBackend
    from pagedllm.layers.rotary import RotaryEmbedding
    from tests.kernels.paged_batch import make_fp8_step

    scales = dict(k_scale=0.5, v_scale=0.25) if cache == "fp8" else {}
    make = (lambda: make_fp8_step(MIXED, seed=9, **scales)) if scales else (
        lambda: make_step(MIXED, seed=9))
    step = make()
    rotary = None
    if rope:
        positions = torch.arange(step.query.shape[0], device=DEVICE) * 5 % 37
        rotary = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}).to(
            DEVICE)(positions, step.query.dtype)
    impl = TritonAttentionBackend if backend == "triton" else TorchReferenceBackend
    full_cache = step.kv_cache.clone()
    full = TorchReferenceBackend().forward(step.query, step.key, step.value, full_cache,
                                           step.metadata, 0.25, window, rotary=rotary, **scales)
    for seqs in ([1, 2, 5], []):  # a chunk's end, decodes, a prompt's end; then no row
        step = make()
        outputs = last_token_rows(step, seqs)
        out = impl().forward(step.query, step.key, step.value, step.kv_cache, step.metadata,
                             0.25, window, rotary=rotary, outputs=outputs, **scales)
        assert out.shape == (len(seqs), *step.query.shape[1:])
        torch.testing.assert_close(out, full[outputs.indices], **TOLERANCE[torch.float32])
        torch.testing.assert_close(step.kv_cache.float().nan_to_num(7.0),
                                   full_cache.float().nan_to_num(7.0), rtol=1e-6, atol=1e-6)


# Fresh prompts (and a fresh one-token prompt, a decode to the kernels); long chunks over
# cached contexts that end mid-page, beside decodes.
FRESH = ((0, 11), (0, 9), (0, 1), (0, 8))
LONG_CHUNKS = ((0, 11), (9, 12), (17, 1), (6, 8), (30, 1))
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA library kernel")


def send_small_prompts_to_fused_attention(monkeypatch, setting: str, context_step: int,
                                          shape_step: int, min_tokens: int = 8) -> list[int]:
    """Test-sized thresholds for ``dense_prefill`` (prompts of ``min_tokens`` take the
    ``setting`` path, plans free); returns the list each ``dense_prefill`` call appends to."""
    from pagedllm.layers.attention import dense_prefill

    for name, value in (("DENSE_PREFILL", setting), ("PLAN_COST_S", 0.0),
                        ("CONTEXT_STEP", context_step), ("SHAPE_STEP", shape_step),
                        ("MIN_TOKENS", min_tokens), ("MIN_KEYS", min_tokens)):
        monkeypatch.setattr(dense_prefill, name, value)
    calls: list[int] = []
    original = dense_prefill.dense_prefill
    monkeypatch.setattr(dense_prefill, "dense_prefill", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("context_step, shape_step", [(1, 1), (4, 8)],
                         ids=["exact-shapes", "padded-shapes"])
@pytest.mark.parametrize("seqs", [FRESH, LONG_CHUNKS, MIXED],
                         ids=["fresh", "chunks-on-context", "beside-short-prompts"])
def test_long_prompts_through_fused_attention_match_the_reference(
        seqs, context_step, shape_step, monkeypatch) -> None:
    """PAGEDLLM_DENSE_PREFILL: a step's long prompts attend in one or two calls of a fused
    attention each (own keys causal, cached context unmasked, merged by their
    log-sum-exps; with padded shapes, the context's last tokens among the own keys behind
    dummy queries, and zeros after; grouped queries, rope applied by the backend), its
    short prompts on the prefill kernel, its decodes on the decode kernel, and the cache
    is still filled: output and cache agree with the reference backend's."""
    from pagedllm.layers.attention.torch_ref import TorchReferenceBackend
    from pagedllm.layers.rotary import RotaryEmbedding

    calls = send_small_prompts_to_fused_attention(monkeypatch, "math", context_step, shape_step)
    step = make_step(seqs, num_heads=4, num_kv_heads=2, head_dim=16, seed=9)
    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}).to(step.query.device)
    positions = torch.cat([torch.arange(c, c + n) for c, n in seqs]).to(step.query.device)
    rotary = rope(positions, step.query.dtype)
    want_cache = step.kv_cache.clone()
    want = TorchReferenceBackend().forward(
        step.query, step.key, step.value, want_cache, step.metadata, 0.25, None, rotary=rotary)
    got = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25, None, rotary=rotary)
    assert calls == [1]
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    torch.testing.assert_close(step.kv_cache.nan_to_num(7.0), want_cache.nan_to_num(7.0),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["math", pytest.param("cudnn", marks=CUDA_ONLY),
                                     pytest.param("flash", marks=CUDA_ONLY)])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_long_half_precision_prompts_through_fused_attention(dtype, backend, monkeypatch) -> None:
    """In fp16 and bf16 each backend (on a GPU, cuDNN's and FlashAttention's kernels) agrees
    with the float32 reference, over cached contexts too (cut at multiples of 32, shapes
    padded to 16), at Llama's head sizes."""
    from pagedllm.layers.attention import dense_prefill

    send_small_prompts_to_fused_attention(monkeypatch, backend, 32, 16)
    seqs = ((0, 40), (37, 30), (17, 1), (100, 24))
    step = make_step(seqs, num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, seed=10,
                     dtype=dtype)
    assert dense_prefill.select(step.query, step.kv_cache, step.metadata, None, None)
    expected, expected_cache = reference_attention(step, 128 ** -0.5, None)
    out = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 128 ** -0.5, None)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    assert torch.equal(step.kv_cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))


@pytest.mark.parametrize("backend, dtype", [
    ("math", torch.float32),
    pytest.param("cudnn", torch.bfloat16, marks=CUDA_ONLY),
    pytest.param("flash", torch.bfloat16, marks=CUDA_ONLY),
])
def test_long_prompts_over_an_fp8_cache_through_fused_attention(backend, dtype, monkeypatch) -> None:
    """Over an FP8 cache the keys and values are widened in the gather and the layer's
    scales applied (k_scale to the scores, v_scale to the output): the same attention and
    the same cache as the reference over the FP8 cache."""
    from tests.kernels.paged_batch import make_fp8_step

    calls = send_small_prompts_to_fused_attention(monkeypatch, backend, 32, 16)
    seqs = ((0, 40), (37, 30), (17, 1), (100, 24))
    step = make_fp8_step(seqs, k_scale=0.5, v_scale=2.0, num_heads=8, num_kv_heads=2,
                         head_dim=128, block_size=16, seed=11, dtype=dtype)
    expected, expected_cache = reference_attention(step, 128 ** -0.5, None, 0.5, 2.0)
    out = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, 128 ** -0.5, None,
        k_scale=0.5, v_scale=2.0)
    assert calls == [1] and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[torch.float16])
    assert torch.equal(step.kv_cache.view(torch.uint8), expected_cache.view(torch.uint8))


def test_fused_attention_takes_only_long_prompts(monkeypatch) -> None:
    """A prompt with too few new tokens or too few keys in all, or whose keys would gather
    past MAX_GATHER_BYTES, stays on the Triton kernel (beside long ones that go); a window,
    a soft cap or a cache in another 16-bit dtype keep the whole step there; the default is
    off away from Hopper (here: the CPU); an unknown setting is refused by name."""
    from pagedllm.layers.attention import dense_prefill

    monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "math")
    monkeypatch.setattr(dense_prefill, "MIN_TOKENS", 8)
    monkeypatch.setattr(dense_prefill, "MIN_KEYS", 8)
    fresh, chunks, mixed = make_step(FRESH), make_step(LONG_CHUNKS), make_step(MIXED)

    def taken(step, window=None, cap=None, cache=None):
        cache = step.kv_cache if cache is None else cache
        return dense_prefill.select(step.query, cache, step.metadata, window, cap)

    assert taken(fresh) == (0, 1, 3) and taken(chunks) == (0, 1, 3)
    assert taken(mixed) == (0,)  # (9, 4) and (6, 7) stay on the kernel
    assert not taken(fresh, window=6) and not taken(fresh, cap=30.0)
    assert not taken(fresh, cache=fresh.kv_cache.to(torch.float16))
    monkeypatch.setattr(dense_prefill, "MIN_TOKENS", 9)
    assert taken(fresh) == (0, 1)
    monkeypatch.setattr(dense_prefill, "MIN_TOKENS", 8)
    monkeypatch.setattr(dense_prefill, "MIN_KEYS", 11)  # a fresh 8 stays, 8 on 6 cached goes
    assert taken(fresh) == (0,) and taken(chunks) == (0, 1, 3)
    monkeypatch.setattr(dense_prefill, "MIN_KEYS", 8)
    # LONG_CHUNKS' longest prompt sequence holds 21 tokens of 2 x 2 x 16 float32 values.
    monkeypatch.setattr(dense_prefill, "MAX_GATHER_BYTES", 21 * 256)
    assert taken(chunks) == (0, 1, 3)
    monkeypatch.setattr(dense_prefill, "MAX_GATHER_BYTES", 21 * 256 - 1)
    assert taken(chunks) == (0, 3)
    monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "off")
    assert not taken(fresh)
    if not torch.cuda.is_available():
        monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "default")
        assert not taken(fresh)
    monkeypatch.setenv("PAGEDLLM_DENSE_PREFILL", "fastest")
    with pytest.raises(ValueError, match="PAGEDLLM_DENSE_PREFILL='fastest'.*cudnn"):
        dense_prefill._setting()


def test_a_library_call_that_fails_falls_back_to_the_kernel_for_good(monkeypatch, caplog) -> None:
    """A fused-attention call that raises (a shape the installed library refuses) costs
    neither the step nor the engine: the step runs the Triton kernel, the path is off from
    then on, and the log says so once."""
    from pagedllm.layers.attention import dense_prefill

    send_small_prompts_to_fused_attention(monkeypatch, "math", 4, 8)
    monkeypatch.setattr(dense_prefill, "_refused", False)
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")

    monkeypatch.setattr(dense_prefill, "_attend", refuse)
    backend = TritonAttentionBackend()
    for seed in (1, 2):
        step = make_step(LONG_CHUNKS, seed=seed)
        expected, expected_cache = reference_attention(step, 0.25, None)
        with caplog.at_level("WARNING"):
            out = backend.forward(step.query, step.key, step.value, step.kv_cache,
                                  step.metadata, 0.25, None)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
        torch.testing.assert_close(step.kv_cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))
    assert calls == [1]
    assert [r.message for r in caplog.records if "PAGEDLLM_DENSE_PREFILL" in r.message][0].endswith(
        "No valid execution plans built.")


def test_an_engine_decodes_the_same_tokens_with_long_prompts_through_fused_attention(
        tmp_path, monkeypatch) -> None:
    """A tiny Llama on the Triton backend, chunked prompts (12-token steps beside decodes)
    and prefix hits: greedy tokens with the prompts' attention in fused calls (float32
    reference products, chunks over cached contexts merged) equal the Triton kernel's."""
    from pagedllm.layers.attention import dense_prefill, selector
    from tests.kernels.engine_runs import chunked_prefix_greedy_tokens, tiny_llama

    path = tiny_llama(tmp_path)
    monkeypatch.setenv(selector.BACKEND_ENV, "triton")
    calls = send_small_prompts_to_fused_attention(monkeypatch, "math", 8, 4, min_tokens=4)
    runs = {}
    for setting in ("off", "math"):
        monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", setting)
        runs[setting] = chunked_prefix_greedy_tokens(path)
    assert calls and runs["math"] == runs["off"]


@pytest.mark.parametrize("family, backend", [
    ("llama", "triton"), ("llama", "torch"), ("gemma2", "torch"), ("gpt_neox", "torch"),
    ("opt", "torch")])
def test_an_engine_decodes_the_same_tokens_computing_only_its_output_rows_last(
        tmp_path, monkeypatch, family, backend) -> None:
    """Chunked prompts beside decodes, prefix hits: the model's last layer computes only
    the rows whose logits are sampled, and the greedy tokens and their logprobs are those
    of the whole step."""
    from pagedllm.layers.attention import backend as attention_backend, selector
    from pagedllm.models.llama import LlamaForCausalLM
    from tests.kernels.engine_runs import chunked_prefix_greedy_outputs
    from tests.utils import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, family, vocab_size=128, max_position_embeddings=128,
                                num_hidden_layers=2)
    monkeypatch.setenv(selector.BACKEND_ENV, backend)
    counts = []
    last_tokens = attention_backend.OutputRows.last_tokens.__func__
    monkeypatch.setattr(attention_backend.OutputRows, "last_tokens", classmethod(
        lambda cls, md, seqs, rows: counts.append((md.num_actual_tokens, len(seqs)))
        or last_tokens(cls, md, seqs, rows)))
    pruned = chunked_prefix_greedy_outputs(path)
    assert (12, 0) in counts and any(0 < s < t for t, s in counts)  # none; some of a mix
    monkeypatch.setattr(LlamaForCausalLM, "prunes_to_output_rows", False)
    steps = len(counts)
    whole = chunked_prefix_greedy_outputs(path)
    assert len(counts) == steps
    assert [o.token_ids for o in whole] == [o.token_ids for o in pruned]
    torch.testing.assert_close([o.cumulative_logprob for o in whole],
                               [o.cumulative_logprob for o in pruned], rtol=1e-5, atol=1e-5)


def test_a_cudnn_shape_waits_for_its_plan_to_pay(monkeypatch) -> None:
    """cuDNN builds a plan per new shape: a step whose shapes have none stays on the kernel
    until the time their calls would have saved reaches PLAN_COST_S, then takes the path,
    and so does every later step of those shapes at once; other backends never wait."""
    from pagedllm.layers.attention import dense_prefill

    monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "cudnn")
    monkeypatch.setattr(dense_prefill, "_plans", dense_prefill._PlanLedger())
    for name, value in (("MIN_TOKENS", 8), ("MIN_KEYS", 8), ("CONTEXT_STEP", 4),
                        ("SHAPE_STEP", 8)):
        monkeypatch.setattr(dense_prefill, name, value)
    step = make_step(LONG_CHUNKS, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)

    def applies(seqs_step=step):
        return bool(dense_prefill.select(seqs_step.query, seqs_step.kv_cache, seqs_step.metadata,
                                          None, None))

    # LONG_CHUNKS' shapes (heads 8, head size 64): own 16 x 16 causal (all three prompts),
    # 16 x 8 and 8 x 4 over the contexts cut at 8 and 4.
    per_call = 4 * 64 * 8 * (16 * 8 + 16 * 8 + 8 * 4) * (1 / 380.0 - 1 / 590.0) / 1e12
    monkeypatch.setattr(dense_prefill, "PLAN_COST_S", 2.5 / 3 * per_call)
    assert [applies() for _ in range(4)] == [False, False, True, True]
    fresh = make_step(FRESH[:2], num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    assert applies(fresh)  # own 16 x 16 twice: built
    longer = make_step(((0, 30),), num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    assert applies(longer)  # own 32 x 32: one call saves more than its plan costs
    monkeypatch.setattr(dense_prefill, "PLAN_COST_S", 1.0)
    other = make_step(((0, 40),), num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    assert not applies(other)  # own 40 x 40: new, and far from paying
    monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "flash")
    assert applies(other)


def test_warm_up_readies_the_path_where_it_is_on(monkeypatch) -> None:
    """``warm_up`` runs one tiny library call and merge for a model's attention (a 16-bit
    or FP8 cache) where the path is on, and nothing where it is off (here: the CPU's
    default); a library that refuses the call turns the path off instead of failing the
    start."""
    from pagedllm.layers.attention import dense_prefill

    cache = torch.zeros((2, 4, 16, 2, 64), dtype=torch.float32, device=DEVICE)
    fp8_cache = torch.zeros((2, 4, 16, 2, 64), dtype=torch.float8_e4m3fn, device=DEVICE)
    calls = []
    attend = dense_prefill._attend
    monkeypatch.setattr(dense_prefill, "_attend",
                        lambda *a, **k: calls.append(a[1].shape) or attend(*a, **k))
    monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "math")
    assert dense_prefill.warm_up(torch.float32, cache, 8)
    assert dense_prefill.warm_up(torch.float32, fp8_cache, 8)
    assert [shape[1:] for shape in calls] == [(8, 64)] * 2  # the model's heads and size
    monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "off")
    assert not dense_prefill.warm_up(torch.float32, cache, 8)
    if not torch.cuda.is_available():
        monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "default")
        assert not dense_prefill.warm_up(torch.float16, cache.half(), 8)
    assert len(calls) == 2
    monkeypatch.setattr(dense_prefill, "DENSE_PREFILL", "math")
    monkeypatch.setattr(dense_prefill, "_refused", False)

    def refuse(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: no engine for this GPU")

    monkeypatch.setattr(dense_prefill, "_attend", refuse)
    assert not dense_prefill.warm_up(torch.float32, cache, 8)  # the engine still starts
    assert dense_prefill._backend(torch.zeros((1, 8, 64))) == "off"
