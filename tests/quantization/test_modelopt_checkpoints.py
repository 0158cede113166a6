"""FP8 checkpoints made by NVIDIA Model Optimizer (``tests/quantization/modelopt.py``),
the format of NVIDIA's published FP8 models: per-tensor weights with static inputs (its
``FP8`` algorithm, with FP8 KV-cache scales) and per-channel weights with dynamic
per-token inputs, of a Llama and of a Qwen3-MoE, read from config.json or from the older
``hf_quant_config.json`` alone, and run to the greedy tokens of HF transformers on the
dequantized weights with each input quantized the same way."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedllm import LLM
from tests.engine.conftest import random_prompts
from tests.quantization.int_checkpoints import read_tensors
from tests.quantization.checkpoint_runs import engine_greedy, runner_model
from tests.quantization.test_fp8_checkpoints import dequantized_hf_reference, hf_moe_fp8_reference
from tests.utils import make_tiny_checkpoint

pytest.importorskip("modelopt")

JOBS = {  # name: (algorithm, KV-cache scales, quantizers left disabled)
    "fp8-kv": ("FP8_DEFAULT", True, []),
    "fp8-layer1-mlp-excluded": ("FP8_DEFAULT", False, ["*layers.1.mlp*"]),
    "per-channel": ("FP8_PER_CHANNEL_PER_TOKEN", False, []),
    "moe-fp8": ("FP8_DEFAULT", False, []),  # a Qwen3-MoE: ModelOpt leaves the routers out
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from tests.quantization.modelopt import make_checkpoints

    root = tmp_path_factory.mktemp("modelopt")
    src = make_tiny_checkpoint(root, "llama", vocab_size=256, max_position_embeddings=128,
                               hidden_size=128, intermediate_size=256)
    moe = make_tiny_checkpoint(root, "qwen3_moe", vocab_size=256, max_position_embeddings=128)
    make_checkpoints([(moe if name.startswith("moe") else src, root / name, *job)
                      for name, job in JOBS.items()])
    return {"source": src, "moe-source": moe, **{name: root / name for name in JOBS}}


@pytest.mark.parametrize("name", sorted(set(JOBS) - {"moe-fp8"}))
def test_modelopt_checkpoints_greedy_equal_hf_on_their_dequantized_weights(checkpoints, name):
    prompts = random_prompts(3, 3, 20, seed=18, vocab=256)
    llm = LLM(str(checkpoints[name]), dtype="float32", block_size=8, max_model_len=128,
              device="cpu")
    assert llm.llm_engine.config.model_config.quantization == "modelopt"
    model = runner_model(llm)
    static = name.startswith("fp8")
    assert (model.model.layers[0].self_attn.qkv_proj.input_scale is not None) == static
    if name == "fp8-layer1-mlp-excluded":  # ModelOpt wrote "model.layers.1.mlp*"
        assert model.model.layers[1].mlp.gate_up_proj.weight_scale is None
        assert model.model.layers[1].self_attn.qkv_proj.weight_scale is not None
    want = dequantized_hf_reference(checkpoints[name], checkpoints["source"], prompts, 10)
    assert engine_greedy(llm, prompts, 10) == want


def test_modelopt_mixture_of_experts_greedy_equals_hf_on_its_dequantized_weights(checkpoints):
    """Each expert's per-tensor weight and input scales (the layer's experts share the
    largest input scale), the routers in ModelOpt's ignore list."""
    prompts = random_prompts(3, 3, 20, seed=20, vocab=256)
    llm = LLM(str(checkpoints["moe-fp8"]), dtype="float32", block_size=8, max_model_len=128,
              device="cpu")
    block = runner_model(llm).model.layers[0].mlp
    assert block.experts.w13_input_scale is not None and block.gate.weight_scale is None
    want = hf_moe_fp8_reference(checkpoints["moe-fp8"], checkpoints["moe-source"], prompts, 10)
    assert engine_greedy(llm, prompts, 10) == want


def test_kv_cache_scales_reach_each_layers_attention_and_an_fp8_cache_runs(checkpoints):
    """ModelOpt stores them on k_proj and v_proj (``k_proj.k_scale``)."""
    model_dir = checkpoints["fp8-kv"]
    tensors = read_tensors(model_dir)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, device="cpu",
              kv_cache_dtype="fp8")
    for index, layer in enumerate(runner_model(llm).model.layers):
        for proj, which in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
            stored = tensors[f"model.layers.{index}.self_attn.{proj}.{which}"]
            assert getattr(layer.self_attn.attn, which) == pytest.approx(float(stored))
    assert len(engine_greedy(llm, [[5, 6, 7]], 4)[0]) == 4


def test_the_older_hf_quant_config_json_alone_is_read(checkpoints, tmp_path):
    model_dir = tmp_path / "legacy"
    shutil.copytree(checkpoints["per-channel"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(config))
    prompts = random_prompts(2, 3, 20, seed=19, vocab=256)
    legacy = LLM(str(model_dir), dtype="float32", block_size=8, max_model_len=128,
                 device="cpu")
    current = LLM(str(checkpoints["per-channel"]), dtype="float32", block_size=8,
                  max_model_len=128, device="cpu")
    assert legacy.llm_engine.config.model_config.quantization == "modelopt"
    assert engine_greedy(legacy, prompts, 10) == engine_greedy(current, prompts, 10)


@pytest.mark.parametrize("edit, message", [
    (lambda q: q.update(quant_algo="NVFP4"), r"quant_algo='NVFP4' is not supported"),
    (lambda q: q.update(quant_algo="FP8_PB_WO"), r"quant_algo='FP8_PB_WO' is not supported"),
    (lambda q: q.update(kv_cache_scheme={"type": "float", "num_bits": 4}),
     r"KV-cache quantization 'float4' is not supported"),
])
def test_a_modelopt_algorithm_pagedllm_does_not_read_is_refused_naming_it(
        checkpoints, tmp_path, edit, message):
    from tests.quantization.checkpoint_runs import with_quantization_config

    model_dir = with_quantization_config(checkpoints["fp8-kv"], tmp_path / "edited", edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), device="cpu")
