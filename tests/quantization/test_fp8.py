"""FP8 W8A8 (``--quantization fp8``): the product equals its quantize-dequantize reference,
and greedy tokens equal HF transformers' on the same quantized weights with the same
per-token quantization of every projection's input."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.quantization.fp8 import (
    FP8_DTYPE, Fp8Rows, dequantize_rows, fp8_linear, quantize_rows,
)
from tests.engine.conftest import hf_greedy, random_prompts
from tests.utils import make_tiny_checkpoint

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_quantized_rows_keep_each_rows_largest_value_at_the_format_limit():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [[1e-3], [1.0], [30.0], [1e3], [0.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (5, 1)
    assert torch.equal(q[:4].float().abs().amax(-1), torch.full((4,), 448.0))
    assert torch.all(q[4].float() == 0)
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, relative to its row's scale.
    error = (dequantize_rows(q, scale) - x).abs() / scale
    assert error.max() <= 448 / 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n", [(7, 48), (136, 16384)])  # 136 x 16,384: padded on Hopper
def test_fp8_linear_equals_the_dequantized_product(dtype, rows, n):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 96, generator=gen).to(DEVICE, dtype)
    w = torch.randn(n, 96, generator=gen).to(DEVICE)
    bias = torch.randn(w.shape[0], generator=gen).to(DEVICE, dtype)
    wq, w_scale = quantize_rows(w)
    xq, x_scale = quantize_rows(x)
    want = dequantize_rows(xq, x_scale) @ dequantize_rows(wq, w_scale).t() + bias.float()
    got = fp8_linear(x, wq, w_scale, bias)
    assert got.dtype == dtype and got.shape == (rows, w.shape[0])
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - want).norm() / want.norm() < tolerance


def test_hopper_pads_wide_cublas_products_of_129_to_224_rows(monkeypatch):
    """cuBLASLt's FP8 kernels for 129-224 rows into wide outputs are slower than its 256-row
    ones on Hopper: those products run at 256 rows (zero rows added), unless
    PAGEDLLM_FP8_PAD_ROWS=0; narrower outputs and other GPUs run at their own rows."""
    from pagedllm.quantization import fp8

    device = torch.device("cuda")
    monkeypatch.setattr(fp8, "is_hopper", lambda device: True)
    assert [fp8.cublas_rows(r, 28672, device) for r in (16, 128, 129, 200, 224, 225, 300)] == [
        16, 128, 256, 256, 256, 225, 300]
    assert fp8.cublas_rows(200, 4096, device) == 200
    monkeypatch.setattr(fp8, "PAD_ROWS", False)  # PAGEDLLM_FP8_PAD_ROWS=0
    assert fp8.cublas_rows(200, 28672, device) == 200
    monkeypatch.setattr(fp8, "PAD_ROWS", True)
    monkeypatch.setattr(fp8, "is_hopper", lambda device: False)
    assert fp8.cublas_rows(200, 28672, device) == 200


@pytest.mark.parametrize("sums", [False, True], ids=["row-wise", "deferred-scales"])
def test_padded_cublas_products_equal_unpadded_ones(monkeypatch, sums):
    """The zero rows a padded product adds change none of its real rows, with row-wise
    scales or with the sums handed over (``Fp8Sums``); cuBLASLt's on a GPU."""
    from pagedllm.quantization import fp8

    monkeypatch.setattr(fp8, "is_hopper", lambda device: True)
    monkeypatch.setattr(fp8, "_fp8_matmul_supported", lambda device: True)
    monkeypatch.setattr(fp8, "split_k_product", lambda rows, n, device: False)
    monkeypatch.setattr(fp8, "use_fused_ops", lambda t: False)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(150, 32, generator=gen).to(DEVICE, torch.bfloat16)
    wq, w_scale = quantize_rows(torch.randn(16384, 32, generator=gen).to(DEVICE))
    assert fp8.cublas_rows(150, 16384, x.device) == 256

    def product():
        out = fp8_linear(x, wq, w_scale, sums=sums)
        assert isinstance(out, fp8.Fp8Sums) == sums
        return out.scaled() if sums else out

    padded = product()
    monkeypatch.setattr(fp8, "PAD_ROWS", False)
    assert torch.equal(padded, product())


@pytest.mark.parametrize("fast", [False, True])
def test_fast_accumulation_switch_reaches_every_cublas_product(monkeypatch, fast):
    """cuBLASLt's FP8 products take its fast accumulation by default, those with unit
    scales (their sums handed over) and those with row-wise scales alike;
    ``PAGEDLLM_FP8_FAST_ACCUM=0`` turns it off for both."""
    from pagedllm.quantization import fp8

    assert fp8.FAST_ACCUM is True
    monkeypatch.setattr(fp8, "FAST_ACCUM", fast)
    monkeypatch.setattr(fp8, "is_hopper", lambda device: True)
    monkeypatch.setattr(fp8, "_fp8_matmul_supported", lambda device: True)
    monkeypatch.setattr(fp8, "split_k_product", lambda rows, n, device: False)
    monkeypatch.setattr(fp8, "use_fused_ops", lambda t: False)
    calls = []
    scaled_mm = torch._scaled_mm

    def recording(*args, **kwargs):
        calls.append(kwargs.get("use_fast_accum", False))
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(20, 32, generator=gen).to(DEVICE, torch.bfloat16)
    wq, w_scale = quantize_rows(torch.randn(64, 32, generator=gen).to(DEVICE))
    sums = fp8_linear(x, wq, w_scale, sums=True)
    row_wise = fp8_linear(x, wq, w_scale)
    assert calls == [fast, fast]
    torch.testing.assert_close(sums.scaled(), row_wise, rtol=2e-2, atol=2e-2)


