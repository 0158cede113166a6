"""Sizing and allocating the paged KV cache.

Number of blocks, in order of precedence:
1. ``num_kv_blocks`` when given;
2. on CUDA: ``gpu_memory_utilization * total_memory - peak memory of a profile run``
   (weights + the activations of the largest step) ``- reserved_bytes`` (the CUDA graphs'
   memory pool, captured after the cache exists), divided by the bytes of one block;
3. on the CPU: ``kv_cache_memory_gb`` GiB divided by the bytes of one block.
Either memory-based sizing stops at what ``max_num_seqs`` requests of ``max_model_len``
tokens can ever use: the cache is zeroed up front, so a surplus would only cost start-up
time (and, on a GPU, memory other processes could use).

One block holds ``block_size`` tokens of K and V for every layer::

    bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from pagedllm.config import EngineConfig

_GIB = 1 << 30


def bytes_per_block(config: EngineConfig, dtype: torch.dtype) -> int:
    m = config.model_config
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * m.num_layers * config.cache_config.block_size * m.num_kv_heads * m.head_dim * element


def determine_num_blocks(
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    profile_run: Callable[[], None],
    reserved_bytes: int = 0,
) -> int:
    """Blocks for the KV cache; raises if one ``max_model_len`` request would not fit.

    ``reserved_bytes`` (CUDA only) is memory that must stay free beside the cache.
    """
    cache = config.cache_config
    per_block = bytes_per_block(config, dtype)
    usable = config.scheduler_config.max_num_seqs * math.ceil(
        config.model_config.max_model_len / cache.block_size)
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
        source = f"num_kv_blocks={num_blocks}"
    elif device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile_run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        _, total = torch.cuda.mem_get_info(device)
        available = int(total * cache.gpu_memory_utilization) - peak - reserved_bytes
        num_blocks = min(max(available // per_block, 0), usable)
        source = (
            f"gpu_memory_utilization={cache.gpu_memory_utilization} "
            f"({available / _GIB:.2f} GiB left after weights, activations"
            f"{' and CUDA graphs' if reserved_bytes else ''})"
        )
    else:
        num_blocks = min(int(cache.kv_cache_memory_gb * _GIB) // per_block, usable)
        source = f"kv_cache_memory_gb={cache.kv_cache_memory_gb}"

    max_model_len = config.model_config.max_model_len
    needed = math.ceil(max_model_len / cache.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"The KV cache holds {num_blocks * cache.block_size} tokens ({num_blocks} blocks, "
            f"from {source}) but one request of max_model_len={max_model_len} needs "
            f"{needed * cache.block_size}: lower --max-model-len, or give the cache more memory "
            "(--gpu-memory-utilization on GPU, --kv-cache-memory-gb on CPU, or --num-kv-blocks)."
        )
    return num_blocks


def allocate_kv_caches(
    config: EngineConfig, num_blocks: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer."""
    m = config.model_config
    shape = (2, num_blocks, config.cache_config.block_size, m.num_kv_heads, m.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(m.num_layers)]
