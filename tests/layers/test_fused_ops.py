"""The fused Triton ops compute what the torch layers compute (CPU under the interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.layers import triton_ops
from pagedllm.layers.activation import GatedActivation
from pagedllm.layers.layernorm import RMSNorm, qk_norms
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.sampler import Draw, Sampler, SamplingMetadata, masked_rows, ranked_candidates
from pagedllm.sampling_params import SamplingParams
from tests.utils import token_bitmask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _torch_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None):
    """The layer's own torch path, whatever the device."""
    if residual is None:
        return norm._norm(x)
    s = x + residual
    return norm._norm(s), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_matches_the_torch_layer(dtype) -> None:
    norm = RMSNorm(96, eps=1e-5).to(DEVICE, dtype)
    norm.weight.data = _rand(96, dtype=dtype, seed=3)
    x, residual = _rand(5, 96, dtype=dtype, seed=1), _rand(5, 96, dtype=dtype, seed=2)
    out, new_residual = triton_ops.rms_norm(x, norm.weight, norm.eps, residual)
    want_out, want_residual = _torch_norm(norm, x, residual)
    # bf16: one rounding step apart at most (the interpreter casts by truncation).
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(new_residual, want_residual, rtol=tol, atol=tol)
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)


def test_rms_norm_of_strided_heads_normalises_each_head() -> None:
    """qk-norm input: the q slice of a fused qkv row, viewed [T, heads, head_dim]."""
    norm = RMSNorm(16, eps=1e-6).to(DEVICE)
    norm.weight.data = _rand(16, seed=4)
    qkv = _rand(3, 4 * 16 + 2 * 16, seed=5)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    out = triton_ops.rms_norm(q, norm.weight, norm.eps)
    torch.testing.assert_close(out, _torch_norm(norm, q), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37])
