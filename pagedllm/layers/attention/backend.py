"""The attention backend interface and the per-step forward context.

The model keeps the two-argument signature ``model(input_ids, positions)``; everything
attention needs for the step travels in a ``ForwardContext`` set by the model runner
around the forward pass (``with set_forward_context(...)``), which keeps the model code free
of batching details and makes CUDA-graph capture simple.

A step's batch is flat: ``T`` new tokens from ``B`` sequences, sequence ``b`` owning rows
``query_start_loc[b] : query_start_loc[b + 1]``. Prefill chunks and decodes mix freely.

KV cache layout, one tensor per layer, of the model's dtype or float8_e4m3fn
(``--kv-cache-dtype fp8``, see ``kv_quant.py``)::

    kv_cache[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]
                      ^ 0 = keys, 1 = values

    slot = block_id * block_size + offset_in_block

Sequence ``b`` has ``seq_lens[b]`` tokens of context after this step (cached + new); its
token at absolute position ``p`` lives in block ``block_tables[b, p // block_size]`` at
offset ``p % block_size``. Its new tokens are the last ``query_len`` of those positions.

Only some rows' hidden states may leave the model: those whose logits are sampled. A step
may then carry ``OutputRows`` in its context, and the model's last decoder layer (what
follows its attention is row-wise) computes those rows alone: its attention still caches
every row's key and value, but attends with the output rows' queries only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Protocol

import torch


@dataclass
class AttentionMetadata:
    """Batch layout for one forward pass. Device tensors plus host copies of small lists.

    Invariants: ``query_start_loc[-1] == num_actual_tokens``; for every sequence
    ``1 <= query_len <= seq_len``; ``block_tables`` rows cover ``ceil(seq_len / block_size)``
    blocks (padding beyond that is arbitrary); ``slot_mapping[i]`` is the slot of new token i.
    """

    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies (lists of ints) so a reference backend never syncs the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Whether query-length-1 sequences (decodes) may be in the batch; None: read from
    # query_start_loc_cpu. A CUDA graph that serves any mix of prompts and decodes sets
    # True, so its capture holds the decode kernel whatever the capture's own layout.
    has_decodes: bool | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class OutputRows:
    """The rows of a step whose hidden states leave the model: the last new token of each
    sequence ``seqs[i]``, at flat row ``indices[i]``, in that order.

    ``metadata`` lays them out as a batch of single-token queries: row ``i`` is a sequence
    of query length 1 with its own sequence's context (``seq_lens``, ``block_tables``), so
    attending it is a decode over keys the step has already cached."""

    indices: torch.Tensor  # [S] int64, device
    metadata: AttentionMetadata

    @classmethod
    def last_tokens(cls, metadata: AttentionMetadata, seqs: list[int],
                    indices: torch.Tensor) -> OutputRows:
        """The last new tokens of ``seqs`` (sequence indices of ``metadata``, ascending),
        found at flat rows ``indices``."""
        device = metadata.seq_lens.device
        # Each row's sequence, found on the device (no upload): the first whose end passes it.
        ends = metadata.query_start_loc[1:metadata.num_seqs + 1]
        index = torch.searchsorted(ends, indices.to(ends.dtype), right=True)
        seq_lens = [metadata.seq_lens_cpu[b] for b in seqs]
        return cls(indices, AttentionMetadata(
            num_actual_tokens=len(seqs),
            slot_mapping=metadata.slot_mapping[indices],
            query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32, device=device),
            seq_lens=metadata.seq_lens.index_select(0, index),
            block_tables=metadata.block_tables.index_select(0, index),
            max_query_len=1,
            max_seq_len=max(seq_lens, default=0),
            block_size=metadata.block_size,
            query_start_loc_cpu=list(range(len(seqs) + 1)),
            seq_lens_cpu=seq_lens,
        ))


class SumsScales(NamedTuple):
    """The scales of a step's queries, keys and values that are an FP8 product's sums
    (``quantization.fp8.Fp8Sums``): each value is ``round(sum * row[t] * col[c])`` to the
    activation dtype, with ``row: [T]`` and the columns' scales ``q: [H * D]`` and ``k/v:
    [Hkv * D]`` as the heads lay them out, all float32."""

    row: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    kv_caches: list[torch.Tensor]
    output_rows: OutputRows | None = None


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None, kv_caches: list[torch.Tensor],
    output_rows: OutputRows | None = None,
) -> Iterator[None]:
    """``output_rows``: a model that computes only the output rows in its last layer
    (``prunes_to_output_rows``) returns their hidden states alone, in that order."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata, kv_caches, output_rows)
    try:
        yield
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("The model ran outside set_forward_context(): the model runner sets it.")
    return _forward_context


class AttentionBackend(Protocol):
    """Writes the step's new K/V into the paged cache, then attends over the full context.

    ``query``: [T, num_heads, head_dim]; ``key``/``value``: [T, num_kv_heads, head_dim];
    returns [T, num_heads, head_dim]. Causal within a sequence; sequences never see each
    other. ``sliding_window`` (tokens, or None) limits how far back a query looks.
    ``rotary`` (``(cos, sin)``, each [T, head_dim // 2], or None): query and key still need
    their rotary embedding (``RotaryEmbedding.apply``'s rotate-half), which the backend
    applies before caching and attending (the Triton backend in the same kernel as the
    cache write).
    ``k_scale`` / ``v_scale``: the layer's per-tensor scales of an FP8 cache (keys and
    values are stored divided by them and read back multiplied, see ``kv_quant.py``);
    a cache of another dtype ignores them.
    ``logits_soft_cap`` (or None): each scaled score ``s`` becomes ``cap * tanh(s / cap)``
    before the mask and the softmax (Gemma 2's ``attn_logit_softcapping``).
    ``outputs`` (or None): every row's key and value are still cached, but only the rows
    ``outputs.indices`` attend, each as its sequence's query of length 1
    (``outputs.metadata``); the result then has one row per output row.
    ``sums`` (or None): query, key and value are an FP8 product's sums, which the backend
    scales as it reads them; given only with ``rotary``, without ``outputs``, in a step
    for which ``takes_sums`` is true.
    """

    def takes_sums(self, metadata: AttentionMetadata) -> bool:
        """Whether ``forward`` takes this step's query, key and value as sums (``sums``)."""
        ...

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
    ) -> torch.Tensor: ...
