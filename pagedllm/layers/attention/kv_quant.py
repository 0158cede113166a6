"""What the paged KV cache stores: the model's dtype, or FP8 (``--kv-cache-dtype fp8``).

An FP8 cache holds float8_e4m3fn, one byte an element. Each attention layer has two
per-tensor scales, ``k_scale`` and ``v_scale`` (floats, 1.0 unless the checkpoint brings
them); a key ``k`` and a value ``v`` (of the model's dtype) are stored and read back as::

    stored = round_e4m3(clamp(k / k_scale, -448, 448))      write (float32 arithmetic)
    read   = stored * k_scale                               read  (float32, then the
                                                                   query's dtype)

(and likewise ``v`` with ``v_scale``). A cache of any other dtype stores ``k`` and ``v``
cast to it and ignores the scales. The torch reference backend does exactly this; the
Triton kernels (``triton_common.to_cache``) do the same on write and fold the scales into
the softmax scale and the output on read.
"""

from __future__ import annotations

import torch

from pagedllm.quantization.fp8 import FP8_DTYPE, FP8_MAX

KV_CACHE_TORCH_DTYPES = {"fp8": FP8_DTYPE}


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for ``--kv-cache-dtype`` (``"auto"``: the model's)."""
    return model_dtype if cache_dtype == "auto" else KV_CACHE_TORCH_DTYPES[cache_dtype]


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it (see the module docstring)."""
    if cache_dtype != FP8_DTYPE:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V as ``dtype`` values (see the module docstring)."""
    if cached.dtype != FP8_DTYPE:
        return cached.to(dtype)
    return (cached.float() * scale).to(dtype)


def cache_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales a kernel applies to ``cache``: ``(k_scale, v_scale)`` for an FP8 cache,
    ``(1.0, 1.0)`` for any other (which stores values as they are)."""
    return (float(k_scale), float(v_scale)) if is_fp8(cache) else (1.0, 1.0)