def test_q_and_k_norms_in_one_launch_equal_each_norm(dtype, tokens) -> None:
    """Qwen3's per-head norms of a fused qkv output: q's heads with q_norm, k's with k_norm,
    in one launch (each program a token's 9 heads, padded to 16), equal to each norm on
    its own heads; v is left alone."""
    q_norm, k_norm = RMSNorm(16, eps=1e-6).to(DEVICE, dtype), RMSNorm(16, eps=1e-6).to(DEVICE, dtype)
    q_norm.weight.data = _rand(16, dtype=dtype, seed=4)
    k_norm.weight.data = _rand(16, dtype=dtype, seed=6)
    qkv = _rand(tokens, (6 + 3 + 3) * 16, dtype=dtype, seed=5)
    want_q = _torch_norm(q_norm, qkv[:, : 6 * 16].view(tokens, 6, 16))
    want_k = _torch_norm(k_norm, qkv[:, 6 * 16 : 9 * 16].view(tokens, 3, 16))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got_q, got_k = triton_ops.head_rms_norm(qkv[:, : 9 * 16].view(tokens, 9, 16), q_norm.weight,
                                            q_norm.eps, k_norm.weight, 6)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    torch.testing.assert_close(got_q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(got_k, want_k, rtol=tol, atol=tol)
    q, k = qk_norms(qkv[:, : 9 * 16], q_norm, k_norm, 6)  # the model's call (torch off CUDA)
    assert q.shape == (tokens, 6 * 16) and k.shape == (tokens, 3 * 16)
    torch.testing.assert_close(q, want_q.flatten(1), rtol=tol, atol=tol)
    torch.testing.assert_close(k, want_k.flatten(1), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_torch_activation(dtype) -> None:
    gate_up = _rand(4, 2 * 1100, dtype=dtype, seed=6)  # d=1100 spans two 1024-wide programs
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = triton_ops.silu_and_mul(gate_up)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_rotary_matches_rotate_half_on_a_strided_view() -> None:
    rope = RotaryEmbedding(32, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    positions = torch.tensor([0, 5, 17, 900], device=DEVICE)
    cos, sin = rope(positions, torch.float32)
    qkv = _rand(4, 3 * 32 + 2 * 32, seed=7)
    q = qkv[:, : 3 * 32].view(4, 3, 32)
    x1, x2 = q.chunk(2, dim=-1)
    want = torch.cat((x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]), -1)
    torch.testing.assert_close(triton_ops.rotary(q, cos, sin), want, rtol=1e-5, atol=1e-5)


def test_layers_use_the_fused_ops_only_on_cuda(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr("pagedllm.layers.activation.silu_and_mul",
                        lambda x: calls.append("silu") or torch.zeros(1))
    GatedActivation("silu")(torch.randn(2, 8))  # a CPU tensor: the torch path
    assert calls == []
    assert not triton_ops.use_fused_ops(torch.randn(2))


def test_gumbel_sample_draws_from_the_softmax_and_never_a_masked_token() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    rows = 500
    logits = torch.log(probs).repeat(rows, 1).to(DEVICE)
    seeds = torch.randint(0, 2**31 - 1, (rows,), generator=torch.Generator().manual_seed(0))
    drawn = triton_ops.gumbel_sample(logits, torch.ones(rows, device=DEVICE), seeds.to(DEVICE))
    freq = torch.bincount(drawn.cpu(), minlength=5).float() / rows
    assert freq[4] == 0  # probability 0 (logit -inf)
    # 500 draws: a standard deviation of at most 0.023 per frequency.
    torch.testing.assert_close(freq, probs, atol=0.08, rtol=0)


def test_gumbel_sample_gives_every_column_its_own_noise() -> None:
    """Equal logits over 12 columns (three Philox draws of four uniforms each): every column
    wins about as often; a column sharing another's noise would tie and never win."""
    rows, columns = 400, 12
    logits = torch.zeros(rows, columns, device=DEVICE)
    seeds = torch.randint(0, 2**31 - 1, (rows,), generator=torch.Generator().manual_seed(5))
    drawn = triton_ops.gumbel_sample(logits, torch.ones(rows, device=DEVICE), seeds.to(DEVICE))
    freq = torch.bincount(drawn.cpu(), minlength=columns).float() / rows
    # 400 draws: a standard deviation of 0.0138 per frequency; 4 of them is 0.055, under
    # the 1/12 = 0.083 a column that never wins would be off by.
    torch.testing.assert_close(freq, torch.full((columns,), 1 / columns), atol=0.055, rtol=0)


@pytest.mark.parametrize("lanes", [False, True])
def test_gumbel_sample_is_argmax_when_cold_across_blocks_and_fixed_by_its_seed(monkeypatch,
                                                                              lanes) -> None:
    monkeypatch.setattr(triton_ops, "ARGMAX_LANES", lanes)
    vocab = 5000  # more than one 2048-token block per row
    logits = _rand(3, vocab, seed=8) * 3
    logits[1, 4321] = logits[1].max() + 5  # the winner in the last block
    cold = torch.full((3,), 1e-4, device=DEVICE)
    seeds = torch.tensor([1, 2, 3], device=DEVICE)
    assert triton_ops.gumbel_sample(logits, cold, seeds).tolist() == logits.argmax(-1).tolist()

    warm = torch.ones(3, device=DEVICE)
    alone = triton_ops.gumbel_sample(logits[1:2], warm[:1], seeds[1:2])
    in_batch = triton_ops.gumbel_sample(logits, warm, seeds)
    assert in_batch[1] == alone[0]  # a row's draw depends on its seed, not on its batch


@pytest.mark.parametrize("lanes", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_is_torch_argmax_with_ties_across_parts(monkeypatch, dtype, lanes) -> None:
    """The block-wise and the lane-wise loop (PAGEDLLM_ARGMAX_LANES) alike."""
    monkeypatch.setattr(triton_ops, "ARGMAX_LANES", lanes)
    vocab = 5000  # three 2048-column parts per row
    logits = (_rand(4, vocab, seed=3) * 3).to(dtype)
    logits[0, [100, 4500]] = 50.0  # a tie across parts: the first column wins
    logits[1, [2047, 2048]] = 50.0  # a tie across a part boundary
    logits[2, [4998, 4999]] = 50.0  # a tie inside the last, partial block
    logits[3] = float("-inf")  # nothing allowed: column 0, as torch says
    assert triton_ops.greedy_argmax(logits).tolist() == [100, 2047, 4998, 0]
    assert triton_ops.greedy_argmax(logits).tolist() == logits.float().argmax(-1).tolist()
    many = _rand(37, vocab, seed=4)  # more rows than parts: one part per row
    many[0, [70, 2110]] = 50.0  # a tie in two blocks, the later column in a lower lane
    many[1, [100, 2148, 4196]] = 50.0  # a tie in one lane over three blocks
    assert triton_ops.greedy_argmax(many).tolist()[:2] == [70, 100]
    assert triton_ops.greedy_argmax(many).tolist() == many.argmax(-1).tolist()


SMALL_BATCH_TILES = {
    "dot": (32, 64, 4, 2, True),
    "fma": (32, 64, 4, 2, False),
    # K in slices, finished by each column block's last program (split-K).
    "dot-split": (32, 64, 4, 2, True, 2),
    "fma-split": (32, 64, 4, 2, False, 4),
}


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter multiplies bf16 tiles of tl.dot as raw 16-bit integers.
DOT_DTYPE = torch.float16 if INTERPRETED else torch.bfloat16


@pytest.mark.parametrize("mode, dtype", [
    ("dot", torch.float16),
    pytest.param("dot", torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason="interpreter")),
    ("fma", torch.bfloat16),
    ("dot-split", torch.float16),
    ("fma-split", torch.bfloat16),
])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_small_batch_matmul_equals_linear(monkeypatch, mode, dtype, rows) -> None:
    """Uneven N and K (a partial column block and a partial K tile, the last slice of a
    split K partial), with and without a bias."""
    if mode.startswith("fma") and rows > 1:
        pytest.skip("the lane-wise path serves one row")
    monkeypatch.setattr(triton_ops, "small_batch_matmul_config", lambda m, n, k, fp8=False: SMALL_BATCH_TILES[mode])
    x = _rand(rows, 200, dtype=dtype, seed=8)
    weight = _rand(70, 200, dtype=dtype, seed=9)
    bias = _rand(70, dtype=dtype, seed=10)
    product = x.float() @ weight.float().T
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    got = triton_ops.small_batch_matmul(x, weight, bias)
    torch.testing.assert_close(got, (product + bias.float()).to(dtype), rtol=tol, atol=tol)
    got = triton_ops.small_batch_matmul(x, weight)
    torch.testing.assert_close(got, product.to(dtype), rtol=tol, atol=tol)


def test_small_batch_matmul_row_does_not_depend_on_the_batch(monkeypatch) -> None:
    monkeypatch.setattr(triton_ops, "small_batch_matmul_config", lambda m, n, k, fp8=False: SMALL_BATCH_TILES["dot"])
    x = _rand(5, 128, dtype=DOT_DTYPE, seed=11)
    weight = _rand(48, 128, dtype=DOT_DTYPE, seed=12)
    alone = triton_ops.small_batch_matmul(x[2:3], weight)
    assert torch.equal(triton_ops.small_batch_matmul(x, weight)[2:3], alone)


def test_linear_layers_send_small_batches_to_the_matmul_kernel(monkeypatch) -> None:
    from pagedllm.layers import linear as linear_module
    from pagedllm.layers.linear import Linear

    calls = []
    monkeypatch.setattr(triton_ops, "use_fused_ops", lambda x: True)  # as on a GPU
    monkeypatch.setattr(linear_module, "small_batch_matmul",
                        lambda x, w, b, **kw: calls.append(x.shape[0])
                        or triton_ops.small_batch_matmul(x, w, b, **kw))
    layer = Linear(64, 32).to(DEVICE, DOT_DTYPE)
    layer.weight.data = _rand(32, 64, dtype=DOT_DTYPE, seed=13)
    small, large = _rand(4, 64, dtype=DOT_DTYPE, seed=14), _rand(40, 64, dtype=DOT_DTYPE, seed=15)
    for x in (small, large):
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), rtol=2e-2, atol=2e-2)
    assert calls == [4]

    monkeypatch.setenv(triton_ops.GEMV_MAX_ROWS_ENV, "0")
    triton_ops.gemv_max_rows.cache_clear()
    try:
        layer(small)
        assert calls == [4]
    finally:
        triton_ops.gemv_max_rows.cache_clear()


def test_fp8_weights_take_the_small_batch_product_for_one_row_only(monkeypatch) -> None:
    """From two rows, FP8 weights multiply on the FP8 GEMMs, which are faster there; half
    precision weights keep the small-batch product up to ``gemv_max_rows`` rows."""
    monkeypatch.setattr(triton_ops, "use_fused_ops", lambda x: True)  # as on a GPU
    monkeypatch.setattr(triton_ops, "fp8_dot_supported", lambda device: True)
    fp8 = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    half = torch.zeros(32, 64, dtype=torch.bfloat16)
    rows = {m: torch.zeros(m, 64, dtype=torch.bfloat16) for m in (1, 2, 8, 9)}
    assert [m for m, x in rows.items() if triton_ops.use_small_batch_matmul(x, fp8)] == [1]
    assert [m for m, x in rows.items() if triton_ops.use_small_batch_matmul(x, half)] == [1, 2, 8]


def test_llama_mlp_of_a_small_batch_runs_on_the_matmul_kernel_with_the_norm_after_it(monkeypatch) -> None:
    from pagedllm.layers.layernorm import linear_and_norm

    mlp = _tiny_llama_mlp(DOT_DTYPE, seed=18)
    norm = RMSNorm(64, eps=1e-5).to(DEVICE, DOT_DTYPE)
    norm.weight.data = _rand(64, dtype=DOT_DTYPE, seed=21)
    x = _rand(3, 64, dtype=DOT_DTYPE, seed=20)
    residual = _rand(3, 64, dtype=DOT_DTYPE, seed=22)
    gate, up = torch.nn.functional.linear(x.float(), mlp.gate_up_proj.weight.float()).to(DOT_DTYPE).chunk(2, -1)
    activated = torch.nn.functional.silu(gate.float()).to(DOT_DTYPE).float() * up.float()
    down = torch.nn.functional.linear(activated.to(DOT_DTYPE).float(), mlp.down_proj.weight.float())
    want_sum = (down.to(DOT_DTYPE) + residual).float()
    want = want_sum * torch.rsqrt(want_sum.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
    kernels = []
    monkeypatch.setattr(triton_ops, "use_fused_ops", lambda t: True)  # as on a GPU
    monkeypatch.setattr(triton_ops, "small_batch_matmul_config",
                        lambda m, n, k, fp8=False: kernels.append((n, k)) or SMALL_BATCH_TILES["dot"])
    monkeypatch.setattr(triton_ops, "rms_norm", lambda *a, **k: pytest.fail("a second launch"))
    normed, summed = linear_and_norm(mlp(x), mlp.down_proj, norm, residual)
    torch.testing.assert_close(summed.float(), want_sum, rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(normed.float(), want, rtol=2e-2, atol=2e-2)
    assert kernels == [(192, 64), (64, 96)]  # gate/up with SiLU, then down with the norm


@pytest.mark.parametrize("rows, mode", [(1, "dot"), (3, "dot"), (3, "dot-split")])
def test_small_batch_matmul_with_norm_is_the_product_then_rms_norm_to_the_bit(monkeypatch, rows,
                                                                              mode) -> None:
    """The last program normalises every row; the counters are reset for the next launch."""
    monkeypatch.setattr(triton_ops, "small_batch_matmul_config", lambda m, n, k, fp8=False: SMALL_BATCH_TILES[mode])
    x = _rand(rows, 96, dtype=DOT_DTYPE, seed=27)
    weight = _rand(72, 96, dtype=DOT_DTYPE, seed=28) * 0.2  # three programs of 32 columns
    norm_weight = _rand(72, dtype=DOT_DTYPE, seed=29)
    residual = _rand(rows, 72, dtype=DOT_DTYPE, seed=30)
    product = triton_ops.small_batch_matmul(x, weight)
    want = triton_ops.rms_norm(product, norm_weight, 1e-6, residual)
    for _ in range(2):
        got = triton_ops.small_batch_matmul(x, weight, norm=(norm_weight, 1e-6, residual))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not triton_ops.arrival_counters(x.device, 1).any()
    if mode == "dot-split":  # the slices' sums are added in a fixed order: the same bits
        monkeypatch.setattr(triton_ops, "small_batch_matmul_config", lambda m, n, k, fp8=False: SMALL_BATCH_TILES["dot"])
        whole = triton_ops.small_batch_matmul(x, weight)
        torch.testing.assert_close(whole, product, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="residual of its shape"):
        triton_ops.small_batch_matmul(x, weight, norm=(norm_weight, 1e-6, residual[:, :8]))


@pytest.mark.parametrize("mode, rows", [("dot", 1), ("dot", 3), ("fma", 1), ("fma-split", 1)])
def test_silu_gated_small_batch_matmul_is_silu_and_mul_of_the_product(monkeypatch, mode, rows) -> None:
    """``[gate; up]`` weights with a bias and an uneven K: the same values, and the same
    roundings, as the product followed by ``silu_and_mul``."""
    monkeypatch.setattr(triton_ops, "small_batch_matmul_config", lambda m, n, k, fp8=False: SMALL_BATCH_TILES[mode])
    dtype = DOT_DTYPE if mode.startswith("dot") else torch.bfloat16
    x = _rand(rows, 200, dtype=dtype, seed=24)
    weight = _rand(2 * 45, 200, dtype=dtype, seed=25) * 0.2
    bias = _rand(2 * 45, dtype=dtype, seed=26)
    gate, up = (x.float() @ weight.float().T + bias.float()).to(dtype).float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)
    got = triton_ops.small_batch_matmul(x, weight, bias, silu_gated=True)
    assert got.shape == (rows, 45)
    # bf16: four roundings (the interpreter truncates) may each move a value by one step.
    tol = 4e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="N even"):
        triton_ops.small_batch_matmul(x, weight[:89], silu_gated=True)


def w8a8_reference(kind: str):
    """(quantize rows, dequantize rows) of the W8A8 format ``kind``, "fp8" or "int8"."""
    if kind == "fp8":
        from pagedllm.quantization.fp8 import dequantize_rows, quantize_rows
        return quantize_rows, dequantize_rows
    from pagedllm.quantization.int8 import quantize_rows_int8
    return quantize_rows_int8, lambda quantized, scale: quantized.float() * scale


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("mode, rows", [
    ("dot", 1), ("dot", 3), ("dot", 5), ("fma", 1), ("fma-split", 1)])
def test_w8a8_small_batch_matmul_is_the_w8a8_product(monkeypatch, kind, mode, rows) -> None:
    """FP8 or int8 weights with row scales: each input row quantized in the kernel as the
    format's ``quantize_rows`` quantizes it, the products summed and scaled: the W8A8
    reference's values, plain, with the SiLU gate and with the norm riding on it."""
    quantize, dequantize = w8a8_reference(kind)
    monkeypatch.setattr(triton_ops, "small_batch_matmul_config", lambda m, n, k, **kind: SMALL_BATCH_TILES[mode])
    dtype = DOT_DTYPE if mode == "dot" else torch.bfloat16
    x = _rand(rows, 200, dtype=dtype, seed=31)
    if INTERPRETED and kind == "fp8":
        # The interpreter's float32 -> e4m3 conversion mis-rounds values that round up into
        # the next power of two (7.93 -> 4.0): give it inputs whose quantization is exact,
        # FP8 values times a power of two, each row's largest at the format's limit.
        exact, _ = quantize(x.float())
        x = (exact.float() * 2.0**-6).to(dtype)
    wq, scale = quantize(_rand(2 * 45, 200, seed=32))
    bias = _rand(2 * 45, dtype=dtype, seed=33)

    def reference(b):  # the dequantized W8A8 product in float32
        xq, x_scale = quantize(x)
        out = dequantize(xq, x_scale) @ dequantize(wq, scale).t()
        return out if b is None else out + b.float()

    tol = 4e-2 if dtype == torch.bfloat16 else 5e-3
    got = triton_ops.small_batch_matmul(x, wq, bias, weight_scale=scale)
    torch.testing.assert_close(got.float(), reference(bias), rtol=tol, atol=tol)
    gate, up = reference(bias).to(dtype).float().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate).to(dtype).float() * up
    got = triton_ops.small_batch_matmul(x, wq, bias, silu_gated=True, weight_scale=scale)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    if mode == "dot":
        norm_weight, residual = _rand(90, dtype=dtype, seed=34), _rand(rows, 90, dtype=dtype, seed=35)
        product = triton_ops.small_batch_matmul(x, wq, weight_scale=scale)
        want_normed, want_sum = triton_ops.rms_norm(product, norm_weight, 1e-6, residual)
        normed, summed = triton_ops.small_batch_matmul(x, wq, norm=(norm_weight, 1e-6, residual),
                                                       weight_scale=scale)
        assert torch.equal(summed, want_sum) and torch.equal(normed, want_normed)
    # Static activation scales (a checkpoint's input_scale): every row quantized with one
    # scale, a power of two, so the interpreter's FP8 conversion is exact too.
    input_scale = torch.tensor([2.0**-6], device=x.device)
    xq, x_scale = quantize(x, input_scale)
    want = dequantize(xq, x_scale) @ dequantize(wq, scale).t() + bias.float()
    got = triton_ops.small_batch_matmul(x, wq, bias, weight_scale=scale, input_scale=input_scale)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("static", [False, True])
