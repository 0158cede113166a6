"""LongRoPE (Phi-3): short factors inside the original context, long ones past it, with
HF's cos/sin scaling; an unsupported partial rotary factor is refused naming it."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters_from_hf

SHORT = [1.0 + 0.3 * i for i in range(8)]
LONG = [2.0 + i for i in range(8)]


def _hf_config(**extra):
    from transformers import Phi3Config

    return Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=1024,
                      original_max_position_embeddings=64, pad_token_id=0,
                      rope_scaling={"rope_type": "longrope", "short_factor": SHORT,
                                    "long_factor": LONG}, **extra)


def _hf_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope = Phi3RotaryEmbedding(config)
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0, :, :8], sin[0, :, :8]


def test_positions_past_the_original_context_rotate_by_the_long_factors() -> None:
    config = _hf_config()
    ours = RotaryEmbedding(16, rope_parameters_from_hf(config.to_dict()), 1024)
    short_positions = torch.arange(0, 64)
    long_positions = torch.arange(64, 200)
    # HF switches to the long factors once a sequence is longer than 64 positions.
    for positions in (short_positions, long_positions):
        cos, sin = ours(positions, torch.float32)
        want_cos, want_sin = _hf_cos_sin(config, positions)
        torch.testing.assert_close(cos, want_cos, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin, want_sin, rtol=1e-5, atol=1e-5)
    # Position 63 of a sequence that reached 65 tokens: HF recomputes it with the long
    # factors, the paged cache keeps it as written with the short ones.
    cos, _ = ours(torch.tensor([63, 64]), torch.float32)
    hf_cos, _ = _hf_cos_sin(config, torch.tensor([63, 64]))
    torch.testing.assert_close(cos[1], hf_cos[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(cos[0], hf_cos[0])


def test_the_older_su_name_reads_as_longrope() -> None:
    params = rope_parameters_from_hf({"rope_scaling": {"type": "su", "short_factor": SHORT,
                                                       "long_factor": LONG},
                                      "max_position_embeddings": 1024,
                                      "original_max_position_embeddings": 64})
    assert params["rope_type"] == "longrope"
    assert params["original_max_position_embeddings"] == 64


def test_partial_rotary_factor_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75"):
        rope_parameters_from_hf({"partial_rotary_factor": 0.75})
