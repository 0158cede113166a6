"""CUDA graphs for pure-decode steps: the model's forward captured once per batch size.

A decode step (every scheduled request computes exactly one token) is shaped by one
number, its batch size. The forward pass is captured for a set of sizes
(``capture_sizes``: 1, 2, 4, 8, 16, 24, ... up to ``max_num_seqs``, at most 512) and a step
of ``n`` requests replays the smallest captured size ``>= n``, rows ``n..size-1`` padding::

    static buffer      rows 0..n-1                 rows n..size-1 (padding)
    input_ids          the step's tokens           0
    positions          their positions             0
    slot_mapping       their KV slots              -1  (the KV write skips the row)
    seq_lens           their context lengths       0   (decode attention reads nothing and
                                                        writes zeros)
    query_start_loc    0, 1, ..., size             (constant)
    block_tables       the step's rows, W columns  stale (never read: seq_len 0)

The Triton attention backend decides every launch from host integers fixed at capture:
``num_actual_tokens = size``, ``max_query_len = 1`` and ``max_seq_len = max_model_len``,
an upper bound of every context, so one graph serves any context length. That bound only
picks the number of split-K partitions (the most, ``MAX_SPLITS``, for a long
``max_model_len`` and a small batch); each sequence cuts its own context into that many
partitions of whole tiles, sized on the device from its ``seq_len``, so a short context
under a graph captured at ``max_model_len`` costs nothing extra beyond the empty programs
(past its end), which store an empty ``m``/``l`` and exit. The split-K scratch buffers it
allocates during capture come from the graphs' pool and stay reserved for the graph's
lifetime, which is what a replay needs.

Only the model's forward is captured. Logits of the real rows and sampling run eagerly
after the replay, so the sampler keeps its per-step flexibility and the only host sync is
reading the sampled ids. All graphs share one memory pool, captured largest first so the
smaller ones reuse its blocks; replays run one at a time, so the sharing is safe, and a
replay's output is valid until the next replay.

``use_graphs=False`` runs the same padded forward eagerly over the same static buffers: what
a replay computes, without a GPU (tests of the padding).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch
from torch import nn

from pagedllm.layers.attention.backend import AttentionMetadata, set_forward_context
from pagedllm.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to
    ``min(max_num_seqs, 512)``, which is always included."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}.")
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def padded_size(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``num_tokens``; None if none does."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphRunner:
    """Captures and replays the model's forward for decode batches (see the module docstring).

    ``kv_caches`` must be the engine's final cache tensors: their addresses are baked into
    the graphs.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        use_graphs: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = torch.device(device)
        self.use_graphs = use_graphs
        self.pool_bytes = 0
        max_size = self.sizes[-1]
        # Rows padded to 16 blocks: the same stride class as eager steps' block tables
        # (device_inputs.py), so both share the attention kernels' compiled variants.
        blocks_per_seq = -(-max_model_len // block_size)
        max_blocks = -(-blocks_per_seq // 16) * 16
        # Device inputs: [input_ids; positions; slot_mapping] in one buffer, one copy a step.
        self._tokens = torch.zeros(3, max_size, dtype=torch.int64, device=self.device)
        self._tokens[2].fill_(-1)
        self._seq_lens = torch.zeros(max_size, dtype=torch.int32, device=self.device)
        self._query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=self.device)
        self._block_tables = torch.zeros(max_size, max_blocks, dtype=torch.int32, device=self.device)
        pin = self.device.type == "cuda"
        self._host_tokens = torch.zeros(3, max_size, dtype=torch.int64, pin_memory=pin)
        self._host_seq_lens = torch.zeros(max_size, dtype=torch.int32, pin_memory=pin)
        self._host_blocks = torch.zeros(max_size * max_blocks, dtype=torch.int32, pin_memory=pin)
        self._np_tokens = self._host_tokens.numpy()
        self._np_seq_lens = self._host_seq_lens.numpy()
        self._np_blocks = self._host_blocks.numpy()
        self._copied = torch.cuda.Event() if pin else None
        self._metadata: dict[int, AttentionMetadata] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, inputs: StepInputs) -> bool:
        """A pure-decode step (one token per request) that fits the largest captured size."""
        return inputs.max_query_len == 1 and inputs.num_tokens <= self.max_size

    # -- capture ----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, each after an eager warm-up run
        (which compiles the Triton kernels outside the capture). Inputs are all padding."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self._forward(size)
            self._graphs[size] = graph
            self._outputs[size] = output
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        logger.info(
            "Captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s, %.0f MiB",
            len(self.sizes), self.max_size, time.perf_counter() - start, self.pool_bytes / 2**20,
        )

    def _attention_metadata(self, size: int) -> AttentionMetadata:
        metadata = self._metadata.get(size)
        if metadata is None:
            metadata = AttentionMetadata(
                num_actual_tokens=size,
                slot_mapping=self._tokens[2, :size],
                query_start_loc=self._query_start_loc[: size + 1],
                seq_lens=self._seq_lens[:size],
                block_tables=self._block_tables[:size],
                max_query_len=1,
                max_seq_len=self.max_model_len,
                block_size=self.block_size,
                query_start_loc_cpu=list(range(size + 1)),
                seq_lens_cpu=[self.max_model_len] * size,
            )
            self._metadata[size] = metadata
        return metadata

    def _forward(self, size: int) -> torch.Tensor:
        with set_forward_context(self._attention_metadata(size), self.kv_caches):
            return self.model(self._tokens[0, :size], self._tokens[1, :size])

    # -- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self,
        inputs: StepInputs,
        fill_input_ids: Callable[[torch.Tensor, StepInputs], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode step's ``n`` tokens (see ``can_run``).

        ``fill_input_ids(input_ids, inputs)``, if given, may rewrite the staged input ids
        on the device before the replay (ids known only on the device).
        """
        n = inputs.num_tokens
        size = padded_size(n, self.sizes)
        if size is None or inputs.max_query_len != 1:
            raise ValueError(f"Not a decode step of at most {self.max_size} requests.")
        self._stage(inputs, size)
        if fill_input_ids is not None:
            fill_input_ids(self._tokens[0, :n], inputs)
        if self.use_graphs:
            self._graphs[size].replay()
            return self._outputs[size][:n]
        return self._forward(size)[:n]

    def _stage(self, inputs: StepInputs, size: int) -> None:
        """Fill the host buffers (real rows, then padding) and copy them to the device."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the buffers
        n = inputs.num_tokens
        tokens, seq_lens = self._np_tokens, self._np_seq_lens
        tokens[0, :n] = inputs.input_ids
        tokens[1, :n] = inputs.positions
        tokens[2, :n] = inputs.slot_mapping
        tokens[0:2, n:size] = 0
        tokens[2, n:size] = -1
        seq_lens[:n] = inputs.seq_lens
        seq_lens[n:size] = 0
        width = inputs.block_tables.shape[1]
        self._np_blocks[: n * width].reshape(n, width)[:] = inputs.block_tables
        self._tokens.copy_(self._host_tokens, non_blocking=True)
        self._seq_lens.copy_(self._host_seq_lens, non_blocking=True)
        self._block_tables[:n, :width].copy_(
            self._host_blocks[: n * width].view(n, width), non_blocking=True
        )
        if self._copied is not None:
            self._copied.record()
