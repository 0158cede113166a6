"""bitsandbytes' LLM.int8 products (``quantization.llm_int8``): on the CPU the values of
bitsandbytes' own ``Linear8bitLt`` (the layer HF transformers runs for an 8-bit
checkpoint) on each row, bit for bit; on the kernels (natively on a GPU, under the
interpreter here) within float32 roundings of them, outliers included."""

from __future__ import annotations

import pytest
import torch

from pagedllm.quantization import llm_int8


def bnb_layer(out_features: int, in_features: int, threshold: float, bias: bool,
              seed: int) -> torch.nn.Module:
    """A ``Linear8bitLt`` holding bitsandbytes' int8 rows of a random weight (the tests
    that compare with bitsandbytes itself need it installed)."""
    bnb = pytest.importorskip("bitsandbytes")
    gen = torch.Generator().manual_seed(seed)
    plain = torch.nn.Linear(in_features, out_features, bias=bias)
    plain.weight.data = torch.randn(out_features, in_features, generator=gen) * 0.05
    if bias:
        plain.bias.data = torch.randn(out_features, generator=gen) * 0.1
    layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias, has_fp16_weights=False,
                                threshold=threshold)
    layer.load_state_dict(plain.state_dict())
    return layer.to("cpu").eval()  # quantizes


def random_int8_rows(out_features: int, in_features: int, seed: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 rows, their ``SCB`` and a bias, random."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (out_features, in_features), generator=gen,
                           dtype=torch.int8)
    return weight, torch.rand(out_features, generator=gen) * 0.1, torch.randn(
        out_features, generator=gen) * 0.1


def int8_rows(layer) -> tuple[torch.Tensor, torch.Tensor]:
    weight = layer.weight
    if weight.data.dtype != torch.int8:  # after a forward pass the state holds them
        return layer.state.CB, layer.state.SCB
    return weight.data, weight.SCB


def inputs(rows: int, columns: int, scale: float, seed: int) -> torch.Tensor:
    """Rows of normal values with a few columns scaled up past any threshold here."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, columns, generator=gen)
    x[:, 3] *= scale
    x[: max(rows // 2, 1), 17] *= scale  # an outlier column in some rows only
    return x


@pytest.mark.parametrize("threshold", [6.0, 0.0, 1.5])
def test_products_are_bitsandbytes_own_row_by_row(threshold):
    """Outliers (a value of 6 or more), none (threshold 0: every input quantized), most of
    them (1.5); a bias; a 3-D input. Each row is bitsandbytes' product of that row alone,
    bit for bit: bitsandbytes would take a column unquantized in every row once one row
    holds an outlier there, so a batch's rows would change each other (the last check)."""
    layer = bnb_layer(48, 64, threshold, bias=True, seed=3)
    weight, scb = int8_rows(layer)
    x = inputs(5, 64, 10.0, seed=4)
    with torch.no_grad():
        want = torch.cat([layer(row[None]) for row in x])
        got = llm_int8.llm_int8_linear(x, weight, scb, threshold, layer.bias)
        # the outlier sums taken over the columns of every row's outliers: in another order
        torch.testing.assert_close(got, want, rtol=0, atol=2**-22 * want.abs().max().item())
        for row in range(5):
            assert torch.equal(llm_int8.llm_int8_linear(x[row:row + 1], weight, scb, threshold,
                                                        layer.bias), want[row:row + 1])
        x3 = x.reshape(1, 5, 64)
        assert torch.equal(llm_int8.llm_int8_linear(x3, weight, scb, threshold, layer.bias),
                           got.reshape(1, 5, -1))
        if threshold == 6.0:  # rows 2-4 hold no outlier in column 17; rows 0-1 do
            assert not torch.equal(layer(x), want)


def test_outlier_columns_are_multiplied_unquantized():
    """A row of 0.5s with one -60: with the outlier threshold the -60 is multiplied
    unquantized and the 0.5s are quantized by their own largest magnitude (exactly); with
    threshold 0 the -60 sets the row's scale and each 0.5 becomes 60/127 (the sum off by
    0.85). The other row's 0.5 in that column stays quantized (32 at the scale 2/127)."""
    x = torch.full((2, 32), 0.5)
    x[0, 0], x[1, 5] = 2.0, -60.0
    weight = torch.full((4, 32), 127, dtype=torch.int8)
    scb = torch.full((4,), 1.0)  # every weight 1: each output is its row's sum
    quantized, row_max, outliers = llm_int8.quantize_rows(x, 6.0)
    assert outliers.nonzero().tolist() == [[1, 5]]
    assert quantized[:, 5].tolist() == [32, 0] and row_max.tolist() == [2.0, 0.5]
    # bitsandbytes scales the integer sums by 6.200124e-05 for 1 / 127**2 (1.8e-5 apart)
    kept = llm_int8.llm_int8_linear(x, weight, scb, 6.0)
    assert kept[1].tolist() == pytest.approx([-60.0 + 31 * 0.5] * 4, rel=1e-4)
    clipped = llm_int8.llm_int8_linear(x, weight, scb, 0.0)
    assert clipped[1].tolist() == pytest.approx([-60.0 + 31 * 60 / 127] * 4, rel=1e-4)


