"""A Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration) serves text: its
text decoder loads from the nested names and config, the vision tower is skipped, and the
logits of text prompts equal HF's model's."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.layers.attention.backend import set_forward_context
from pagedllm.models.loader import load_model
from tests.utils import _randomize


def tiny_gemma3_vision():
    """A tiny random Gemma 3 vision-language model (transformers')."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
                query_pre_attn_scalar=24, sliding_window=5,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    _randomize(model, 0)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_gemma3_vision()
    path = tmp_path_factory.mktemp("gemma3-vision") / "ckpt"
    model.save_pretrained(path)
    return path, model


def test_text_logits_equal_hf_vision_language_model(checkpoint) -> None:
    path, hf = checkpoint
    ours = load_model(ModelConfig(model=str(path)), "cpu", torch.float32)
    prompt = torch.randint(1, 290, (19,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=prompt[None]).logits[0]
    with torch.inference_mode(), set_forward_context(None, []):
        got = ours.compute_logits(ours(prompt, torch.arange(len(prompt))))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