def test_fp8_row_quantization_kernel_equals_quantize_rows(static):
    """The one-pass kernel gives ``quantize_rows``' FP8 bytes and scales (rows wider than
    one block, a zero row, and with a static scale, values beyond its range clamped)."""
    from pagedllm.quantization.fp8 import quantize_rows

    x = _rand(4, 2500, seed=41) * torch.tensor([[1e-3], [1.0], [300.0], [0.0]], device=DEVICE)
    if INTERPRETED:  # values the interpreter's e4m3 conversion rounds right (see above)
        exact, _ = quantize_rows(x.float())
        x = exact.float() * 2.0**-6 * torch.tensor([[1.0], [2.0], [4.0], [0.0]], device=DEVICE)
    input_scale = torch.tensor([2.0**-8], device=DEVICE) if static else None
    got_q, got_scale = triton_ops.quantize_rows_fp8(x, input_scale)
    want_q, want_scale = quantize_rows(x, input_scale)
    assert torch.equal(got_scale, want_scale.contiguous())
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("static", [False, True])
def test_int8_row_quantization_kernel_equals_quantize_rows_int8(static):
    """The one-pass INT8 kernel gives the reference's bytes and scales: rows wider than one
    block, a zero row, a row's largest magnitude reaching -128, and with a static scale
    halves rounded to even and values beyond its range saturated."""
    from pagedllm.quantization.int8 import quantize_rows_int8

    x = _rand(4, 2500, seed=43) * torch.tensor([[1e-3], [1.0], [300.0], [0.0]], device=DEVICE)
    x[1, 7] = -x[1].abs().max() * 1.5  # the row's largest magnitude, negative: -128
    scale = 2.0**-6
    x[0, :3] = torch.tensor([2.5, -2.5, 3.5], device=DEVICE) * scale  # halves at 2**-6
    input_scale = torch.tensor([scale], device=DEVICE) if static else None
    got_q, got_scale = triton_ops.quantize_rows_int8(x, input_scale)
    want_q, want_scale = quantize_rows_int8(x, input_scale)
    assert torch.equal(got_scale, want_scale.contiguous())
    assert torch.equal(got_q, want_q)
    if static:
        assert want_q[0, :3].tolist() == [2, -2, 4]
        assert (want_q[2].max().item(), want_q[2].min().item()) == (127, -128)
    else:
        assert want_q[1, 7].item() == -128 and want_q[3].abs().max().item() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="int32 tensor-core sums need CUDA")
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_the_cuda_int8_product_is_the_references(rows):
    """The tensor cores' exact int32 sums, scaled once: the float32 reference's product
    within a rounding of the output."""
    from pagedllm.quantization.int8 import int8_linear

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
    weight = torch.randint(-128, 128, (384, 256), generator=gen, dtype=torch.int8)
    weight_scale = torch.rand(384, 1, generator=gen) * 1e-2
    want = int8_linear(x, weight, weight_scale)
    got = int8_linear(x.cuda(), weight.cuda(), weight_scale.cuda()).cpu()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def _fp8_exact(x: torch.Tensor) -> torch.Tensor:
    """Rows the interpreter's e4m3 conversion rounds right (see the FP8 tests above)."""
    from pagedllm.quantization.fp8 import quantize_rows

    exact, _ = quantize_rows(x.float())
    return (exact.float() * 2.0**-6).to(x.dtype)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantizes_for_fp8_as_norm_then_quantize(static, with_residual) -> None:
    """The norm's FP8 output: the bytes and scales of ``quantize_rows_fp8`` applied to its
    own output, and the same residual sum."""
    dtype = torch.bfloat16
    x, residual = _rand(6, 300, dtype=dtype, seed=51), _rand(6, 300, dtype=dtype, seed=52)
    x[4] = 0  # a zero row: the smallest scale
    weight = _rand(300, dtype=dtype, seed=53)
    input_scale = torch.tensor([2.0**-5], device=DEVICE) if static else None
    res = residual if with_residual else None
    plain = triton_ops.rms_norm(x, weight, 1e-6, res)
    fused = triton_ops.rms_norm(x, weight, 1e-6, res, fp8=True, input_scale=input_scale)
    if with_residual:
        (plain, plain_sum), (fused, fused_sum) = plain, fused
        assert torch.equal(fused_sum, plain_sum)
    want_q, want_scale = triton_ops.quantize_rows_fp8(plain, input_scale)
    assert torch.equal(fused[1], want_scale)
    assert torch.equal(fused[0].view(torch.uint8), want_q.view(torch.uint8))
    with pytest.raises(ValueError, match=r"\[T, N\] inputs"):
        triton_ops.rms_norm(x.view(6, 3, 100), weight[:100], 1e-6, fp8=True)


