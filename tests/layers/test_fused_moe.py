"""The mixture-of-experts layer: routing as the reference models route, the torch path
against HF's expert loop, and the grouped Triton GEMM against the torch path (under the
interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.fused_moe import MoEBlock, select_experts
from pagedllm.layers.fused_moe.tiles import (DEFAULT_TILES, TILE_ENV,
                                              MoeTile, choose_tile, parse_tile, row_bucket)
from pagedllm.layers.fused_moe.torch_ref import (
    ExpertInts,
    ExpertScales,
    fused_moe_dense,
    fused_moe_reference,
)
from pagedllm.layers.fused_moe.triton_moe import fused_moe_triton, sort_slots_by_expert

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, seed=0, scale=1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)


def _hf_mixtral_block(block: MoEBlock, top_k: int):
    """HF's own sparse block holding ``block``'s weights."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    experts = block.experts
    config = MixtralConfig(hidden_size=block.gate.input_size,
                           intermediate_size=experts.intermediate_size,
                           num_local_experts=experts.num_experts, num_experts_per_tok=top_k)
    hf = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(block.gate.weight)
        hf.experts.gate_up_proj.copy_(experts.w13)
        hf.experts.down_proj.copy_(experts.w2)
    return hf


def _block(num_experts=4, top_k=2, hidden=32, inter=24, renormalize=True) -> MoEBlock:
    block = MoEBlock(num_experts, top_k, hidden, inter, renormalize)
    block.gate.weight.data = _rand(num_experts, hidden, seed=1, scale=hidden ** -0.5)
    block.experts.w13.data = _rand(num_experts, 2 * inter, hidden, seed=2, scale=hidden ** -0.5)
    block.experts.w2.data = _rand(num_experts, hidden, inter, seed=3, scale=inter ** -0.5)
    return block


def test_renormalised_weights_sum_to_one_and_plain_ones_are_softmax_fractions() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))
    plain, _ = select_experts(logits, 2, renormalize=False)
    torch.testing.assert_close(plain, torch.softmax(logits, -1)[:, :2])


def test_block_equals_hf_with_tied_router_rows_and_an_expert_without_tokens() -> None:
    block = _block().cpu()
    # Experts 1 and 2 share router rows (a token led by expert 0 has a tie for its second
    # choice), and expert 3's row is so negative against positive inputs that no token
    # picks it.
    block.gate.weight.data[0] = block.gate.weight.data[1] + _rand(32, seed=9, scale=0.3).cpu()
    block.gate.weight.data[2] = block.gate.weight.data[1]
    block.gate.weight.data[3] = -10.0
    x = _rand(9, 32, seed=4).cpu() + 1.0
    _, ids = select_experts(torch.nn.functional.linear(x, block.gate.weight), 2, True)
    assert 3 not in ids
    assert any(row[0] == 0 for row in ids.tolist())  # some second choices are ties
    hf = _hf_mixtral_block(block, 2)
    with torch.no_grad():
        want = hf(x[None])
        want = (want[0] if isinstance(want, tuple) else want)[0]
        torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)


def test_sorted_slots_group_each_expert_in_padded_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    slots, block_expert = sort_slots_by_expert(ids, num_experts=5, block_m=2)
    pad = ids.numel()
    # expert 0: slots 1, 4; expert 2: slots 0, 2, 5 (+ pad); expert 3: slot 3 (+ pad).
    assert slots.tolist()[:8] == [1, 4, 0, 2, 5, pad, 3, pad]
    assert block_expert.tolist()[:4] == [0, 2, 2, 3]
    assert all(e == -1 for e in block_expert.tolist()[4:])
    assert all(s == pad for s in slots.tolist()[8:])


def test_fewer_slots_than_experts_bound_the_list_by_the_slots() -> None:
    ids = torch.tensor([[3, 1]], device=DEVICE)
    slots, block_expert = sort_slots_by_expert(ids, num_experts=5, block_m=4)
    # Two slots reach at most two experts: two blocks, not five.
    assert slots.tolist() == [1, 2, 2, 2, 0, 2, 2, 2]
    assert block_expert.tolist() == [1, 3]


def _moe_inputs(num_tokens: int, top_k: int, dtype: torch.dtype = torch.float32,
                hidden: int = 40, inter: int = 24):
    """``(x, w13, w2, weights, ids)`` over 5 experts, expert 4 left without tokens (the
    default widths do not fill a tile)."""
    num_experts = 5
    x = _rand(num_tokens, hidden, seed=5)
    w13 = _rand(num_experts, 2 * inter, hidden, seed=6, scale=hidden ** -0.5)
    w2 = _rand(num_experts, hidden, inter, seed=7, scale=inter ** -0.5)
    logits = _rand(num_tokens, num_experts, seed=8)
    logits[:, 4] = -1e4
    weights, ids = select_experts(logits, top_k, renormalize=False)
    return (*(t.to(dtype) for t in (x, w13, w2)), weights, ids)