def test_hopper_sends_narrow_decode_products_to_the_split_k_gemm(monkeypatch):
    """On Hopper, FP8 products of up to 192 rows into outputs up to 4,096 wide (o_proj and
    down of a decode batch) take the split-K GEMM, unless PAGEDLLM_FP8_SPLIT_GEMM=0; wider
    outputs, more rows and other GPUs stay on cuBLASLt."""
    from pagedllm.quantization import fp8

    device = torch.device("cuda")
    monkeypatch.setattr(fp8, "is_hopper", lambda device: True)
    assert [fp8.split_k_product(r, 4096, device) for r in (17, 128, 192, 193)] == [
        True, True, True, False]
    assert not fp8.split_k_product(128, 6144, device)
    monkeypatch.setattr(fp8, "SPLIT_GEMM", False)  # PAGEDLLM_FP8_SPLIT_GEMM=0
    assert not fp8.split_k_product(128, 4096, device)
    monkeypatch.setattr(fp8, "SPLIT_GEMM", True)
    monkeypatch.setattr(fp8, "is_hopper", lambda device: False)
    assert not fp8.split_k_product(128, 4096, device)


def test_rows_quantized_by_the_op_before_give_the_same_product_and_no_second_scale():
    """``Fp8Rows`` (a norm or activation's output, quantized for the product) multiply as
    the tensor they were made from; a static scale given beside them is refused, not
    silently ignored."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=gen).to(DEVICE, torch.bfloat16)
    wq, w_scale = quantize_rows(torch.randn(32, 64, generator=gen).to(DEVICE))
    rows = Fp8Rows(*quantize_rows(x), x.dtype)
    assert torch.equal(fp8_linear(rows, wq, w_scale), fp8_linear(x, wq, w_scale))
    with pytest.raises(ValueError, match="input_scale=None"):
        fp8_linear(rows, wq, w_scale, input_scale=torch.ones((), device=DEVICE))

def hf_fp8_reference(model_dir, prompts, max_new_tokens):
    """HF transformers' greedy tokens with the decoder's projections emulating FP8 W8A8:
    weights quantized per output channel, inputs per token, products in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def quantize_input(module, args):
        (x,) = args
        q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        return (dequantize_rows(q, scale).reshape(x.shape),)

    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                q, scale = quantize_rows(module.weight)
                module.weight.copy_(dequantize_rows(q, scale))
                module.register_forward_pre_hook(quantize_input)
    return [hf_greedy(model, prompt, max_new_tokens) for prompt in prompts]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_fp8_tokens_equal_hf_with_the_same_quantization(tmp_path, family):
    model_dir = make_tiny_checkpoint(tmp_path, family, vocab_size=256, max_position_embeddings=128)
    prompts = random_prompts(4, 3, 20, seed=2, vocab=256)
    llm = LLM(str(model_dir), quantization="fp8", dtype="float32", block_size=8,
              max_model_len=128, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got == hf_fp8_reference(model_dir, prompts, 10)
    # Only the decoder's projections are FP8: embedding and LM head keep the model's dtype.
    model = llm.llm_engine.engine_core.model_runner.model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    assert model.lm_head.weight.dtype == torch.float32


def test_an_unimplemented_quantization_is_refused_with_the_ones_that_are():
    with pytest.raises(ValueError, match="use fp8, compressed-tensors, gptq, awq, auto-round, "
                                         "modelopt or bitsandbytes, or drop --quantization"):
        LLM(quantization="hqq")


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (8, 9), reason="FP8 tensor cores")
def test_decode_attention_taking_the_qkv_products_sums_gives_the_tokens_of_the_sums_scaled(
        tmp_path, monkeypatch):
    """``PAGEDLLM_QKV_SUMS``: decode steps of more rows than the split-K GEMM takes hand
    the qkv product's sums to the decode launch, which scales them itself. Greedy tokens,
    with CUDA graphs over an FP8 cache, equal those of the same sums scaled by torch before
    the attention (``Fp8Sums.scaled``; cuBLASLt's row-wise scales round once, not twice,
    so they may differ in a last bit)."""
    from pagedllm.layers.attention import layer, triton_backend

    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=128)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 240 + 8 for j in range(5 + i % 9)]}
               for i in range(256)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    launches = []
    decode, forward = triton_backend.paged_decode_attention, layer.Attention.forward

    def spy(*args, new_kv=None, **kwargs):
        launches.append(new_kv is not None and new_kv.sums is not None)
        return decode(*args, new_kv=new_kv, **kwargs)

    def scaled_first(self, q, k, v, rotary=None, outputs=None, sums_scales=None):
        if sums_scales is not None:
            row, col = sums_scales
            cols = col.reshape(-1).split([q.shape[1], k.shape[1], v.shape[1]])
            q, k, v = ((x.float() * row * c.reshape(1, -1)).to(x.dtype)
                       for x, c in zip((q, k, v), cols))
        return forward(self, q, k, v, rotary, outputs)

    monkeypatch.setattr(triton_backend, "paged_decode_attention", spy)
    monkeypatch.setattr(layer, "QKV_SUMS", True)

    def run() -> list[list[int]]:
        llm = LLM(str(path), quantization="fp8", kv_cache_dtype="fp8", dtype="bfloat16",
                  max_model_len=128, block_size=16, max_num_seqs=256, device="cuda")
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    with monkeypatch.context() as patch:
        patch.setattr(layer.Attention, "forward", scaled_first)
        scaled = run()
    assert launches and not any(launches)
    launches.clear()
    fused = run()
    assert any(launches)
    assert fused == scaled
