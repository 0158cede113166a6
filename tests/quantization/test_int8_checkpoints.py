"""INT8 W8A8 checkpoints made by llm-compressor (compressed-tensors ``int-quantized``): int8
weights per channel with inputs quantized to int8 per token (its ``W8A8``) or with a
static per-tensor scale, detected from config.json, run to the greedy tokens of HF
transformers running the checkpoint through compressed-tensors: the weights it
decompresses and each projection's input quantized by its own forward pass."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator
from unittest import mock

import pytest
import torch

from pagedllm import LLM
from pagedllm.quantization.int8 import int8_linear, quantize_rows_int8
from tests.engine.conftest import hf_greedy, random_prompts
from tests.quantization.int_checkpoints import hf_on_dequantized, read_tensors
from tests.quantization.teacher_forced import assert_engine_picks, full_pass_logprobs
from tests.quantization.checkpoint_runs import engine_greedy, runner_model

from tests.utils import make_tiny_checkpoint

pytest.importorskip("llmcompressor")

STATIC = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
          "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                "strategy": "tensor", "dynamic": False}}
SIZES = dict(vocab_size=256, max_position_embeddings=128, hidden_size=128,
             intermediate_size=256)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from tests.quantization.llm_compressor import make_checkpoints

    root = tmp_path_factory.mktemp("int8-checkpoints")
    llama = make_tiny_checkpoint(root, "llama", **SIZES)
    qwen3 = make_tiny_checkpoint(root, "qwen3", head_dim=32, **SIZES)
    moe = make_tiny_checkpoint(root, "qwen3_moe", vocab_size=256, max_position_embeddings=128)
    jobs = {"llama-dynamic": (llama, "W8A8"), "qwen3-dynamic": (qwen3, "W8A8"),
            "llama-static": (llama, STATIC), "moe-dynamic": (moe, "W8A8")}
    make_checkpoints([(src, root / name, scheme, False) for name, (src, scheme) in jobs.items()])
    return {**{name: root / name for name in jobs}, "moe-source": moe}


def hf_int8_model(model_dir: Path):
    """HF on the weights compressed-tensors decompresses; its forward pass of each quantized
    projection quantizes the input (per token, or with the static ``input_scale``)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()


def hf_int8_reference(model_dir: Path, prompts) -> list[list[int]]:
    model = hf_int8_model(model_dir)
    return [hf_greedy(model, prompt, 10) for prompt in prompts]


@contextlib.contextmanager
def hf_w8a8(src: Path, model_dir: Path) -> Iterator:
    """HF's model of ``src`` on a W8A8 checkpoint's weights (int8 times their scales) with
    the input of each product the checkpoint holds in int8 quantized per token by
    compressed-tensors' own functions, the experts' too: transformers' stacked experts call
    ``F.linear`` with each expert's weight, so while the context is open a stand-in for
    ``F.linear`` quantizes the inputs of those weights (found by value). (transformers
    cannot load an int8 checkpoint of per-expert tensors into its stacked experts.)"""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**next(iter(config["config_groups"].values()))["input_activations"])
    tensors = read_tensors(model_dir)
    weights = {name.removesuffix(".weight_scale"): tensors[name.removesuffix("_scale")].float()
               * tensors[name].float() for name in tensors if name.endswith(".weight_scale")}
    model = hf_on_dequantized(src, weights)
    model.set_experts_implementation("eager")  # a loop over experts calling F.linear
    held = [model.get_submodule(name).weight for name in weights if ".experts." not in name]
    for experts in (m for m in model.modules() if hasattr(m, "gate_up_proj")):
        held += [w for stacked in (experts.gate_up_proj, experts.down_proj) for w in stacked]
    plain = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        # By value: an expert's weight arrives as a copy (indexed by a tensor).
        if any(w.shape == weight.shape and torch.equal(w, weight) for w in held):
            # per token: compressed-tensors reduces the last dimension of [1, T, H]
            rows = x.reshape(1, -1, x.shape[-1])
            scale, zero = compute_dynamic_scales_and_zp(rows, args, module=None)
            x = fake_quantize(rows, scale, zero, args).reshape(x.shape)
        return plain(x, weight, bias)

    with mock.patch("torch.nn.functional.linear", linear):
        yield model


# The engine and HF sum the same int8 products in other orders, and float noise under a
# rounding boundary can move one input code: two tokens within TIE nats of each other in the
# engine's own logprobs are a tie either may win, and a token's logprob may move by that
# much (ignoring the static input scales moves them by 0.12-0.20 on these checkpoints).
TIE = 0.01