@pytest.mark.parametrize("num_tokens, top_k, tile, dtype", [
    (1, 2, None, torch.float32), (7, 2, MoeTile(16, 32, 16), torch.float32),
    (13, 3, MoeTile(16, 16, 32, group_m=1), torch.float32),
    (9, 2, MoeTile(16, 32, 32), torch.bfloat16),
    # Several row blocks per expert, a last group of row blocks shorter than GROUP_M.
    (21, 2, MoeTile(32, 16, 64, group_m=4, num_warps=8, num_stages=2), torch.float32)])
def test_triton_grouped_gemm_matches_the_torch_reference(num_tokens, top_k, tile,
                                                         dtype) -> None:
    x, w13, w2, weights, ids = _moe_inputs(num_tokens, top_k, dtype)
    got = fused_moe_triton(x, w13, w2, weights, ids, tile=tile)
    want = fused_moe_reference(x, w13, w2, weights, ids)
    assert got.dtype == dtype
    # bf16: the products accumulate in another order than BLAS's (a rounding step apart).
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _fp8_experts(w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] | None):
    """The experts' weights in FP8 with their scales: per output channel, or per block."""
    from pagedllm.quantization.fp8 import FP8_MAX, quantize_rows

    def quantize(weights):
        values, scales = [], []
        for weight in weights.float().cpu():
            if block is None:
                q, scale = quantize_rows(weight)
            else:
                rows = -(-weight.shape[0] // block[0])
                cols = -(-weight.shape[1] // block[1])
                scale = torch.rand(rows, cols, generator=torch.Generator().manual_seed(rows))
                scale = scale * 1e-3 + 1e-3
                q = (torch.rand(weight.shape) * 2 - 1) * FP8_MAX
                q = q.to(torch.float8_e4m3fn)
            values.append(q)
            scales.append(scale)
        return torch.stack(values).to(DEVICE), torch.stack(scales).to(DEVICE)

    (q13, s13), (q2, s2) = quantize(w13), quantize(w2)
    return q13, q2, ExpertScales(s13, s2, block)


@pytest.mark.parametrize("block, tile", [
    (None, MoeTile(16, 32, 16)),  # BLOCK_K raised to FP8's 32
    (None, MoeTile(16, 16, 32, group_m=1)),
    ((8, 32), MoeTile(16, 16, 32)),  # ragged blocks
    ((16, 32), MoeTile(16, 32, 64, group_m=1)),  # BLOCK_K cut to the block's 32 inputs
])
def test_triton_grouped_gemm_with_fp8_experts_matches_the_fp8_reference(block, tile) -> None:
    """FP8 experts, per channel and per block: inputs quantized per token (and group), or
    with static scales, each group's product scaled, as the reference dequantizes and
    multiplies."""
    x, w13, w2, weights, ids = _moe_inputs(11, 2)
    q13, q2, scales = _fp8_experts(w13, w2, block)
    cases = [scales]
    if block is None:  # static input scales (powers of two: exact under the interpreter)
        static = torch.tensor([2.0 ** -7], device=DEVICE)
        cases.append(scales._replace(input13=static, input2=static / 4))
    for case in cases:
        got = fused_moe_triton(x, q13, q2, weights, ids, tile=tile, scales=case)
        want = fused_moe_reference(x, q13, q2, weights, ids, scales=case)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        dense = fused_moe_dense(x, q13, q2, weights, ids, scales=case)
        torch.testing.assert_close(dense, want, rtol=1e-4, atol=1e-4)
    if block is None:  # the static scales are used: other values than dynamic ones
        assert not torch.allclose(fused_moe_reference(x, q13, q2, weights, ids, scales=cases[1]),
                                  fused_moe_reference(x, q13, q2, weights, ids, scales=scales))


@pytest.mark.parametrize("tile", [MoeTile(16, 32, 16), MoeTile(32, 16, 64, group_m=1)])
def test_triton_grouped_gemm_with_int8_experts_matches_the_int8_reference(tile) -> None:
    """INT8 W8A8 experts, per channel: inputs quantized to int8 per token (or with static
    scales), int32 sums scaled per row and column, as the reference dequantizes and
    multiplies."""
    from pagedllm.quantization.int8 import quantize_rows_int8

    x, w13, w2, weights, ids = _moe_inputs(11, 2)
    quantized = [[quantize_rows_int8(weight) for weight in stacked.float().cpu()]
                 for stacked in (w13, w2)]
    (q13, s13), (q2, s2) = ((torch.stack([q for q, _ in parts]).to(DEVICE),
                             torch.stack([s for _, s in parts]).to(DEVICE))
                            for parts in quantized)
    static = torch.tensor([2.0 ** -7], device=DEVICE)
    for case in (ExpertScales(s13, s2), ExpertScales(s13, s2, None, static, static / 4)):
        got = fused_moe_triton(x, q13, q2, weights, ids, tile=tile, scales=case)
        want = fused_moe_reference(x, q13, q2, weights, ids, scales=case)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        dense = fused_moe_dense(x, q13, q2, weights, ids, scales=case)
        torch.testing.assert_close(dense, want, rtol=1e-4, atol=1e-4)
    dynamic = fused_moe_reference(x, q13, q2, weights, ids, scales=ExpertScales(s13, s2))
    plain = fused_moe_reference(x, w13, w2, weights, ids)  # int8 is close, not the same
    assert 0 < (dynamic - plain).abs().max() < 0.1 * plain.abs().max()


def test_the_environment_tile_sorts_and_multiplies_with_its_own_block_m(monkeypatch) -> None:
    # BLOCK_M 32 pads each expert's run to 32 slots; a sort padded to any other size would
    # hand the kernel blocks of mixed experts and give another result.
    monkeypatch.setenv(TILE_ENV, "32,16,16,2,4,2")
    assert choose_tile(5, 26) == MoeTile(32, 16, 16, group_m=2, num_warps=4,
                                                 num_stages=2)
    x, w13, w2, weights, ids = _moe_inputs(13, 2)
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, weights, ids),
                               fused_moe_reference(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_the_environment_tile_takes_five_or_six_integers_and_rejects_the_rest() -> None:
    assert parse_tile("128,128,64,8,3") == MoeTile(128, 128, 64, group_m=8, num_warps=8,
                                                   num_stages=3)
    assert parse_tile(" 64,128,64,16,4,4") == MoeTile(64, 128, 64, group_m=16, num_warps=4,
                                                      num_stages=4)
    assert parse_tile(MoeTile(64, 128, 32, 4, 8, 2).spec()) == MoeTile(64, 128, 32, 4, 8, 2)
    for bad in ("128,128,64", "128,128,64,8,3,3,1", "128,x,64,8,3", "128;128;64;8;3",
                "48,128,64,8,3", "8,128,64,8,3", "128,128,64,6,3", "128,128,64,8,0",
                "128,128,64,0,8,3"):
        with pytest.raises(ValueError, match=f"{TILE_ENV}=.*give BLOCK_M,BLOCK_N,BLOCK_K"):
            parse_tile(bad)


def test_a_malformed_environment_tile_fails_the_call(monkeypatch) -> None:
    monkeypatch.setenv(TILE_ENV, "64,64")
    with pytest.raises(ValueError, match="it has 2 values"):
        choose_tile(8, 4096)


def test_larger_buckets_get_larger_tiles(monkeypatch) -> None:
    monkeypatch.delenv(TILE_ENV, raising=False)
    experts = 8
    assert [row_bucket(rows * experts, experts) for rows in (0.125, 16, 17, 64, 256, 1024,
                                                             1025)] == \
        ["<=16", "<=16", "<=64", "<=64", "<=256", "<=1024", ">1024"]
    tiles = [choose_tile(experts, rows * experts)
             for rows in (1, 16, 64, 256, 1024, 4096)]
    assert tiles == [DEFAULT_TILES[b]
                     for b in ("<=16", "<=16", "<=64", "<=256", "<=1024", ">1024")]
    areas = [t.block_m * t.block_n for t in tiles]
    assert areas == sorted(areas) and areas[-1] >= 4 * areas[0]
    assert [t.block_m for t in tiles] == sorted(t.block_m for t in tiles)
    assert tiles[0].block_m == 16 and tiles[-1].block_m >= 128 and tiles[-1].num_warps == 8


def test_the_dense_form_for_cuda_graphs_equals_the_reference() -> None:
    num_experts, hidden, inter = 4, 24, 16
    x = _rand(6, hidden, seed=10).cpu()
    w13 = _rand(num_experts, 2 * inter, hidden, seed=11, scale=hidden ** -0.5).cpu()
    w2 = _rand(num_experts, hidden, inter, seed=12, scale=inter ** -0.5).cpu()
    logits = _rand(6, num_experts, seed=13).cpu()
    logits[:, 2] = -1e4  # expert 2 gets no tokens
    weights, ids = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(fused_moe_dense(x, w13, w2, weights, ids),
                               fused_moe_reference(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def _int_experts(w13: torch.Tensor, w2: torch.Tensor, bits: int, group_size: int,
                 act_order: bool) -> tuple[torch.Tensor, torch.Tensor, ExpertInts]:
    """Random integer experts of ``w13``'s and ``w2``'s shapes in the stored layout: codes,
    zero points and scales drawn, and with ``act_order`` each expert's own input order."""
    from pagedllm.quantization.int_weights import num_groups, pack_rows

    gen = torch.Generator().manual_seed(bits * 100 + group_size)
    parts = []
    for weights in (w13, w2):
        experts, rows, inputs = weights.shape
        groups = num_groups(inputs, group_size)
        codes = torch.randint(0, 1 << bits, (experts, rows, inputs), generator=gen)
        packed = torch.stack([pack_rows(c, bits) for c in codes])
        zeros = torch.randint(0, 1 << bits, (experts, rows, groups), generator=gen)
        scales = torch.rand(experts, rows, groups, generator=gen) * inputs ** -0.5 / (1 << bits)
        perm = None
        if act_order:
            perm = torch.stack([torch.randperm(inputs, generator=gen) for _ in range(experts)])
        parts.append((packed, scales.to(weights.dtype), zeros.to(torch.uint8), perm))
    (q13, s13, z13, p13), (q2, s2, z2, p2) = parts
    moved = [None if t is None else t.to(DEVICE) for t in (s13, z13, s2, z2, p13, p2)]
    ints = ExpertInts(*moved[:4], bits, group_size,
                      *(None if p is None else p.to(torch.int32) for p in moved[4:]))
    return q13.to(DEVICE), q2.to(DEVICE), ints


@pytest.mark.parametrize("bits, group_size, act_order, tile, dtype", [
    (4, 32, False, MoeTile(16, 32, 64), torch.float32),  # BLOCK_K cut to the group's 32
    (4, 16, True, MoeTile(16, 16, 32, group_m=1), torch.float32),
    (8, -1, False, MoeTile(32, 16, 16, group_m=2), torch.float32),
    (8, 32, True, MoeTile(16, 32, 32), torch.bfloat16),
    (4, 32, False, MoeTile(16, 32, 32), torch.bfloat16),
])
def test_triton_grouped_gemm_with_integer_experts_matches_the_reference(
        bits, group_size, act_order, tile, dtype) -> None:
    """4- and 8-bit experts in groups or per channel, with each expert's own act-order
    input order: dequantized tile by tile in the kernel, the reference's weights."""
    x, w13, w2, weights, ids = _moe_inputs(11, 2, dtype, hidden=64, inter=32)
    q13, q2, ints = _int_experts(w13, w2, bits, group_size, act_order)
    got = fused_moe_triton(x, q13, q2, weights, ids, tile=tile, scales=ints)
    want = fused_moe_reference(x, q13, q2, weights, ids, scales=ints)
    # Within a few roundings of the largest output (bf16: another summation order).
    atol = (1e-5 if dtype == torch.float32 else 3e-2) * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    torch.testing.assert_close(fused_moe_dense(x, q13, q2, weights, ids, scales=ints), want,
                               rtol=0, atol=atol)
    if act_order:  # the orders are used: the stored order alone gives another product
        plain = ints._replace(w13_perm=None, w2_perm=None)
        unordered = fused_moe_reference(x, q13, q2, weights, ids, scales=plain)
        assert (unordered - want).abs().max() > 10 * atol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_grouped_gemm_with_codebook_experts_matches_the_reference(dtype) -> None:
    """bitsandbytes' NF4 experts (``codebook[q] * scale``, float32 scales, no zero points):
    the code looked up tile by tile in the kernel, the reference's weights."""
    from pagedllm.quantization import bitsandbytes

    x, w13, w2, weights, ids = _moe_inputs(11, 2, dtype, hidden=64, inter=32)
    q13, q2, ints = _int_experts(w13, w2, 4, 32, False)
    scales = [(s.float() * 8).contiguous() for s in (ints.w13_scales, ints.w2_scales)]
    codebook = ints._replace(w13_scales=scales[0], w13_zeros=None, w2_scales=scales[1],
                             w2_zeros=None, codebook=bitsandbytes.code_values("nf4").to(DEVICE))
    got = fused_moe_triton(x, q13, q2, weights, ids, tile=MoeTile(16, 32, 32), scales=codebook)
    want = fused_moe_reference(x, q13, q2, weights, ids, scales=codebook)
    atol = (1e-5 if dtype == torch.float32 else 3e-2) * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    affine = fused_moe_reference(x, q13, q2, weights, ids, scales=ints)
    assert (affine - want).abs().max() > 10 * atol  # the codebook is read, not the zeros


def test_integer_experts_whose_inputs_do_not_tile_are_refused_by_the_kernel() -> None:
    x, w13, w2, weights, ids = _moe_inputs(3, 2, hidden=40, inter=24)
    q13, q2, ints = _int_experts(w13, w2, 4, 8, False)
    with pytest.raises(ValueError, match="40 and 24 inputs in groups of 8 do not tile"):
        fused_moe_triton(x, q13, q2, weights, ids, scales=ints)
