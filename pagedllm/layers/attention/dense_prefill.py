"""Fresh prompts' attention through torch's fused attention (cuDNN or FlashAttention).

A prompt step whose every sequence starts at position 0 (``seq_len == query_len``: no
cached prefix, no earlier chunk) attends only over the step's own keys: a dense causal
attention per sequence, with no page table. torch's ``scaled_dot_product_attention`` runs
it with library kernels built for each GPU (cuDNN's and FlashAttention's on Hopper), an
alternative to the Triton prefill kernel for long prompts.

``PAGEDLLM_DENSE_PREFILL`` chooses (read at import; ``DENSE_PREFILL`` may be reassigned):

    off        the Triton prefill kernel for every prompt (the default)
    auto       torch's own choice of backend
    cudnn | flash | efficient | math    that torch backend only

The path is taken only where it computes what the Triton kernel computes: every sequence of
the step fresh, the longest at least ``MIN_TOKENS`` tokens, no sliding window and no soft
cap, the cache in the queries' dtype (an FP8 cache's prompts attend over the quantized
keys, as the kernel reads them back), and never while a CUDA graph is captured (the host
lists describe the capture's layout, not a replay's). The keys still go to the paged cache
first: later steps read them there.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedllm.layers.attention.backend import AttentionMetadata

_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
CHOICES = ("off", "auto", *_BACKENDS)

# Prompts shorter than this stay on the Triton kernel: one launch serves a whole batch of
# them, where this path launches once per sequence.
MIN_TOKENS = 2048


def _setting() -> str:
    value = os.environ.get("PAGEDLLM_DENSE_PREFILL", "off").strip().lower() or "off"
    if value not in CHOICES:
        raise ValueError(f"PAGEDLLM_DENSE_PREFILL={value!r}: give one of {', '.join(CHOICES)} "
                         "(torch's fused attention for fresh prompts; off by default).")
    return value


DENSE_PREFILL = _setting()


def applies(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
            sliding_window: int | None, logits_soft_cap: float | None) -> bool:
    """Whether this step's prompts go through ``dense_prefill`` (see the module docstring)."""
    if DENSE_PREFILL == "off" or sliding_window is not None or logits_soft_cap:
        return False
    if metadata.max_query_len < MIN_TOKENS or kv_cache.dtype != query.dtype:
        return False
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    qsl = metadata.query_start_loc_cpu
    return (qsl[-1] == metadata.num_actual_tokens
            and all(qsl[b + 1] - qsl[b] == seq_len
                    for b, seq_len in enumerate(metadata.seq_lens_cpu)))


def dense_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  metadata: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Causal attention of each fresh sequence over its own keys, into ``out[rows]``.

    ``query: [T, H, D]`` and ``key, value: [T, Hkv, D]``, rotated; ``H`` a multiple of
    ``Hkv`` (grouped queries share a key head)."""
    groups = query.shape[1] // key.shape[1]
    backends = list(_BACKENDS.values()) if DENSE_PREFILL == "auto" else [_BACKENDS[DENSE_PREFILL]]
    qsl = metadata.query_start_loc_cpu
    with sdpa_kernel(backends):
        for start, end in zip(qsl, qsl[1:]):
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            if groups > 1:
                k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            out[start:end].copy_(o[0].transpose(0, 1))
