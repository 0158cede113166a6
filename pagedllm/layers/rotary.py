"""Rotary position embeddings (RoPE) with the scalings Llama-family checkpoints use.

Positions are absolute token indices within a sequence. For head dimension ``D`` the
frequencies are ``inv_freq[i] = theta ** (-2i / D)`` for ``i < D / 2``, rescaled by the
checkpoint's rope type; a head vector is rotated as two halves (the "rotate half"
convention of Hugging Face checkpoints, not interleaved pairs)::

    x = [x1 | x2]  ->  [x1 * cos - x2 * sin | x2 * cos + x1 * sin],  angle = pos * inv_freq

Angles and their cos/sin are computed in float32 and cast to the activation dtype, as the
reference implementation does, so float32 runs match it to rounding. On CUDA the rotation
is one Triton kernel per tensor (``triton_ops.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.layers.triton_ops import rotary, use_fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters_from_hf(hf_config: dict, allow_partial: bool = False) -> dict[str, Any]:
    """The checkpoint's rope settings as one flat dict with ``rope_type`` and ``rope_theta``.

    Reads both layouts: ``rope_theta`` + ``rope_scaling`` (older checkpoints) and a single
    ``rope_parameters`` dict with ``rope_theta`` inside (newer ones). Raises ValueError for
    rope types this engine does not implement, naming the supported ones, and for a
    ``partial_rotary_factor`` other than 1 unless ``allow_partial`` (the caller rotates
    the leading ``partial_rotary_factor`` of each head, ``rotate_leading``); the dict
    then holds it (1.0 when absent).
    """
    params = dict(hf_config.get("rope_scaling") or {})
    nested = hf_config.get("rope_parameters") or {}
    if nested and all(isinstance(v, dict) for v in nested.values()):
        raise ValueError(
            "Per-layer-type rope_parameters are not supported for this architecture; "
            "give one rope_parameters dict for all layers."
        )
    params.update(nested)
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "su":  # the older name of LongRoPE
        rope_type = "longrope"
    params["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported; supported rope types: "
            f"{list(SUPPORTED_ROPE_TYPES)}."
        )
    partial = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor"))
    if allow_partial:
        params["partial_rotary_factor"] = float(partial or 1.0)
    elif partial not in (None, 1, 1.0):
        raise ValueError(
            f"partial_rotary_factor={partial} is not supported for this architecture (only 1.0)."
        )
    if rope_type in ("llama3", "yarn", "longrope"):
        params.setdefault(
            "original_max_position_embeddings",
            hf_config.get("original_max_position_embeddings")
            or hf_config.get("max_position_embeddings"),
        )
    return params


def compute_inv_freq(
    head_dim: int, params: dict[str, Any], max_position_embeddings: int | None = None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] float32, attention_scaling)`` for the rope type in ``params``.

    ``attention_scaling`` multiplies cos and sin (1.0 except for YaRN).
    """
    base = float(params["rope_theta"])
    rope_type = params["rope_type"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, params, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope_inv_freq(inv_freq, params, "short_factor", max_position_embeddings)
    raise ValueError(
        f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}."
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short kept, the band between blended."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    dim: int, base: float, params: dict[str, Any], max_position_embeddings: int | None
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        if m and m_all:
            attention_factor = mscale(factor, m) / mscale(factor, m_all)
        else:
            attention_factor = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(
    inv_freq: torch.Tensor, params: dict[str, Any], which: str,
    max_position_embeddings: int | None,
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3's "su"): each frequency divided by its ``short_factor`` or
    ``long_factor``; cos and sin scaled by ``sqrt(1 + ln(f) / ln(original))`` with ``f``
    the context's growth (``factor``, else max / original positions), 1 when ``f <= 1``."""
    factors = torch.tensor(params[which], dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"rope {which} has {factors.numel()} values; head_dim / 2 = "
                         f"{inv_freq.numel()} are needed.")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = (max_position_embeddings or original) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return inv_freq / factors, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` once per forward pass; ``apply`` rotates q or k with them."""

    def __init__(
        self, head_dim: int, params: dict[str, Any], max_position_embeddings: int | None = None
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}.")
        self.head_dim = head_dim
        self.rope_type = params["rope_type"]
        inv_freq, self.attention_scaling = compute_inv_freq(
            head_dim, params, max_position_embeddings
        )
        # float32 always: the angle for position p is p * inv_freq and loses digits in half.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # LongRoPE: positions from ``long_from`` on rotate by the long factors' frequencies.
        self.long_from: int | None = None
        self.register_buffer("long_inv_freq", None, persistent=False)
        if self.rope_type == "longrope":
            base_freq, _ = compute_inv_freq(head_dim, {"rope_type": "default",
                                                       "rope_theta": params["rope_theta"]})
            long_inv_freq, _ = _longrope_inv_freq(base_freq, params, "long_factor",
                                                  max_position_embeddings)
            self.long_inv_freq = long_inv_freq
            self.long_from = params["original_max_position_embeddings"]

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions: [T]`` int -> ``(cos, sin)``, each ``[T, head_dim // 2]`` in ``dtype``.

        LongRoPE picks the frequencies per token: short factors below the checkpoint's
        original context, long ones from there on. (The reference implementation switches
        a whole sequence, recomputing its cache, once it outgrows the original context; a
        paged cache keeps what it wrote, so a sequence's tokens past that point rotate by
        the long factors and the ones before keep the short.)"""
        inv_freq = self.inv_freq.float()[None, :]
        if self.long_inv_freq is not None:
            inv_freq = torch.where(positions[:, None] >= self.long_from,
                                   self.long_inv_freq.float()[None, :], inv_freq)
        angles = positions.to(torch.float32)[:, None] * inv_freq
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [T, heads, head_dim]`` by per-token ``cos, sin: [T, head_dim // 2]``."""
        if use_fused_ops(x) and x.dtype == cos.dtype:
            return rotary(x, cos, sin)
        x1, x2 = x.chunk(2, dim=-1)
        cos = cos[:, None, :]
        sin = sin[:, None, :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rope_type={self.rope_type}"


def rotary_dims(head_dim: int, params: dict[str, Any]) -> int:
    """How many leading dimensions of each head rotate: ``head_dim`` times the
    ``partial_rotary_factor`` in ``params`` (1 when absent). Raises ValueError unless
    that is even and positive."""
    factor = params.get("partial_rotary_factor") or 1.0
    dims = int(head_dim * factor)
    if dims % 2 or dims == 0:
        raise ValueError(f"partial_rotary_factor={factor} gives {dims} rotary dimensions of "
                         f"{head_dim}; pagedllm needs an even number > 0.")
    return dims


def rotate_leading(x: torch.Tensor, rotary_dim: int, cos: torch.Tensor, sin: torch.Tensor
                   ) -> torch.Tensor:
    """``x [T, heads, D]`` with its first ``rotary_dim`` dims rotated (rotate-half within
    them, ``cos, sin: [T, rotary_dim // 2]``), the rest passed through."""
    rotated = RotaryEmbedding.apply(x[..., :rotary_dim].contiguous(), cos, sin)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
