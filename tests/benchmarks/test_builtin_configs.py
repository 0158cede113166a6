"""The built-in benchmark configs resolve without a download and have the published shapes."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import BUILTIN_CONFIGS_DIR, ModelConfig, builtin_model_configs
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.rotary import compute_inv_freq, rope_parameters_from_hf
from pagedllm.models.registry import get_model_class
from pagedllm.worker.kv_allocator import weight_bytes

# Parameter counts of the published checkpoints (embeddings included, tied ones once).
PUBLISHED_PARAMETERS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "mistral-7b": 7_248_023_552,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
    "qwen3-30b-a3b": 30_532_122_624,
}


def test_every_builtin_config_is_listed() -> None:
    assert builtin_model_configs() == sorted(PUBLISHED_PARAMETERS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_builtin_config_builds_the_published_parameter_count(name) -> None:
    config = ModelConfig(model=name, load_format="dummy")
    assert config.path == BUILTIN_CONFIGS_DIR / name
    assert config.config_dtype == "bfloat16"
    with torch.device("meta"):
        model = get_model_class(config.architectures)(config.hf_config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]
    # The memory model of doctor and plan counts the same parameters from config.json.
    assert weight_bytes(config.hf_config, 1) == PUBLISHED_PARAMETERS[name]


def test_llama_3_1_8b_has_the_benchmark_shape_and_llama3_rope() -> None:
    config = ModelConfig(model="llama-3.1-8b", load_format="dummy")
    hf = config.hf_config
    assert (config.vocab_size, hf["hidden_size"], hf["intermediate_size"]) == (128256, 4096, 14336)
    assert (config.num_layers, config.num_attention_heads, config.num_kv_heads, config.head_dim) == (
        32, 32, 8, 128)
    assert hf["tie_word_embeddings"] is False
    rope = rope_parameters_from_hf(hf)
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    inv_freq, _ = compute_inv_freq(128, rope)
    plain, _ = compute_inv_freq(128, {"rope_type": "default", "rope_theta": 500000.0})
    assert torch.equal(inv_freq[:8], plain[:8])  # short wavelengths kept
    torch.testing.assert_close(inv_freq[-1], plain[-1] / 8.0)  # long ones divided by factor 8


def test_builtin_configs_run_in_token_id_mode_with_the_checkpoint_eos() -> None:
    config = ModelConfig(model="qwen3-0.6b", load_format="dummy")
    assert config.skip_tokenizer_init
    assert config.eos_token_ids == frozenset({151643, 151645})
    assert ModelConfig(model="llama-3.1-8b").eos_token_ids == frozenset({128001})


def test_cuda_engines_default_to_8k_token_steps_and_the_cpu_to_2k(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA config on any host
    cuda = EngineArgs(model="qwen3-0.6b", device="cuda").create_engine_config()
    cpu = EngineArgs(model="qwen3-0.6b", device="cpu").create_engine_config()
    explicit = EngineArgs(model="qwen3-0.6b", device="cuda", max_num_batched_tokens=1024)
    assert cuda.scheduler_config.max_num_batched_tokens == 8192
    assert cpu.scheduler_config.max_num_batched_tokens == 2048
    assert explicit.create_engine_config().scheduler_config.max_num_batched_tokens == 1024