@pytest.mark.parametrize("d, static", [(1100, False), (1100, True), (9000, False), (16500, False)])
def test_silu_and_mul_quantizes_for_fp8_as_silu_and_mul_then_quantize(d, static) -> None:
    """One pass per row, or two for rows wider than 16k (the second from cache): the
    bytes and scales of ``quantize_rows_fp8`` applied to ``silu_and_mul``'s output."""
    gate_up = _rand(3, 2 * d, dtype=torch.bfloat16, seed=54)
    input_scale = torch.tensor([2.0**-6], device=DEVICE) if static else None
    got_q, got_scale = triton_ops.silu_and_mul(gate_up, fp8=True, input_scale=input_scale)
    want_q, want_scale = triton_ops.quantize_rows_fp8(triton_ops.silu_and_mul(gate_up),
                                                      input_scale)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("block, prefetch", [(2048, 0), (512, 0), (2048, 1)])
def test_silu_and_mul_programs_walking_several_rows_quantize_each_as_one_program_a_row(
        block, prefetch, monkeypatch) -> None:
    """Fewer programs than rows (each walking every ``programs``-th row, in one pass or
    two, or loading each next row ahead), over an FP8 product's sums: every row's bytes
    and scale as the default launch of one program a row gives them; the launch can also
    come from ``PAGEDLLM_SILU_FP8_LAUNCH``, and a malformed one is refused by name."""
    rows, d = 13, 1100  # more than 3 rows a program (4 programs off CUDA): rows ahead
    sums = _rand(rows, 2 * d, dtype=torch.bfloat16, seed=55) * 50
    scales = (_rand(rows, 1, seed=56).abs() * 1e-3 + 1e-4,
              _rand(2 * d, 1, seed=57).abs() * 1e-2 + 1e-3)
    want_q, want_scale = triton_ops.silu_and_mul(sums, fp8=True, sums_scales=scales)
    launch = triton_ops.SiluFp8Launch(block, 4, 1, prefetch)  # a few programs: rows > programs
    got_q, got_scale = triton_ops.silu_and_mul(sums, fp8=True, sums_scales=scales, launch=launch)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    with pytest.raises(ValueError, match="pass fp8=True"):
        triton_ops.silu_and_mul(sums, launch=launch)
    if prefetch:  # rows ahead are whole rows: wider ones are refused, not cut
        with pytest.raises(ValueError, match="at most its block"):
            triton_ops.silu_and_mul(sums, fp8=True, launch=triton_ops.SiluFp8Launch(512, 4, 1, 1))
    triton_ops.silu_fp8_launch.cache_clear()
    monkeypatch.setenv("PAGEDLLM_SILU_FP8_LAUNCH", ",".join(map(str, launch)))
    try:
        assert triton_ops.silu_fp8_launch(d) == launch
        monkeypatch.setenv("PAGEDLLM_SILU_FP8_LAUNCH", "1000,4,1")
        triton_ops.silu_fp8_launch.cache_clear()
        with pytest.raises(ValueError, match="PAGEDLLM_SILU_FP8_LAUNCH='1000,4,1'"):
            triton_ops.silu_fp8_launch(d)
    finally:
        triton_ops.silu_fp8_launch.cache_clear()


