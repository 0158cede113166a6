"""Random paged-attention steps for the kernel tests, on the CUDA device when there is one."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagedllm.layers.attention.backend import AttentionMetadata
from pagedllm.quantization.fp8 import FP8_DTYPE
from pagedllm.layers.attention.torch_ref import TorchReferenceBackend
from pagedllm.layers.attention.kv_quant import paged_kv_views
from tests.utils import make_attention_metadata, make_kv_caches

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Triton 3.6's interpreter stores bfloat16 as uint16 and multiplies those raw bits in
# tl.dot, so bf16 kernels are checked only on a GPU.
HALF_DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(
        torch.bfloat16, id="bf16",
        marks=pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 tl.dot is wrong in the interpreter"),
    ),
]

# Tolerances against the fp32 reference, per dtype of the kernels' inputs.
TOLERANCE = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
    torch.bfloat16: dict(rtol=4e-2, atol=4e-2),
}


@dataclass
class PagedStep:
    """One step: ``kv_cache`` holds each sequence's cached context (earlier steps) in
    shuffled blocks and NaN everywhere else; ``key/value`` are the step's new tokens."""

    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor  # [T, Hkv, D]
    spare_block: int  # a block no sequence owns

    def to(self, dtype: torch.dtype) -> PagedStep:
        """The step in ``dtype``; an FP8 cache keeps its dtype (and its bytes)."""
        cache = self.kv_cache if self.kv_cache.dtype == FP8_DTYPE else self.kv_cache.to(dtype)
        return PagedStep(
            cache, self.metadata, self.query.to(dtype),
            self.key.to(dtype), self.value.to(dtype), self.spare_block,
        )


def make_step(
    seqs: tuple[tuple[int, int], ...],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedStep:
    """A step over ``seqs = ((cached_tokens, new_tokens), ...)``; blocks are handed out in
    a random order so neighbouring positions rarely share neighbouring blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = sum(-(-(c + n) // block_size) for c, n in seqs)
    num_blocks = blocks_needed + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    spare_block = order.pop()
    cache = make_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim)[0]
    tables = []
    for cached, new in seqs:
        table = [order.pop() for _ in range(-(-(cached + new) // block_size))]
        context = torch.randn(2, cached, num_kv_heads, head_dim, generator=gen)
        for pos in range(cached):
            cache[:, table[pos // block_size], pos % block_size] = context[:, pos]
        tables.append(table)
    metadata = make_attention_metadata(
        tables, [c + n for c, n in seqs], [n for _, n in seqs], block_size, device=DEVICE
    )
    num_tokens = metadata.num_actual_tokens
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    step = PagedStep(
        cache.to(DEVICE), metadata, query.to(DEVICE), key.to(DEVICE), value.to(DEVICE),
        spare_block,
    )
    return step.to(dtype)


def on_fp8_grid(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` moved to the nearest value that an FP8 cache of ``scale`` stores exactly
    (``e4m3(x / scale) * scale``, float32; ``scale`` a power of two keeps it exact).

    Triton 3.6's interpreter rounds float32 -> float8e4nv wrongly where a value rounds up
    across a power of two (7.93 becomes 4.0) and flushes subnormals, so the kernels are
    checked on CPU with keys and values that need no rounding at all."""
    return (x.float() / scale).to(FP8_DTYPE).float() * scale


def make_fp8_step(seqs: tuple[tuple[int, int], ...], *, k_scale: float, v_scale: float,
                  dtype: torch.dtype = torch.float32, **kwargs) -> PagedStep:
    """``make_step`` with an FP8 cache: the cached context and the step's new keys and
    values all lie on the FP8 grid of ``k_scale`` / ``v_scale``. Unwritten slots hold 448,
    not NaN: an FP8 cache holds finite values only (``kv_quant``), and the value tiles of
    its kernels read the rest of a sequence's last page, weighted zero; a slot weighted
    wrongly still shows."""
    step = make_step(seqs, **kwargs)
    key, value = on_fp8_grid(step.key, k_scale), on_fp8_grid(step.value, v_scale)
    cache = torch.empty(step.kv_cache.shape, dtype=FP8_DTYPE, device=step.kv_cache.device)
    for view, stored, scale in zip(paged_kv_views(cache), step.kv_cache, (k_scale, v_scale)):
        view.copy_((stored / scale).nan_to_num(448.0).to(FP8_DTYPE))
    return PagedStep(cache, step.metadata, step.query.to(dtype), key.to(dtype), value.to(dtype),
                     step.spare_block)


def reference_attention(
    step: PagedStep, scale: float, window: int | None, k_scale: float = 1.0,
    v_scale: float = 1.0, logits_soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, kv_cache after the step) of the torch reference backend, computed in fp32
    (over the FP8 cache itself when the step has one)."""
    fp32 = step.to(torch.float32)
    cache = fp32.kv_cache.clone()
    out = TorchReferenceBackend().forward(
        fp32.query, fp32.key, fp32.value, cache, step.metadata, scale, window,
        k_scale=k_scale, v_scale=v_scale, logits_soft_cap=logits_soft_cap,
    )
    return out, cache


def batch_args(step: PagedStep) -> tuple[torch.Tensor, ...]:
    """The batch-description tensors the attention kernels take, in their order."""
    md = step.metadata
    return md.block_tables, md.seq_lens, md.query_start_loc
