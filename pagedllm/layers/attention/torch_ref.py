"""The torch reference attention backend: paged KV writes, then SDPA over gathered blocks.

Correct for any mix of prefill chunks (with or without cached context) and decodes, on
any device; the exactness oracle for faster backends and what the CPU runs. Shapes come
from the metadata's host lists, so it never waits on the device.

One step, ``B`` sequences, vectorised over all of them::

    new K/V [T, Hkv, D] --at (slot // page, slot % page)--> paged_kv_views(kv_cache)[0|1]

    queries  [T, H, D]        -> padded [B, H, max_q, D]     (row i of seq b at b*max_q + i)
    context  block_tables[b]  -> gathered [B, Hkv, max_kv, D] (token p at index p)
    mask[b, i, j] = j <= pos(b, i)  and  j > pos(b, i) - window     pos = seq_len - q_len + i
    SDPA(q, k, v, mask) -> unpadded [T, H, D]

Cache slots past a sequence's length are never trusted: gathered K/V there are zeroed, so
stale or uninitialised memory (even NaN) cannot reach the output.

The cache may have another dtype than the queries: K/V are stored and read back as
``kv_quant.py`` says (an FP8 cache divides by the layer's ``k_scale`` / ``v_scale`` on
write and multiplies on read, in float32), then attended in the queries' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.layers.attention.backend import AttentionMetadata, OutputRows, SumsScales
from pagedllm.layers.attention.kv_quant import (
    dequantize_kv, paged_kv_views, quantize_kv, values_slot_major,
)
from pagedllm.layers.rotary import RotaryEmbedding


@dataclass
class _BatchPlan:
    """Index tensors derived once per step from the metadata and shared by every layer."""

    num_seqs: int
    max_query_len: int
    max_seq_len: int
    pad_index: torch.Tensor  # [num_actual_tokens] int64: row of each token in [B * max_q]
    block_ids: torch.Tensor  # [B, ceil(max_kv / block_size)] int64
    kv_valid: torch.Tensor  # [B, max_kv] bool: key index < seq_len
    q_valid: torch.Tensor  # [B, max_q] bool: query row holds a real token
    q_pos: torch.Tensor  # [B, max_q] int64: absolute position of each query row
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[B, 1, max_q, max_kv]`` bool, True where the query may attend the key."""
        if sliding_window not in self.masks:
            device = self.q_pos.device
            j = torch.arange(self.max_seq_len, device=device)[None, None, :]
            pos = self.q_pos[:, :, None]
            allowed = j <= pos
            if sliding_window is not None:
                allowed &= j > pos - sliding_window
            # Padded query rows see key 0 only, so their softmax stays finite (and unused).
            allowed = torch.where(self.q_valid[:, :, None], allowed, j == 0)
            self.masks[sliding_window] = allowed[:, None]
        return self.masks[sliding_window]


