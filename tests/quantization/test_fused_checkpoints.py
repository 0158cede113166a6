"""Quantized checkpoints of a model that stores its q/k/v and gate/up projections fused
(Phi-3 and Phi-4-mini: ``qkv_proj``, ``gate_up_proj``), in every format: each fused
tensor is cut into the shards pagedllm multiplies as one (``FusedLinear.checkpoint_parts``),
and the greedy tokens are HF transformers' on the same quantized weights, in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.conftest import hf_greedy, random_prompts
from tests.quantization.int_checkpoints import hf_on_dequantized, write_awq, write_gptq
from tests.quantization.test_int_checkpoints import engine_tokens
from tests.utils import make_tiny_checkpoint

SIZES = dict(vocab_size=256, max_position_embeddings=128, hidden_size=128,
             intermediate_size=256)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3", **SIZES)


@pytest.mark.parametrize("writer, options", [
    (write_gptq, dict(bits=4, group_size=32, desc_act=True)),
    (write_gptq, dict(bits=8, group_size=64, checkpoint_format="gptq_v2", sym=False)),
    (write_awq, dict(group_size=32)),
])
def test_fused_gptq_and_awq_checkpoints_greedy_equal_hf(phi3, tmp_path, writer, options):
    quantized = writer(phi3, tmp_path / "q", **options)
    prompts = random_prompts(3, 3, 20, seed=12, vocab=256)
    reference = hf_on_dequantized(phi3, quantized)
    assert engine_tokens(tmp_path / "q", prompts) == [hf_greedy(reference, p, 10)
                                                      for p in prompts]


@pytest.fixture(scope="module")
def llm_compressor_checkpoints(phi3, tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("llmcompressor")
    from tests.quantization.llm_compressor import make_checkpoints

    root = tmp_path_factory.mktemp("phi3-llm-compressor")
    schemes = ("FP8_DYNAMIC", "W8A8", "W4A16")
    make_checkpoints([(phi3, root / scheme, scheme, False) for scheme in schemes])
    return {scheme: root / scheme for scheme in schemes}


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "W8A8", "W4A16"])
def test_fused_llm_compressor_checkpoints_greedy_equal_hf(llm_compressor_checkpoints, scheme):
    """HF runs each checkpoint through compressed-tensors (its decompressed weights, and
    its own quantization of the inputs for FP8 and INT8)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model_dir = llm_compressor_checkpoints[scheme]
    prompts = random_prompts(3, 3, 20, seed=13, vocab=256)
    reference = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    assert engine_tokens(model_dir, prompts) == [hf_greedy(reference, p, 10) for p in prompts]