def _tiny_llama_mlp(dtype: torch.dtype, seed: int):
    """A Llama MLP of 64 -> 96 -> 64 with random weights of ``dtype`` (seeds ``seed`` and
    ``seed + 1``)."""
    from pagedllm.models.llama import LlamaArchConfig, LlamaMLP

    hf = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
              num_attention_heads=4, hidden_act="silu")
    mlp = LlamaMLP(LlamaArchConfig.from_hf(hf, "llama")).to(DEVICE, dtype)
    mlp.gate_up_proj.weight.data = _rand(192, 64, dtype=dtype, seed=seed) * 0.1
    mlp.down_proj.weight.data = _rand(64, 96, dtype=dtype, seed=seed + 1) * 0.1
    return mlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
def test_norm_and_activation_scale_an_fp8_products_sums_as_scaling_first(dtype, fp8) -> None:
    """``sums_scales``: the norm (with its residual) and SiLU-and-mul read an FP8 product's
    sums and scale them (``Fp8Sums``); the outputs are theirs over the scaled product (in
    float32 to the bit under the interpreter, within a rounding of the last bit on a GPU,
    whose compiler may fuse the scale's multiply with the residual's add; bfloat16 within
    the interpreter's casts, which truncate)."""
    from pagedllm.quantization.fp8 import Fp8Sums

    rows, width = 5, 2 * 1100  # SiLU-and-mul's d spans two programs of 1024 columns
    sums = _rand(rows, width, dtype=dtype, seed=61) * 50
    row_scale = _rand(rows, 1, seed=62).abs() * 1e-3 + 1e-4
    col_scale = _rand(width, 1, seed=63).abs() * 1e-2 + 1e-3
    product = Fp8Sums(sums, row_scale, col_scale)
    exact = dict(rtol=0, atol=0) if DEVICE == "cpu" else dict(rtol=2e-7, atol=1e-7)
    tol = exact if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    got = triton_ops.silu_and_mul(sums, fp8=fp8, sums_scales=product.scales)
    want = triton_ops.silu_and_mul(product.scaled(), fp8=fp8)
    if fp8:
        torch.testing.assert_close(got[1], want[1], **tol)
        got, want = got[0].float() * got[1], want[0].float() * want[1]
    torch.testing.assert_close(got, want, **tol)

    sums, col_scale = sums[:, :300], col_scale[:300]
    product = Fp8Sums(sums, row_scale, col_scale)
    weight, residual = _rand(300, dtype=dtype, seed=64), _rand(rows, 300, dtype=dtype, seed=65)
    got = triton_ops.rms_norm(sums, weight, 1e-6, residual, fp8=fp8, sums_scales=product.scales)
    want = triton_ops.rms_norm(product.scaled(), weight, 1e-6, residual, fp8=fp8)
    torch.testing.assert_close(got[1], want[1], **tol)  # the residual stream
    if fp8:
        torch.testing.assert_close(got[0][1], want[0][1], **tol)
        got, want = (got[0][0].float() * got[0][1],), (want[0][0].float() * want[0][1],)
    torch.testing.assert_close(got[0], want[0], **tol)
    with pytest.raises(ValueError, match="300 column float32 scales"):
        triton_ops.rms_norm(sums, weight, 1e-6, residual, sums_scales=(row_scale, col_scale[:7]))


