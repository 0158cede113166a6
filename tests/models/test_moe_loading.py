"""Mixture-of-experts checkpoints: both expert layouts load to the same model, and what
cannot work is refused at start."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.config import ModelConfig
from pagedllm.layers.attention.backend import set_forward_context
from pagedllm.models.loader import load_model
from tests.utils import make_tiny_checkpoint


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(11) % model.config.vocab_size
    with torch.inference_mode(), set_forward_context(None, []):
        return model.compute_logits(model(ids, torch.arange(11)))


def _stack_experts(path, num_experts: int, gate: str, up: str, down: str) -> None:
    """Rewrite per-expert tensors as the stacked ``experts.gate_up_proj [E, 2I, H]`` /
    ``experts.down_proj [E, H, I]`` newer transformers keep in memory."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    prefixes = {n.split(".experts.")[0] for n in tensors if ".experts." in n}
    for prefix in prefixes:
        def take(name: str) -> list[torch.Tensor]:
            return [tensors.pop(f"{prefix}.experts.{e}.{name}.weight") for e in range(num_experts)]
        gates, ups, downs = take(gate), take(up), take(down)
        stacked = prefix.replace(".block_sparse_moe", ".mlp")
        tensors[f"{stacked}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(gates, ups)])
        tensors[f"{stacked}.experts.down_proj"] = torch.stack(downs)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("family, names", [("mixtral", ("w1", "w3", "w2")),
                                           ("qwen3_moe", ("gate_proj", "up_proj", "down_proj"))])
def test_stacked_expert_tensors_load_as_the_per_expert_ones(tmp_path, family, names) -> None:
    per_expert = make_tiny_checkpoint(tmp_path, family)
    stacked = make_tiny_checkpoint(tmp_path, family)
    _stack_experts(stacked, 4, *names)
    a = load_model(ModelConfig(model=str(per_expert)), "cpu", torch.float32)
    b = load_model(ModelConfig(model=str(stacked)), "cpu", torch.float32)
    assert torch.equal(_logits(a), _logits(b))


def test_a_missing_expert_is_named(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, "mixtral")
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.w13\[3:up\]"):
        load_model(ModelConfig(model=str(path)), "cpu", torch.float32)