@pytest.mark.parametrize("threshold", [6.0, 0.0])
@pytest.mark.parametrize("rows, dtype", [(3, torch.float32), (20, torch.float32),
                                         (4, torch.bfloat16)])
def test_kernel_products_match_the_reference(threshold, rows, dtype):
    """The tensor-core path (int32 sums, the outliers as two int8 rows each, one shape
    whatever they are): float32 outputs within a few roundings of the reference;
    bfloat16 within one rounding of the reference's float32 values."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight, scb, bias = random_int8_rows(40, 96, seed=rows)
    x = inputs(rows, 96, 12.0, seed=rows + 1)
    want = llm_int8._reference_product(x, weight, scb, threshold, bias)
    got = llm_int8._kernel_product(x.to(device, dtype), weight.to(device), scb.to(device),
                                   threshold, bias.to(device, dtype))
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:  # bf16 inputs: their own reference, one rounding of the outputs apart
        want = llm_int8._reference_product(x.to(dtype).float(), weight, scb, threshold,
                                           bias.to(dtype).float())
        torch.testing.assert_close(got.cpu().float(), want, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("threshold", [6.0, 0.0])
def test_a_prompts_rows_multiplied_in_chunks_give_the_same_values(threshold, monkeypatch):
    """Past ``SUMS_BYTES`` of float32 sums a step's rows multiply in chunks (a prompt of
    8,192 tokens would hold gigabytes): every row the same, bit for bit, ragged last chunk
    included."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight, scb, bias = random_int8_rows(40, 96, seed=5)
    x = inputs(20, 96, 12.0, seed=6).to(device)
    args = (weight.to(device), scb.to(device), threshold, bias.to(device))
    whole = llm_int8._kernel_product(x, *args)
    monkeypatch.setattr(llm_int8, "SUMS_BYTES", 3 * 40 * 4 * 3)  # three rows a chunk
    assert torch.equal(llm_int8._kernel_product(x, *args), whole)

def test_a_row_split_over_ranks_is_quantized_by_the_whole_rows_largest_magnitude():
    """A row-parallel projection's rank holds some columns of each row: given the whole
    rows' largest magnitudes (the engine takes the max over the ranks), its codes are those
    columns of the whole rows' codes, and the parts' products add up to the whole's."""
    x = inputs(3, 64, 10.0, seed=9)
    whole, row_max, _ = llm_int8.quantize_rows(x, 6.0)
    parts = [llm_int8.quantize_rows(part, 6.0, lambda _: row_max.clone())
             for part in (x[:, :40], x[:, 40:])]
    assert torch.equal(torch.cat([codes for codes, _, _ in parts], dim=1), whole)
    assert not torch.equal(llm_int8.quantize_rows(x[:, 40:], 6.0)[0], whole[:, 40:])
    weight, scb, _ = random_int8_rows(16, 64, seed=9)
    summed = sum(llm_int8.llm_int8_linear(x[:, cols], weight[:, cols], scb, 6.0,
                                          whole_row_max=lambda _: row_max.clone())
                 for cols in (slice(0, 40), slice(40, 64)))
    want = llm_int8.llm_int8_linear(x, weight, scb, 6.0)
    torch.testing.assert_close(summed, want, rtol=0, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("threshold", [6.0, 0.0])
@pytest.mark.parametrize("rows, columns, dtype", [(3, 96, torch.float32), (2, 5000, torch.bfloat16),
                                                  (4, 200, torch.float16)])
def test_one_kernel_quantizes_the_rows_as_torch_does(threshold, rows, columns, dtype):
    """``triton_ops.quantize_rows_llm_int8`` (one kernel, the tensor-core path's inputs):
    the codes, the outliers' two rows and every scale of ``llm_int8.stacked_rows``,
    exactly; rows longer than a block (5,000 columns), a row without outliers, a row of
    zeros."""
    from pagedllm.layers import triton_ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = inputs(rows, columns, 12.0, seed=columns).to(dtype)
    x[-1] = 0.0
    x[0, 50] = -7.5  # an outlier in a column no other row has one in
    want = llm_int8.stacked_rows(x, threshold)
    got = triton_ops.quantize_rows_llm_int8(x.to(device), threshold, llm_int8.SUMS_SCALE,
                                            llm_int8.WEIGHT_SCALE)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
