"""doctor and plan size a checkpoint's weights from config.json (``weight_bytes``): that
count equals the parameters each family's model holds."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.models.loader import load_model
from pagedllm.worker.kv_allocator import weight_bytes
from tests.utils import FAMILIES, make_tiny_checkpoint

OVERRIDES = {"qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]),
             "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, bias=True)}


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_bytes_counts_the_parameters_the_model_holds(tmp_path, family) -> None:
    path = make_tiny_checkpoint(tmp_path, family, **OVERRIDES.get(family, {}))
    hf_config = json.loads((path / "config.json").read_text())
    model = load_model(ModelConfig(model=str(path), load_format="dummy"), "cpu", torch.float32)
    held = sum(p.numel() for p in model.parameters())
    assert weight_bytes(hf_config, 2) == 2 * held


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen2_moe"])
def test_fp8_weight_bytes_count_the_bytes_the_model_holds(tmp_path, family) -> None:
    """With ``--quantization fp8``: FP8 projections (experts included) with per-channel
    scales, the routers, norms and embeddings in the model's dtype."""
    path = make_tiny_checkpoint(tmp_path, family, **OVERRIDES.get(family, {}))
    hf_config = json.loads((path / "config.json").read_text())
    model = load_model(ModelConfig(model=str(path), load_format="dummy", quantization="fp8"),
                       "cpu", torch.float32)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(hf_config, 4, "fp8") == held