def test_fp8_products_hand_their_sums_to_the_norm_and_the_activation(monkeypatch) -> None:
    """On Hopper a batch too large for the small-batch kernel multiplies FP8 weights with
    one unit scale per operand and hands the sums to the SiLU-and-mul and the norm that
    read them (``Fp8Sums``): the MLP's outputs are those of cuBLASLt's row-wise scales
    (``PAGEDLLM_FP8_DEFERRED_SCALES=0``) within a rounding of each product, which may move
    an input of the next product by one FP8 step. float16 models keep the row-wise scales."""
    from pagedllm.layers import activation, layernorm, linear
    from pagedllm.layers.layernorm import linear_and_norm
    from pagedllm.quantization import fp8

    for module in (triton_ops, layernorm, activation, linear, fp8):
        monkeypatch.setattr(module, "use_fused_ops", lambda t: True)  # as on a GPU
    monkeypatch.setattr(triton_ops, "fp8_dot_supported", lambda device: True)
    monkeypatch.setattr(fp8, "_fp8_matmul_supported", lambda device: True)
    monkeypatch.setattr(fp8, "is_hopper", lambda device: True)
    monkeypatch.setattr(fp8, "split_k_product", lambda rows, n, device: False)
    monkeypatch.setattr(fp8, "DEFERRED_SCALES", True)
    products = []
    real_linear = fp8.fp8_linear
    monkeypatch.setattr(linear, "fp8_linear", lambda *a, **k: products.append(
        type(out := real_linear(*a, **k)).__name__) or out)
    dtype = torch.bfloat16
    mlp = _tiny_llama_mlp(dtype, seed=66)
    for proj in (mlp.gate_up_proj, mlp.down_proj):
        proj.quantize_fp8()
    next_norm = RMSNorm(64, eps=1e-5).to(DEVICE, dtype)
    next_norm.weight.data = _rand(64, dtype=dtype, seed=68)
    x, residual = _rand(40, 64, dtype=dtype, seed=69), _rand(40, 64, dtype=dtype, seed=70)

    def run():
        return linear_and_norm(mlp(x), mlp.down_proj, next_norm, residual=residual)

    deferred = run()
    assert products == ["Fp8Sums", "Fp8Sums"]
    monkeypatch.setattr(fp8, "DEFERRED_SCALES", False)
    products.clear()
    row_wise = run()
    assert products == ["Tensor", "Tensor"]
    for got, want in zip(deferred, row_wise):  # the SiLU output's FP8 steps may round apart
        assert (got.float() - want.float()).norm() < 0.03 * want.float().norm()
    # float16 cannot hold the unscaled sums: its products keep cuBLASLt's row-wise scales.
    monkeypatch.setattr(fp8, "DEFERRED_SCALES", True)
    products.clear()
    mlp, next_norm = _tiny_llama_mlp(torch.float16, seed=66), next_norm.to(torch.float16)
    for proj in (mlp.gate_up_proj, mlp.down_proj):
        proj.quantize_fp8()
    out, _ = linear_and_norm(mlp(x.half()), mlp.down_proj, next_norm, residual=residual.half())
    assert products == ["Tensor", "Tensor"] and out.isfinite().all()


