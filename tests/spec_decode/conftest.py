"""Fixtures for speculative decoding: the engine tests' tiny random Llama as the target, a
draft cut from it (its first layer, so the two often agree), and HF references."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine.conftest import VOCAB_SIZE, make_tiny_model


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def draft_dir(target_dir, tmp_path_factory):
    """The target without its last layer: a cheaper model that agrees with it often."""
    return without_last_layer(target_dir, tmp_path_factory.mktemp("draft"))


def without_last_layer(target_dir, out):
    """Write the checkpoint at ``target_dir`` without its last layer into ``out``."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((target_dir / "config.json").read_text())
    last = config["num_hidden_layers"] - 1
    config["num_hidden_layers"] = last
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(target_dir / "model.safetensors"))
    save_file({name: t for name, t in tensors.items() if f"layers.{last}." not in name},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def hf_model(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat spans of themselves, so n-gram lookup finds proposals."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        span = torch.randint(8, VOCAB_SIZE, (int(torch.randint(3, 9, (1,), generator=generator)),),
                             generator=generator).tolist()
        filler = torch.randint(8, VOCAB_SIZE, (i + 1,), generator=generator).tolist()
        prompts.append(span + filler + span + filler[: i % 3] + span[: 1 + i % len(span)])
    return prompts
