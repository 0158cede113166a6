"""The attention layer a model calls: ``Attention(q, k, v) -> out`` over the paged cache.

The layer owns no weights. Per step it reads ``get_forward_context()``: its KV cache is
``kv_caches[layer_idx]`` and the batch layout is ``attn_metadata`` (see ``backend.py``).
With no metadata (a profiling pass before the cache exists) the ``T`` tokens are one
causal sequence at positions ``0..T-1`` and nothing is cached.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention.backend import OutputRows, SumsScales, get_forward_context
from pagedllm.layers.attention.selector import get_attention_backend
from pagedllm.layers.attention.torch_ref import causal_attention_without_cache
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.switches import switch

QKV_SUMS_ENV = "PAGEDLLM_QKV_SUMS"
# Whether a step's attention may take the qkv product's FP8 sums (``Attention.takes_sums``).
QKV_SUMS = switch(QKV_SUMS_ENV, True)


class Attention(nn.Module):
    """Paged attention over ``q: [T, num_heads * head_dim]`` and
    ``k/v: [T, num_kv_heads * head_dim]``, returning ``[T, num_heads * head_dim]``.

    ``num_heads`` must be a multiple of ``num_kv_heads`` (grouped-query attention; one KV
    head is multi-query attention). ``sliding_window`` counts tokens: a query at position
    ``p`` sees keys at positions ``p - sliding_window + 1 .. p``.

    ``k_scale`` and ``v_scale`` (plain floats, 1.0 by default; a checkpoint's
    ``self_attn.k_scale`` / ``v_scale`` set them at load) scale the keys and values of an
    FP8 KV cache (``kv_quant.py``); the backend reads them on every call, and a captured
    CUDA graph keeps the values of its capture. A cache in the model's dtype ignores them.

    ``logits_soft_cap`` (Gemma 2's ``attn_logit_softcapping``) maps each scaled score
    ``s`` to ``cap * tanh(s / cap)`` before the softmax, in every backend.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        layer_idx: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} must be a multiple of "
                f"num_key_value_heads={num_kv_heads}."
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}.")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.backend = get_attention_backend()
        self.logits_soft_cap = logits_soft_cap

    def takes_sums(self, outputs: OutputRows | None = None) -> bool:
        """Whether ``forward`` with ``rotary`` and these ``outputs`` takes q, k and v as an
        FP8 product's sums this step (``sums_scales``): a backend that scales them as it
        reads them (``AttentionBackend.takes_sums``), unless ``PAGEDLLM_QKV_SUMS=0``. cuBLASLt's
        FP8 products with one scale per tensor run faster on Hopper than row-wise ones."""
        if not QKV_SUMS or outputs is not None:
            return False
        metadata = get_forward_context().attn_metadata
        return metadata is not None and self.backend.takes_sums(metadata)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        outputs: OutputRows | None = None,
        sums_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``rotary=(cos, sin)`` (``[T, head_dim // 2]`` each): q and k are rotated first
        (rotate-half rope), by the backend, which may fuse it with the KV-cache write.
        ``outputs``: every row is cached, only these rows attend; returns ``[S, ...]``
        (``AttentionBackend.forward``). ``sums_scales=(row_scale, col_scale)``: q, k and v
        are column slices of one FP8 product's sums (``Fp8Sums``: float32 ``[T, 1]`` and
        ``[N, 1]``, N the q, k and v columns in that order), given where ``takes_sums``."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        ctx = get_forward_context()
        sums = None
        if sums_scales is not None:
            if rotary is None or not self.takes_sums(outputs):
                raise ValueError("Attention takes sums with rotary, where takes_sums() is true.")
            row_scale, col_scale = sums_scales
            sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
            sums = SumsScales(row_scale, *col_scale.reshape(-1).split(sizes))
        if ctx.attn_metadata is None:
            if rotary is not None:
                q, k = (RotaryEmbedding.apply(x, *rotary) for x in (q, k))
            out = causal_attention_without_cache(q, k, v, self.scale, self.sliding_window,
                                                 self.logits_soft_cap)
            if outputs is not None:
                out = out[outputs.indices]
        else:
            out = self.backend.forward(
                q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata,
                self.scale, self.sliding_window, rotary=rotary,
                k_scale=self.k_scale, v_scale=self.v_scale,
                logits_soft_cap=self.logits_soft_cap, outputs=outputs, sums=sums,
            )
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"layer={self.layer_idx}, sliding_window={self.sliding_window}, "
            f"k_scale={self.k_scale}, v_scale={self.v_scale}"
        )