def test_fp8_mlp_takes_its_inputs_quantized_by_the_norm_and_the_activation(monkeypatch) -> None:
    """A batch too large for the small-batch kernel, FP8 weights, on a GPU: the norm
    before gate/up and SiLU-and-mul before down hand their outputs over quantized, and
    the layer's outputs are bit for bit those of quantizing in each product; with BF16
    weights, or a batch the small-batch kernel takes, nothing is handed over quantized."""
    from pagedllm.layers import activation, layernorm, linear
    from pagedllm.layers.layernorm import linear_and_norm
    from pagedllm.quantization import fp8

    for module in (triton_ops, layernorm, activation, linear, fp8):
        monkeypatch.setattr(module, "use_fused_ops", lambda t: True)  # as on a GPU
    monkeypatch.setattr(triton_ops, "fp8_dot_supported", lambda device: True)
    passes = []
    monkeypatch.setattr(fp8, "quantize_rows_fp8", lambda x, scale=None: passes.append(x.shape)
                        or triton_ops.quantize_rows_fp8(x, scale))
    dtype = torch.bfloat16
    mlp = _tiny_llama_mlp(dtype, seed=55)
    norm, next_norm = (RMSNorm(64, eps=1e-5).to(DEVICE, dtype) for _ in range(2))
    norm.weight.data = _rand(64, dtype=dtype, seed=57)
    next_norm.weight.data = _rand(64, dtype=dtype, seed=58)
    norm.feeds(mlp.gate_up_proj)

    def run(rows: int):
        x = _fp8_exact(_rand(rows, 64, dtype=dtype, seed=59))
        residual = _fp8_exact(_rand(rows, 64, dtype=dtype, seed=60))
        normed, summed = norm(x, residual)
        return linear_and_norm(mlp(normed), mlp.down_proj, next_norm, residual=summed)

    bf16 = run(12)
    assert passes == []
    for proj in (mlp.gate_up_proj, mlp.down_proj):
        proj.quantize_fp8()
    handed = run(12)
    assert passes == []  # both products took their inputs quantized
    links = norm._consumer, mlp.act._consumer
    norm._consumer = mlp.act._consumer = ()
    quantized_in_products = run(12)
    assert passes == [(12, 64), (12, 96)]
    norm._consumer, mlp.act._consumer = links
    for got, want in zip(handed, quantized_in_products):
        assert torch.equal(got, want)
    torch.testing.assert_close(handed[0].float(), bf16[0].float(), rtol=0.2, atol=0.2)
    monkeypatch.setattr(triton_ops, "small_batch_matmul_config",
                        lambda m, n, k, fp8=False: SMALL_BATCH_TILES["fma"])
    passes.clear()
    run(2)  # the small-batch kernel quantizes its rows itself
    assert passes == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_refused_tokens_are_written_in_place_as_masking_the_rows_would(dtype) -> None:
    """The in-place mask kernel sets exactly the tokens a row's bitmask refuses to -inf, in
    the picked rows only (over two blocks of columns and a partial last word), and leaves
    every other logit as it was: the logits ``masked_rows`` builds."""
    batch, vocab = 5, 2 * triton_ops.MASK_BLOCK + 70
    logits = _rand(batch, vocab, dtype=dtype, seed=8)
    rows = torch.tensor([3, 0, 4], device=DEVICE)
    allowed = torch.rand(len(rows), vocab, generator=torch.Generator().manual_seed(9)) < 0.4
    allowed[2] = False
    allowed[2, vocab - 1] = True  # the last word's one token
    bitmask = token_bitmask(allowed).to(DEVICE)
    want = logits.clone()
    want[rows] = masked_rows(logits, rows, bitmask)
    got = triton_ops.refuse_masked_tokens_(logits.clone(), rows, bitmask)
    assert torch.equal(got, want)
    assert torch.isinf(got[4, : vocab - 1]).all() and got[4, vocab - 1] == logits[4, vocab - 1]
    assert torch.equal(got[[1, 2]], logits[[1, 2]])


