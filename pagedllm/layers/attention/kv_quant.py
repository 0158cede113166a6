"""What the paged KV cache stores: the model's dtype, or FP8 (``--kv-cache-dtype fp8``).

An FP8 cache holds float8_e4m3fn, one byte an element. Each attention layer has two
per-tensor scales, ``k_scale`` and ``v_scale`` (floats, 1.0 unless the checkpoint brings
them); a key ``k`` and a value ``v`` (of the model's dtype) are stored and read back as::

    stored = round_e4m3(clamp(k / k_scale, -448, 448))      write (float32 arithmetic;
                                                                   NaN stored as 0)
    read   = stored * k_scale                               read  (float32, then the
                                                                   query's dtype)

(and likewise ``v`` with ``v_scale``). A cache of any other dtype stores ``k`` and ``v``
cast to it and ignores the scales. The torch reference backend does exactly this; the
Triton kernels (``triton_common.to_cache``) do the same on write and fold the scales into
the softmax scale and the output on read.

Layout: one layer's cache is one tensor ``[2, blocks, page, Hkv, D]`` (keys, then values)
and ``paged_kv_views`` gives the two halves as ``[blocks, page, Hkv, D]`` views. Keys are
slot rows; the values of an FP8 cache are slot-major (each block's bytes ``[Hkv, D,
page]``), every other cache keeps slot rows for both. Every reader and writer takes the
halves from ``paged_kv_views``, so a cache's bytes mean the same to every backend.

An FP8 cache holds finite values only (it starts zeroed; writes store NaN as 0 and clamp
the rest), so reading a slot nobody wrote is harmless wherever its weight is zero: a
slot-major value tile is read a whole page at a time, past the sequence's last token.
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
    return (x.float() / scale).nan_to_num_(0.0).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V as ``dtype`` values (see the module docstring)."""
    if cached.dtype != FP8_DTYPE:
        return cached.to(dtype)
    return (cached.float() * scale).to(dtype)


def cache_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales a kernel applies to ``cache``: ``(k_scale, v_scale)`` for an FP8 cache,
    ``(1.0, 1.0)`` for any other (which stores values as they are)."""
    return (float(k_scale), float(v_scale)) if is_fp8(cache) else (1.0, 1.0)


def values_slot_major(value_cache: torch.Tensor) -> bool:
    """Whether ``value_cache: [blocks, page, Hkv, D]`` is stored slot-major: each (block,
    head, d) holds its page's slots contiguous (a block is ``[Hkv, D, page]``), the layout
    ``paged_kv_views`` gives an FP8 cache."""
    _, page, _, dim = value_cache.shape
    return page > 1 and value_cache.stride()[1:] == (1, dim * page, page)


def paged_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value caches, each ``[blocks, page, Hkv, D]``, in one layer's cache
    ``[2, blocks, page, Hkv, D]``. Keys are slot rows (a slot's ``Hkv x D`` contiguous). The
    values of an FP8 cache are slot-major (``values_slot_major``): attention sums the
    values along the slots, and tensor cores take 8-bit operands only contiguous along the
    summed dimension (16-bit ones are transposed as loaded; 8-bit slot rows would be read
    from shared memory a byte at a time). Other caches keep slot rows for both. Kernels
    read which layout they have from these strides alone."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    # By element size, not dtype: the torch reference copies an FP8 cache's bytes as uint8.
    if value_cache.element_size() == 1 and value_cache.shape[1] > 1:
        _, page, _, dim = value_cache.shape
        value_cache = value_cache.as_strided(
            value_cache.shape, (value_cache.stride(0), 1, dim * page, page))
    return key_cache, value_cache
