"""What a family cannot do yet is refused at start, naming what to change: quantizing
GPT-NeoX, OPT or Falcon, ALiBi Falcon."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.models.loader import load_model
from tests.utils import make_tiny_checkpoint


@pytest.mark.parametrize("family, architecture", [("gpt_neox", "GPTNeoXForCausalLM"),
                                                  ("opt", "OPTForCausalLM"),
                                                  ("falcon", "FalconForCausalLM")])
def test_quantizing_the_older_families_is_refused(tmp_path, family, architecture) -> None:
    path = make_tiny_checkpoint(tmp_path, family)
    with pytest.raises(ValueError, match=f"{architecture} cannot be quantized"):
        load_model(ModelConfig(model=str(path), quantization="fp8"), "cpu", torch.float32)


def test_alibi_falcon_is_refused_naming_the_field(tmp_path) -> None:
    import json

    path = make_tiny_checkpoint(tmp_path, "falcon")
    config = json.loads((path / "config.json").read_text())
    config["alibi"] = True
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="alibi=true is not supported for Falcon"):
        load_model(ModelConfig(model=str(path)), "cpu", torch.float32)