@pytest.mark.parametrize("name", ["llama-dynamic", "qwen3-dynamic", "llama-static"])
def test_llm_compressor_w8a8_checkpoint_picks_hfs_tokens(checkpoints, name):
    """Every token of HF's greedy continuation is the engine's most likely one on the same
    prefix (or ties with it: ``TIE``). Teacher-forced: int8 rounds each input row, so float
    noise under a rounding boundary (attention over the cache summed in another order than
    HF's) can flip one code and, at a near tie, a free-running token; on the same rows the
    products are HF's (free-running checks follow)."""
    prompts = random_prompts(3, 3, 20, seed=21, vocab=256)
    llm = LLM(str(checkpoints[name]), dtype="float32", block_size=8, max_model_len=128,
              device="cpu")
    qkv = runner_model(llm).model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.shape == (qkv.output_size, 1)
    assert (qkv.input_scale is not None) == name.endswith("static")
    model = hf_int8_model(checkpoints[name])
    for prompt in prompts:
        want = hf_greedy(model, prompt, 10)
        assert_engine_picks(llm, prompt, want, full_pass_logprobs(model, prompt, want), TIE)


@pytest.mark.parametrize("name", ["qwen3-dynamic"])
def test_llm_compressor_w8a8_checkpoint_greedy_equals_hf(checkpoints, name):
    """Free-running. Not the static checkpoint: its input scales come from a calibration pass
    whose float sums vary with the machine's threads, and one such checkpoint in four held
    a near tie at a token (the teacher-forced check above covers it)."""
    prompts = random_prompts(3, 3, 20, seed=21, vocab=256)
    llm = LLM(str(checkpoints[name]), dtype="float32", block_size=8, max_model_len=128,
              device="cpu")
    assert engine_greedy(llm, prompts, 10) == hf_int8_reference(checkpoints[name], prompts)


def test_int8_products_round_half_to_even_and_saturate():
    """Per token: the row's largest magnitude maps to 127.5 (saturating at 127, or -128 when
    negative), halves round to even; static: values past the scale's range saturate; the
    product is the dequantized operands'."""
    x = torch.tensor([[0.5, -1.0, 0.25, 2.55], [0.0, 0.0, 0.0, 0.0], [1.0, -2.55, 0.0, 0.0]])
    quantized, scale = quantize_rows_int8(x)
    assert quantized[0].tolist() == [25, -50, 12, 127] and scale[1].item() == 1.0
    assert quantized[2].tolist() == [50, -128, 0, 0]
    assert quantized[1].tolist() == [0, 0, 0, 0]
    static, _ = quantize_rows_int8(x[:1], torch.tensor([0.01]))
    assert static[0].tolist() == [50, -100, 25, 127]
    assert quantize_rows_int8(-x[:1], torch.tensor([0.01]))[0][0, 3].item() == -128
    weight = torch.tensor([[1, -2, 3, 4], [127, 0, -128, 5]], dtype=torch.int8)
    weight_scale = torch.tensor([[0.5], [0.01]])
    want = (quantized.float() * scale) @ (weight.float() * weight_scale).t()
    torch.testing.assert_close(int8_linear(x, weight, weight_scale), want)


def test_llm_compressor_w8a8_experts_greedy_equals_hf(checkpoints):
    """llm-compressor's W8A8 of a Qwen3-MoE: every expert's int8 gate, up and down with
    its inputs quantized per token, in the experts' own stacked weights: HF's greedy
    tokens with compressed-tensors' own input quantization (``hf_w8a8``; the engine's
    logprobs agree with it within 3e-7 there, and without the input quantization HF's
    differ by 0.05)."""
    prompts = random_prompts(3, 3, 20, seed=22, vocab=256)
    llm = LLM(str(checkpoints["moe-dynamic"]), dtype="float32", block_size=8,
              max_model_len=128, device="cpu")
    experts = runner_model(llm).model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.int8 and experts.w13_scale.dtype == torch.float32
    with hf_w8a8(checkpoints["moe-source"], checkpoints["moe-dynamic"]) as model:
        want = [hf_greedy(model, prompt, 10) for prompt in prompts]
    assert engine_greedy(llm, prompts, 10) == want


def test_an_int8_weight_of_another_dtype_is_named(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import save_file

    model_dir = tmp_path / "edited"
    shutil.copytree(checkpoints["llama-dynamic"], model_dir)
    tensors = read_tensors(model_dir)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj\.weight.*weight is int8 in this "
                                         r"checkpoint's quantization_config, got torch\.float32"):
        LLM(str(model_dir), device="cpu")


@pytest.mark.parametrize("edit, message", [
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(symmetric=False),
     r"input_activations are 8-bit 'int' \(symmetric=False"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=64),
     r"weights \(type='int', num_bits=8, strategy='group'"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations=None),
     "input_activations is null"),
])
def test_an_int8_scheme_pagedllm_does_not_read_is_refused_naming_it(checkpoints, tmp_path,
                                                                   edit, message):
    from tests.quantization.checkpoint_runs import with_quantization_config

    model_dir = with_quantization_config(checkpoints["llama-dynamic"], tmp_path / "edited", edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), device="cpu")
