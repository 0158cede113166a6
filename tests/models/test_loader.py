"""Loading checkpoints: sharded files, dummy weights, dtype choice and the errors users hit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.config import ModelConfig
from pagedllm.layers.attention.backend import set_forward_context
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters_from_hf
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import load_model, resolve_dtype
from pagedllm.models.registry import get_model_class
from tests.utils import make_tiny_checkpoint

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
             "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
             "Qwen3MoeForCausalLM", "GPTNeoXForCausalLM", "FalconForCausalLM", "OPTForCausalLM")


def _prompt_logits(model: torch.nn.Module, num_tokens: int = 10) -> torch.Tensor:
    ids = torch.arange(num_tokens) % model.config.vocab_size
    with torch.inference_mode(), set_forward_context(None, []):
        return model.compute_logits(model(ids, torch.arange(num_tokens)))


def _edit_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_sharded_checkpoint_loads_the_same_weights_as_a_single_file(tmp_path) -> None:
    single = make_tiny_checkpoint(tmp_path, "qwen2")
    sharded = make_tiny_checkpoint(tmp_path, "qwen2", num_shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) == 3

    a = load_model(ModelConfig(model=str(single)), "cpu", torch.float32)
    b = load_model(ModelConfig(model=str(sharded)), "cpu", torch.float32)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_unknown_architecture_error_names_the_supported_ones(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))

    with pytest.raises(ValueError, match="GPT2LMHeadModel") as excinfo:
        load_model(ModelConfig(model=str(path)), "cpu", torch.float32)
    for name in SUPPORTED:
        assert name in str(excinfo.value)
    assert "docs/adding_a_model.md" in str(excinfo.value)


def test_first_supported_architecture_is_used() -> None:
    assert get_model_class(["SomethingElse", "Qwen3ForCausalLM"]).__name__ == "Qwen3ForCausalLM"


def test_dummy_load_gives_finite_outputs_deterministic_in_the_seed(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    a = load_model(ModelConfig(model=str(path), load_format="dummy", seed=3), "cpu", torch.float32)
    b = load_model(ModelConfig(model=str(path), load_format="dummy", seed=3), "cpu", torch.float32)
    c = load_model(ModelConfig(model=str(path), load_format="dummy", seed=4), "cpu", torch.float32)

    logits = _prompt_logits(a)
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, _prompt_logits(b))
    assert not torch.equal(logits, _prompt_logits(c))
    for name, param in a.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.all(param == 1), name
        else:
            assert param.abs().max() <= 1e-3, name


def test_dummy_load_needs_no_weight_files(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    (path / "model.safetensors").unlink()
    model = load_model(ModelConfig(model=str(path), load_format="dummy"), "cpu", torch.float32)
    assert torch.isfinite(_prompt_logits(model)).all()


def test_missing_weight_files_error_suggests_dummy_format(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="dummy"):
        load_model(ModelConfig(model=str(path)), "cpu", torch.float32)


def test_checkpoint_tensor_without_a_place_is_named(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    extra = {"model.layers.0.self_attn.extra.weight": torch.ones(2)}
    _edit_weights(path, lambda t: t.update(extra))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.extra\.weight"):
        load_model(ModelConfig(model=str(path)), "cpu", torch.float32)


def test_missing_checkpoint_tensor_is_named_with_its_shard(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    _edit_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        load_model(ModelConfig(model=str(path)), "cpu", torch.float32)


def test_weight_shape_that_contradicts_config_is_reported(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "mistral")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\..*shape.*config\.json"):
        load_model(ModelConfig(model=str(path)), "cpu", torch.float32)


def test_rotary_buffers_and_tied_lm_head_in_a_checkpoint_are_ignored(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    reference = _prompt_logits(load_model(ModelConfig(model=str(path)), "cpu", torch.float32))

    def add_extras(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    _edit_weights(path, add_extras)
    model = load_model(ModelConfig(model=str(path)), "cpu", torch.float32)
    torch.testing.assert_close(_prompt_logits(model), reference, rtol=0, atol=0)


def test_unsupported_rope_scaling_names_the_supported_types() -> None:
    hf = json.loads(json.dumps(dict(
        architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, rope_theta=10000.0,
        rope_scaling={"type": "dynamic", "factor": 2.0},
    )))
    with pytest.raises(ValueError, match="dynamic") as excinfo:
        LlamaForCausalLM(hf)
    for name in ("default", "linear", "llama3", "yarn"):
        assert name in str(excinfo.value)


def test_rope_settings_read_alike_from_old_and_new_config_layouts() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    old = {"rope_theta": 500000.0, "rope_scaling": dict(scaling), "max_position_embeddings": 256}
    new = {"rope_parameters": {**scaling, "rope_theta": 500000.0}, "max_position_embeddings": 256}
    a = RotaryEmbedding(32, rope_parameters_from_hf(old), 256)
    b = RotaryEmbedding(32, rope_parameters_from_hf(new), 256)
    default = RotaryEmbedding(32, rope_parameters_from_hf({"rope_theta": 500000.0}), 256)
    assert torch.equal(a.inv_freq, b.inv_freq)
    assert not torch.equal(a.inv_freq, default.inv_freq)


def test_auto_dtype_runs_half_checkpoints_in_float32_on_cpu_only(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    config = ModelConfig(model=str(path))
    assert config.config_dtype == "bfloat16"
    assert resolve_dtype(config, "cpu") == torch.float32
    assert resolve_dtype(config, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype(ModelConfig(model=str(path), dtype="float16"), "cpu") == torch.float16

    fp32 = ModelConfig(model=str(make_tiny_checkpoint(tmp_path, "llama")))
    assert resolve_dtype(fp32, "cuda") == torch.float32


def test_model_is_built_in_the_requested_dtype_with_float32_rope(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen2", dtype=torch.bfloat16)
    before = torch.get_default_dtype()
    model = load_model(ModelConfig(model=str(path)), "cpu", torch.bfloat16)

    assert torch.get_default_dtype() == before
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    logits = _prompt_logits(model)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()  # the sampler widens them


def test_half_checkpoint_in_float32_matches_hf_upcast(tmp_path) -> None:
    """The CPU default path: a bf16 checkpoint read into float32 equals HF doing the same."""
    import transformers

    path = make_tiny_checkpoint(tmp_path, "qwen3", dtype=torch.bfloat16)
    config = ModelConfig(model=str(path))
    model = load_model(config, "cpu", resolve_dtype(config, "cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.arange(10)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    atol = 1e-4 * ref.abs().max().item()
    torch.testing.assert_close(_prompt_logits(model), ref, rtol=0, atol=atol)