def _build_plan(metadata: AttentionMetadata) -> _BatchPlan:
    qsl_cpu = metadata.query_start_loc_cpu
    seq_lens_cpu = metadata.seq_lens_cpu
    num_seqs = len(seq_lens_cpu)
    max_q = max(qsl_cpu[b + 1] - qsl_cpu[b] for b in range(num_seqs))
    max_kv = max(seq_lens_cpu)
    num_tokens = qsl_cpu[-1]
    device = metadata.query_start_loc.device

    qsl = metadata.query_start_loc[: num_seqs + 1].long()
    seq_lens = metadata.seq_lens[:num_seqs].long()
    query_lens = qsl[1:] - qsl[:-1]
    tokens = torch.arange(num_tokens, device=device)
    seq_of_token = torch.searchsorted(qsl[1:], tokens, right=True)
    pad_index = seq_of_token * max_q + (tokens - qsl[seq_of_token])

    i = torch.arange(max_q, device=device)[None, :]
    q_valid = i < query_lens[:, None]
    q_pos = (seq_lens - query_lens)[:, None] + i
    kv_valid = torch.arange(max_kv, device=device)[None, :] < seq_lens[:, None]
    num_blocks = -(-max_kv // metadata.block_size)
    block_ids = metadata.block_tables[:num_seqs, :num_blocks].long()
    return _BatchPlan(num_seqs, max_q, max_kv, pad_index, block_ids, kv_valid, q_valid, q_pos)


class TorchReferenceBackend:
    """Implements ``AttentionBackend`` with plain torch ops (see the module docstring).

    The metadata of a step is treated as immutable: the derived index tensors are built on
    the first layer and reused by the others while the same metadata object is passed.
    """

    name = "torch_ref"

    def __init__(self) -> None:
        self._plan_source: tuple[AttentionMetadata, list[int], list[int]] | None = None
        self._plan: _BatchPlan | None = None

    def _plan_for(self, metadata: AttentionMetadata) -> _BatchPlan:
        source = self._plan_source
        if (
            source is None
            or source[0] is not metadata
            or source[1] != metadata.query_start_loc_cpu
            or source[2] != metadata.seq_lens_cpu
        ):
            self._plan = _build_plan(metadata)
            self._plan_source = (
                metadata, list(metadata.query_start_loc_cpu), list(metadata.seq_lens_cpu)
            )
        assert self._plan is not None
        return self._plan

    @staticmethod
    def takes_sums(metadata: AttentionMetadata) -> bool:
        return False

    @staticmethod
    def write_kv(
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Store ``key/value: [n, Hkv, D]`` at ``slot_mapping: [n]`` of the paged cache
        (quantized with ``k_scale`` / ``v_scale`` when the cache is FP8)."""
        _, _, page, num_kv_heads, head_dim = kv_cache.shape
        slots = slot_mapping.long()
        # Bytes are copied as such: the CPU has no index_copy_ for float8.
        raw = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache
        for cache, x, scale in zip(paged_kv_views(raw), (key, value), (k_scale, v_scale)):
            stored = quantize_kv(x, scale, kv_cache.dtype)
            if raw is not kv_cache:
                stored = stored.view(torch.uint8)
            if values_slot_major(cache):
                cache[slots // page, slots % page] = stored
            else:  # slot rows: one copy of whole rows
                cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, stored)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        logits_soft_cap: float | None = None,
        outputs: OutputRows | None = None,
        sums: SumsScales | None = None,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``. Rows past ``num_actual_tokens`` (padding) are
        neither written to the cache nor attended; their output is zero.
        ``logits_soft_cap``: scores become ``cap * tanh(scores / cap)`` before the mask
        and softmax (Gemma 2)."""
        if sums is not None:
            raise ValueError("The torch reference backend takes no sums (takes_sums).")
        if rotary is not None:
            query, key = (RotaryEmbedding.apply(x, *rotary) for x in (query, key))
        n = metadata.num_actual_tokens
        self.write_kv(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n], k_scale, v_scale)
        if outputs is not None:
            query, metadata = query[outputs.indices], outputs.metadata
        return self._attend_cached(query, kv_cache, metadata, scale, sliding_window,
                                   k_scale, v_scale, logits_soft_cap)

    def _attend_cached(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        k_scale: float,
        v_scale: float,
        logits_soft_cap: float | None,
    ) -> torch.Tensor:
        """Attention of ``query`` (laid out by ``metadata``) over keys already cached."""
        num_tokens, num_heads, head_dim = query.shape
        n = metadata.num_actual_tokens
        if metadata.num_seqs == 0:
            return query.new_zeros(query.shape)
        plan = self._plan_for(metadata)
        batch, max_q, max_kv = plan.num_seqs, plan.max_query_len, plan.max_seq_len

        q = query.new_zeros(batch * max_q, num_heads, head_dim)
        q[plan.pad_index] = query[:n]
        q = q.view(batch, max_q, num_heads, head_dim).transpose(1, 2)

        valid = plan.kv_valid[:, None, :, None]
        k, v = (
            dequantize_kv(
                cache[plan.block_ids]  # [B, blocks, block_size, Hkv, D]
                .flatten(1, 2)[:, :max_kv]
                .transpose(1, 2),  # [B, Hkv, max_kv, D]
                scale, query.dtype,
            )
            for cache, scale in zip(paged_kv_views(kv_cache), (k_scale, v_scale))
        )
        k = torch.where(valid, k, 0)
        v = torch.where(valid, v, 0)

        out = attend(q, k, v, plan.mask(sliding_window), scale, logits_soft_cap)
        out = out.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)[plan.pad_index]
        if num_tokens == n:
            return out
        padded = query.new_zeros(num_tokens, num_heads, head_dim)
        padded[:n] = out
        return padded


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           scale: float, logits_soft_cap: float | None = None) -> torch.Tensor:
    """``softmax(scale * q k^T masked) v`` over ``q [B, H, Lq, D]``, ``k/v [B, Hkv, Lk, D]``
    and a boolean ``mask`` broadcast to ``[B, H, Lq, Lk]``; with ``logits_soft_cap`` the
    scaled scores pass through ``cap * tanh(s / cap)`` first (then written out by hand:
    SDPA has no such step)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if logits_soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=num_heads != num_kv_heads)
    group = num_heads // num_kv_heads
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def causal_attention_without_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """All ``T`` tokens as one sequence at positions ``0..T-1``, no KV cache involved.

    ``query: [T, H, D]``, ``key/value: [T, Hkv, D]`` -> ``[T, H, D]``. Used for runs with no
    attention metadata (the memory-profiling pass before the KV cache exists).
    """
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))
    if logits_soft_cap is not None:
        pos = torch.arange(query.shape[0], device=query.device)
        mask = pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= pos[None, :] > pos[:, None] - sliding_window
        out = attend(q, k, v, mask, scale, logits_soft_cap)
    elif sliding_window is None:
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    else:
        pos = torch.arange(query.shape[0], device=query.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    return out[0].transpose(0, 1)
