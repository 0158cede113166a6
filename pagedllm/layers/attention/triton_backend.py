"""The Triton attention backend: paged KV writes, varlen prefill and split-K decode kernels.

One step runs at most three launches per layer::

    write_kv_cache           new K/V -> their slots (slot -1 skipped); with ``rotary``,
                             rotate_and_write_kv also applies the rope to q and k
    paged_prefill_attention  sequences with query_len > 1 (skipped when max_query_len == 1)
    paged_decode_attention   sequences with query_len == 1 (skipped when the step has none)

In a step with prompts, the write may also keep the step's keys and values as the cache
holds them in contiguous rows (``triton_prefill.new_kv_rows_dtype``: over an FP8 cache by
default), from which prefill attention reads the new keys instead of the pages; with
``PAGEDLLM_PREFILL_CONTEXT_ROWS=1`` long chunks' cached contexts are then widened into
more rows once a step (``triton_prefill.plan_context_rows``; not inside a
CUDA graph capture, whose host lists describe the capture, not a replay).

A step's long prompt chunks (``dense_prefill.select``) attend through a library's fused
attention instead (``dense_prefill``: cuDNN's on Hopper by default, set by
``PAGEDLLM_DENSE_PREFILL``), after the same cache write; the prefill kernel skips them
(their ``seq_lens`` given as 0) and takes the step's other prompts, the decode kernel its
decodes.

With ``rotary`` the decode launch ropes and caches its own sequences' new tokens
(``triton_decode.NewKV``), so a step of decodes alone runs one launch per layer, a launch
less where a small batch is bound by launch latency. In a step with prompts, the write
kernel ropes and caches every row first (the decode rows too: the decode launch then
stores their key and value again), so decodes run the same kernel variant in every step,
the one the decode CUDA graphs compile. In a step of decodes alone the queries, keys and
values may come as an FP8 product's sums (``sums``, ``takes_sums``), which the decode
launch scales as it reads them.

A model's last layer may pass the step's ``OutputRows`` (the rows whose logits are
sampled): every row is cached as above (rope included), then the output rows alone attend,
through the decode kernel, each as its sequence's one query over the context just cached;
a prompt chunk that samples nothing attends not at all there.

Both attention kernels take the whole batch and each leaves the other's sequences alone,
so a mixed step (prefill chunks beside decodes) needs no reordering or index copies. Rows
past ``num_actual_tokens`` (padding to a captured shape) are zero in the output.

What each launch does depends on host integers only (``num_actual_tokens``,
``max_query_len``, ``max_seq_len``, the number of sequences and whether any has query
length 1), never on device values, so a decode step can be captured in a CUDA graph; a
graph captured with ``max_seq_len`` at its largest value stays correct for shorter contexts.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from pagedllm.layers.attention import dense_prefill
from pagedllm.layers.attention.backend import AttentionMetadata, OutputRows, SumsScales
from pagedllm.layers.attention.kv_quant import paged_kv_views
from pagedllm.layers.attention.triton_decode import (
    NewKV,
    longest_first,
    paged_decode_attention,
    wants_longest_first,
)
from pagedllm.layers.attention.triton_kv_write import rotate_and_write_kv, write_kv_cache
from pagedllm.layers.attention.triton_prefill import (
    ContextRows,
    new_kv_rows_dtype,
    paged_prefill_attention,
    plan_context_rows,
    widen_context_rows,
    widens_contexts,
)
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.triton_ops import fused_ops_enabled

T = TypeVar("T")


class TritonAttentionBackend:
    """Implements ``AttentionBackend`` with Triton kernels (see the module docstring).

    Works for fp16, bf16 and fp32 queries; the cache may have another dtype (values are cast
    on write and on read; an FP8 cache is scaled by the layer's ``k_scale`` / ``v_scale``,
    see ``triton_common``). The step's routing (does it hold decodes?) is derived once per
    metadata object and reused by every layer, and so is the order in which large decode
    batches start their sequences (longest first, ``triton_decode.longest_first``).
    """

    name = "triton"

    def __init__(self) -> None:
        # What each layer of a step would derive alike: name -> (metadata, key, value).
        self._per_step: dict[str, tuple[AttentionMetadata, object, object]] = {}

    def _once_per_step(self, name: str, metadata: AttentionMetadata, key: object,
                       compute: Callable[[], T]) -> T:
        """``compute()`` by the step's first layer, kept for the others: again whenever
        another metadata object, or other host values (``key``), come."""
        cached = self._per_step.get(name)
        if cached is None or cached[0] is not metadata or cached[1] != key:
            cached = self._per_step[name] = (metadata, key, compute())
        return cached[2]

    def _context_rows(self, metadata: AttentionMetadata,
                      device: torch.device) -> ContextRows | None:
        """The step's widened contexts (``plan_context_rows``)."""
        qsl, seq_lens, n = (metadata.query_start_loc_cpu, metadata.seq_lens_cpu,
                            metadata.num_actual_tokens)
        return self._once_per_step(
            "context rows", metadata, (tuple(qsl), tuple(seq_lens), n),
            lambda: plan_context_rows(qsl, seq_lens, n, device))

    def _decode_order(self, metadata: AttentionMetadata, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """The step's decode start order. A CUDA graph's capture reuses the metadata of its
        eager warm-up run, so the order is recomputed inside the capture: the graph must
        hold the kernel that writes it, not a buffer from outside."""
        capturing = seq_lens.is_cuda and torch.cuda.is_current_stream_capturing()
        return self._once_per_step(
            "decode order", metadata, capturing,
            lambda: longest_first(seq_lens) if wants_longest_first(metadata.num_seqs) else None)

    def _num_prompts(self, metadata: AttentionMetadata) -> int:
        """The step's sequences of query length above 1."""
        qsl = metadata.query_start_loc_cpu
        return self._once_per_step(
            "prompts", metadata, tuple(qsl),
            lambda: sum(qsl[b + 1] - qsl[b] > 1 for b in range(metadata.num_seqs)))

    def _kernel_seq_lens(self, metadata: AttentionMetadata, seqs: tuple[int, ...],
                         device: torch.device) -> torch.Tensor:
        """The step's ``seq_lens`` with those of ``seqs`` (taken by ``dense_prefill``) set to
        0, which the prefill kernel skips; uploaded once a step (through pinned memory on
        CUDA: no wait for the stream)."""
        def upload() -> torch.Tensor:
            lens = torch.tensor(metadata.seq_lens_cpu, dtype=torch.int32)
            lens[list(seqs)] = 0
            return (lens.pin_memory().to(device, non_blocking=True) if device.type == "cuda"
                    else lens.to(device))

        return self._once_per_step("kernel seq_lens", metadata, seqs, upload)

    def _step_has_decodes(self, metadata: AttentionMetadata) -> bool:
        if metadata.max_query_len == 1:
            return True
        if metadata.has_decodes is not None:
            return metadata.has_decodes
        qsl = metadata.query_start_loc_cpu
        return self._once_per_step(
            "has decodes", metadata, tuple(qsl),
            lambda: any(qsl[b + 1] - qsl[b] == 1 for b in range(metadata.num_seqs)))

    @staticmethod
    def takes_sums(metadata: AttentionMetadata) -> bool:
        """A step of decodes alone, with the fused ops on: the decode launch ropes and
        caches the new tokens, and scales the sums as it reads them (``NewKV.sums``)."""
        return metadata.max_query_len == 1 and fused_ops_enabled()

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
        """See ``AttentionBackend.forward``."""
        if sums is not None and (rotary is None or outputs is not None
                                 or not self.takes_sums(metadata)):
            raise ValueError("Sums for attention come with rotary, without outputs, in a "
                             "step of decodes alone (takes_sums).")
        num_tokens = query.shape[0]
        n = metadata.num_actual_tokens
        key_cache, value_cache = paged_kv_views(kv_cache)
        if rotary is not None and not fused_ops_enabled():  # PAGEDLLM_FUSED_OPS=0: torch rope
            query, key = (RotaryEmbedding.apply(x, *rotary) for x in (query, key))
            rotary = None
        if outputs is not None:
            return self._attend_outputs(query, key, value, key_cache, value_cache, metadata,
                                        outputs, scale, sliding_window, rotary, k_scale,
                                        v_scale, logits_soft_cap)
        new_kv = None
        prefill_query = query
        dense = (dense_prefill.select(query, key_cache, metadata, sliding_window, logits_soft_cap)
                 if metadata.max_query_len > 1 else ())
        kernel_prompts = metadata.max_query_len > 1 and (
            not dense or len(dense) < self._num_prompts(metadata))
        rows_dtype = (new_kv_rows_dtype(query.dtype, key_cache.dtype, sliding_window)
                      if kernel_prompts else None)
        capturing = key.is_cuda and torch.cuda.is_current_stream_capturing()
        context = None
        if rows_dtype is not None and widens_contexts() and not capturing:
            context = self._context_rows(metadata, key.device)
        new_rows = (None if rows_dtype is None else torch.empty(
            (2, n if context is None else context.rows_needed, *key.shape[1:]),
            dtype=rows_dtype, device=key.device))
        if rotary is None:
            write_kv_cache(key[:n], value[:n], key_cache, value_cache, metadata.slot_mapping[:n],
                           k_scale, v_scale, fresh=new_rows)
        else:
            new_kv = NewKV(key, value, metadata.slot_mapping, *rotary, n, sums)
            if metadata.max_query_len > 1:
                prefill_query = rotate_and_write_kv(
                    query, key, value, *rotary, key_cache, value_cache, metadata.slot_mapping, n,
                    k_scale, v_scale, fresh=new_rows,
                )

        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if num_tokens > n:
            out[n:].zero_()
        num_seqs = metadata.num_seqs
        if n == 0 or num_seqs == 0:
            return out
        query_start_loc = metadata.query_start_loc[: num_seqs + 1]
        seq_lens = metadata.seq_lens[:num_seqs]
        block_tables = metadata.block_tables[:num_seqs]
        has_decodes = self._step_has_decodes(metadata)
        if context is not None:
            widen_context_rows(key_cache, value_cache, block_tables, context, new_rows)
        if dense:
            try:
                dense_prefill.dense_prefill(prefill_query, key_cache, value_cache, block_tables,
                                            metadata, dense, scale, out, k_scale, v_scale)
            except RuntimeError as error:
                dense_prefill.refused(error)
                dense, kernel_prompts = (), True
        if kernel_prompts:
            paged_prefill_attention(
                prefill_query, key_cache, value_cache, block_tables,
                self._kernel_seq_lens(metadata, dense, key.device) if dense else seq_lens,
                query_start_loc, out,
                num_tokens=n,
                max_query_len=metadata.max_query_len,
                scale=scale,
                sliding_window=sliding_window,
                skip_decodes=has_decodes,
                k_scale=k_scale,
                v_scale=v_scale,
                logits_soft_cap=logits_soft_cap,
                new_kv=new_rows,
                context_rows=None if context is None else context.starts,
            )
        if has_decodes:
            paged_decode_attention(
                query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
                max_seq_len=metadata.max_seq_len,
                scale=scale,
                sliding_window=sliding_window,
                order=self._decode_order(metadata, seq_lens),
                new_kv=new_kv,
                k_scale=k_scale,
                v_scale=v_scale,
                logits_soft_cap=logits_soft_cap,
            )
        return out

    def _attend_outputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        outputs: OutputRows,
        scale: float,
        sliding_window: int | None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        k_scale: float,
        v_scale: float,
        logits_soft_cap: float | None,
    ) -> torch.Tensor:
        """Every row's key and value into the cache, then the output rows alone through the
        decode kernel, each its sequence's one query over the context just cached. With
        ``rotary`` the decode launch ropes its rows' queries and caches their keys again,
        as in a decode step: the kernel variant the decode graphs compile."""
        n = metadata.num_actual_tokens
        rows = outputs.indices
        layout = outputs.metadata
        new_kv = None
        if rotary is None:
            write_kv_cache(key[:n], value[:n], key_cache, value_cache, metadata.slot_mapping[:n],
                           k_scale, v_scale)
        else:
            rotate_and_write_kv(query, key, value, *rotary, key_cache, value_cache,
                                metadata.slot_mapping, n, k_scale, v_scale)
            cos, sin = rotary
            new_kv = NewKV(key[rows], value[rows], layout.slot_mapping, cos[rows], sin[rows],
                           layout.num_actual_tokens)
        out = torch.empty((layout.num_actual_tokens, *query.shape[1:]), dtype=query.dtype,
                          device=query.device)
        if layout.num_seqs:
            seq_lens = layout.seq_lens
            paged_decode_attention(
                query[rows], key_cache, value_cache, layout.block_tables, seq_lens,
                layout.query_start_loc, out,
                max_seq_len=layout.max_seq_len,
                scale=scale,
                sliding_window=sliding_window,
                order=longest_first(seq_lens) if wants_longest_first(layout.num_seqs) else None,
                new_kv=new_kv,
                k_scale=k_scale,
                v_scale=v_scale,
                logits_soft_cap=logits_soft_cap,
            )
        return out
