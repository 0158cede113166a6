"""Gemma 2's attention soft-capping runs only where it is implemented."""

from __future__ import annotations

import pytest

from pagedllm.layers.attention import layer


class _KernelBackend:
    name = "triton"


def test_attention_soft_capping_is_refused_on_the_kernel_backend(monkeypatch) -> None:
    monkeypatch.setattr(layer, "get_attention_backend", _KernelBackend)
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50\.0 .*ATTENTION_BACKEND=torch"):
        layer.Attention(4, 16, 2, scale=0.25, layer_idx=0, logits_soft_cap=50.0)
    layer.Attention(4, 16, 2, scale=0.25, layer_idx=0)  # no cap: accepted