@pytest.mark.parametrize("lanes", [False, True])
def test_masked_row_argmax_is_the_draw_of_the_rows_masked_first(monkeypatch, lanes) -> None:
    """Rows picked out of the batch and raced under their bitmask in place, greedy or by
    the Gumbel race with the batch's temperatures and seeds at those rows: the tokens of
    masking the picked rows' logits first, ties across parts included."""
    monkeypatch.setattr(triton_ops, "ARGMAX_LANES", lanes)
    batch, vocab = 9, 5000  # three 2048-column parts per row
    logits = _rand(batch, vocab, seed=6) * 3
    logits[2, [150, 4100]] = 60.0  # a tie across parts, both allowed below
    gen = torch.Generator().manual_seed(7)
    rows = torch.tensor([4, 2, 7, 0, 2], device=DEVICE)  # any order, a row twice
    allowed = torch.rand(len(rows), vocab, generator=gen) < 0.3
    allowed[1, [150, 4100]] = True
    allowed[3] = False
    allowed[3, 4999] = True  # one token allowed, in the last partial block
    bitmask = token_bitmask(allowed).to(DEVICE)
    masked = masked_rows(logits, rows, bitmask)
    temperature = torch.linspace(0.5, 1.5, batch, device=DEVICE)
    seeds = torch.randint(0, 2**31 - 1, (batch,), generator=gen).to(DEVICE)
    greedy = triton_ops.masked_row_argmax(logits, rows, bitmask)
    assert greedy.tolist() == masked.argmax(-1).tolist()
    assert greedy[1] == 150 and greedy[3] == 4999
    drawn = triton_ops.masked_row_argmax(logits, rows, bitmask, temperature, seeds)
    want = triton_ops.gumbel_sample(masked, temperature[rows], seeds[rows])
    assert drawn.tolist() == want.tolist()
    assert all(allowed[r, t] for r, t in enumerate(drawn.tolist()))


def test_gumbel_redraw_under_a_mask_is_the_masked_draw() -> None:
    """Check-then-mask on the Gumbel path: a row's draw, kept when the mask allows it and
    drawn again under the mask from the same seed otherwise, is the masked row's draw."""
    rows, vocab = 16, 300
    logits = _rand(rows, vocab, seed=4) * 3
    gen = torch.Generator().manual_seed(5)
    allowed = torch.rand(rows, vocab, generator=gen) < 0.2
    bitmask = token_bitmask(allowed).to(DEVICE)
    params = [SamplingParams(temperature=0.5 + i / rows) for i in range(rows)]
    meta = SamplingMetadata.build(params, [[1]] * rows, [[]] * rows, [None] * rows, vocab, DEVICE)
    seeds = torch.randint(0, 2**31 - 1, (rows,), generator=gen).to(DEVICE)
    every_row = torch.arange(rows, device=DEVICE)
    first = triton_ops.gumbel_sample(logits, meta.temperature, seeds).cpu()
    want = triton_ops.gumbel_sample(masked_rows(logits, every_row, bitmask), meta.temperature,
                                    seeds).cpu()
    refused = (~allowed[torch.arange(rows), first]).nonzero().flatten()
    assert 0 < len(refused) < rows
    got = first.clone()
    got[refused] = Sampler.redraw(Draw(logits=logits, meta=meta, noise=seeds),
                                  refused.to(DEVICE), bitmask[refused.to(DEVICE)]).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("gumbel", [False, True])
def test_the_first_allowed_of_the_race_top_is_the_masked_winner(gumbel) -> None:
    """``race_top`` scores as the race kernels do: the first token of a row's ranking
    (``ranked_candidates``) that its mask allows is ``masked_row_argmax``'s winner, greedy
    or by the Gumbel race, ties across blocks included (the first column first); a row
    whose mask allows none of its candidates has none to take."""
    batch, vocab, count = 9, 5000, 8  # three 2048-column blocks per row
    logits = _rand(batch, vocab, seed=8) * 3
    logits[2, [150, 4100]] = 60.0  # a tie across blocks
    gen = torch.Generator().manual_seed(9)
    rows = torch.tensor([4, 2, 7, 0, 2, 5], device=DEVICE)
    temperature = torch.linspace(0.5, 1.5, batch, device=DEVICE)
    seeds = torch.randint(0, 2**31 - 1, (batch,), generator=gen).to(DEVICE)
    race = (temperature, seeds) if gumbel else ()
    ranked = ranked_candidates(*triton_ops.race_top(logits, rows, count + 1, *race), count)
    assert ranked.shape == (len(rows), count)
    first = (triton_ops.gumbel_sample(logits, temperature, seeds) if gumbel
             else triton_ops.greedy_argmax(logits))
    assert ranked[:, 0].tolist() == first[rows].tolist()
    if not gumbel:
        assert ranked[1, :2].tolist() == [150, 4100]
    for trial in range(3):
        allowed = torch.rand(len(rows), vocab, generator=gen) < 0.5 ** (trial + 1)
        allowed[1, 150] = trial != 1  # the tie's first column refused once
        want = triton_ops.masked_row_argmax(logits, rows, token_bitmask(allowed).to(DEVICE),
                                            *race).tolist()
        for r, candidates in enumerate(ranked.tolist()):
            taken = next((t for t in candidates if t >= 0 and allowed[r, t]), None)
            assert taken is None or taken == want[r], (trial, r)


@pytest.mark.parametrize("split, rows, width", [(1, 1, 1200), (3, 2, 1200), (4, 5, 45)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_sums_are_added_in_slice_order_plus_the_bias_rounded_once(split, rows, width,
                                                                        dtype) -> None:
    """A split-K product's float32 slices, in one launch: the slices added in order, then
    the bias, rounded once to the output dtype (columns over two blocks, and a ragged one)."""
    partials = _rand(split, rows, width, dtype=torch.float32, seed=40)
    bias = _rand(width, dtype=dtype, seed=41)
    summed = partials[0].clone()
    for part in partials[1:]:
        summed += part
    got = triton_ops.sum_split_partials(partials, bias, dtype)
    want = (summed + bias.float()).to(dtype)
    if dtype == torch.bfloat16 and INTERPRETED:  # the interpreter truncates to bf16
        torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3)
    else:
        assert torch.equal(got, want)
    assert torch.equal(triton_ops.sum_split_partials(partials, None, torch.float16),
                       summed.to(torch.float16))
