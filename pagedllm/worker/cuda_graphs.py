"""CUDA graphs: the model's forward captured once per step shape, replayed with new inputs.

Four kinds of step are captured, each padded up to the smallest captured size:

* decode (every scheduled request computes exactly one token), shaped by its batch size:
  1, 2, 4, 8, 16, 24, ... up to ``max_num_seqs`` (at most 512), ``capture_sizes``. Where
  the attention launches another tile for short contexts (``short_decode_len``: an FP8
  cache, ``triton_decode.short_decode_context``), the same sizes are captured a second
  time under that bound, and a decode step whose contexts all fit it replays those;
* a single prompt (one request, a prefill or a chunk of one, 2 to 512 tokens), shaped by
  its token count: 16, 32, 64, 96, 128, 192, 256, 384, 512 up to the step's token
  budget, ``prompt_capture_sizes``. An eager forward of a short prompt is bound by the
  host's launches (tens of milliseconds for a 32-layer model); a replay is one launch;
* mixed (opt-in, ``mixed_graphs``: ``PAGEDLLM_MIXED_GRAPHS=1``): any other step of at most
  ``max_num_batched_tokens`` tokens, several prompts or chunks with decodes beside them,
  shaped by its token count: ``MIXED_CAPTURE_SIZES`` up to the step's token budget,
  ``mixed_capture_sizes``. An eager prompt step of a small model is bound by the host's
  launches (about 20 ms for 28 layers on an H200's host, for 10-15 ms of device work);
* verify (speculative decoding: every request computes 1 to ``W`` tokens, some more
  than 1; ``W = verify_width``: K + 1 for the target, 2 for the draft's catch-up), shaped
  by its batch size: ``capture_sizes`` of at most ``max_num_batched_tokens // W``
  requests, ``verify_capture_sizes``. An eager verification of several requests pays the
  host's launches as a short prompt does. Without speculation (``verify_width`` 0) none
  is captured.

A decode step of ``n`` requests replays size ``>= n``, rows ``n..size-1`` padding::

    static buffer      rows 0..n-1                 rows n..size-1 (padding)
    input_ids          the step's tokens           0
    positions          their positions             0
    slot_mapping       their KV slots              -1  (the KV write skips the row)
    seq_lens           their context lengths       0   (decode attention reads nothing and
                                                        writes zeros)
    query_start_loc    0, 1, ..., size             (constant)
    block_tables       the step's rows, W columns  stale (never read: seq_len 0)

A prompt step of ``n`` tokens replays size ``Q >= n`` as one sequence of ``Q`` new tokens
whose last ``Q - n`` are padding: ``query_start_loc = [0, Q]`` (constant) and ``seq_len =
context + Q``. Causality keeps the real tokens from seeing the padding (which comes after
them); the padding rows write no KV (slot -1) and their outputs are never read. They may
attend to slots that hold stale values, through block-table columns past the real ones
(ids left by earlier steps, or 0: always valid block indices), so a prompt only replays
when ``context + Q <= max_model_len`` (the table's width).

A mixed step of ``n`` tokens in ``m`` requests replays size ``T >= n`` over ``S =
max_size + 1`` sequence slots: the ``m`` requests as they are, then (when ``T > n``) one
padding sequence holding the ``T - n`` padding tokens with no context, then empty
sequences (query length 0, context 0) up to ``S``::

    sequence b         b < m (real)              b == m (padding, T > n)    the rest
    query_start_loc    the step's                ..., n, T                   T
    seq_lens           the step's                T - n                       0
    tokens             the step's                ids 0, positions 0, slot -1 none
    block_tables       the step's row            stale ids or 0              stale

No real row reads a key of another sequence or a position past its own; the padding
sequence attends within its own block-table row (stale ids or 0: valid blocks) and writes
no KV; an empty sequence's programs exit at once. The graph holds both attention launches
(``AttentionMetadata.has_decodes`` set): the prefill kernel skipping query-length-1
sequences, and the decode kernel, whose programs of other sequences exit.

A verify step of ``m`` requests replays batch size ``B >= m``: request ``b`` owns rows
``b*W .. b*W + W - 1`` (``query_start_loc = [0, W, 2W, ..., B*W]``, constant), first
``W - q`` padding rows, then its ``q`` real tokens; requests ``m..B-1`` are padding::

    request b          b < m (real)                             b >= m (padding)
    rows               W - q padding, then the q real tokens    W padding
    input_ids          0 on padding rows, then the tokens'      0
    positions          0 on padding rows, then the tokens'      0
    slot_mapping       -1 on padding rows, then the tokens'     -1  (no KV write)
    seq_lens           its context length, unchanged            W   (context 0)
    block_tables       the step's row                           stale ids or 0

With its ``seq_len`` unchanged and ``W`` query rows, a request's rows sit at positions
``seq_len - W .. seq_len - 1``: the real tokens at their own, the padding rows at the
positions of the last ``W - q`` context tokens before them. The real rows attend to
exactly the keys an eager step gives them, and no attention program of a real request
reads a key at or past ``seq_len`` (a query tile's keys end at its last row's position),
so no stale slot or stale block-table column is ever read for a real row. The padding
rows attend to the request's real context (their outputs are never read) and write no
KV. A padding request attends only within its own block-table row (stale ids or 0:
valid blocks) and writes nothing. The step replays only when every ``seq_len >= W``
(a padding row needs a context position; fewer tokens than ``W`` in all is a short
prompt, which runs as before). The graph ends with a gather of the real rows (their padded
row numbers are a fourth row of the token buffer), so a replay returns the step's hidden
states in its own order, like an eager forward. A step with every request at ``W``
tokens (every request verifying K proposals) pads no row; plain decodes, shorter proposal
runs and short prompt chunks beside them pad. A step of one-token requests only is a
decode step; one request's ``2..W`` tokens replay verify size 1 (fewer rows than the
smallest prompt graph).

The Triton attention backend decides every launch from host integers fixed at capture:
``num_actual_tokens = size`` (``B*W`` for verify), ``max_query_len`` (1, ``Q`` or ``W``)
and ``max_seq_len = max_model_len``, an upper bound of every context, so one graph serves
any context length. The prompt and verify graphs hold no decode sequence (no query length
1 in their constant ``query_start_loc``): they run the varlen prefill kernel alone, whose
grid ``(tokens // BLOCK_Q + seqs, kv_heads)`` and tile sizes (from ``max_query_len``)
come from those integers and whose programs find their sequence on the device.
For decodes that bound only picks the number of split-K partitions (the most,
``MAX_SPLITS``, for a long ``max_model_len`` and a small batch); each sequence cuts its own
context into that many partitions of whole tiles, sized on the device from its
``seq_len``, so a short context under a graph captured at ``max_model_len`` costs nothing
extra beyond the empty programs (past its end); the short-decode graphs are captured
under ``max_seq_len = short_decode_len`` instead, which picks their tile and plans their
splits, and replay only steps within it. The split-K scratch buffers allocated
during capture come from the graphs' pool and stay reserved for the graph's lifetime,
which is what a replay needs.

Only the model's forward is captured. Logits of the sampled rows and sampling run eagerly
after the replay, so the sampler keeps its per-step flexibility and the only host sync is
reading the sampled ids. All graphs share one memory pool, captured largest first so the
smaller ones reuse its blocks; replays run one at a time, so the sharing is safe, and a
replay's output is valid until the next replay.

``use_graphs=False`` runs the same padded forward eagerly over the same static buffers: what
a replay computes, without a GPU (tests of the padding).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from typing import Callable

import numpy as np
import torch
from torch import nn

from pagedllm.layers.attention.backend import AttentionMetadata, set_forward_context
from pagedllm.switches import switch
from pagedllm.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
PROMPT_CAPTURE_SIZES = (16, 32, 64, 96, 128, 192, 256, 384, 512)
MIXED_CAPTURE_SIZES = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
# Token buffers of at most this many rows are copied whole each step (16 KB at 512 rows).
SMALL_TOKEN_BUFFER = 1024


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, then every multiple of 8, up to
    ``min(max_num_seqs, 512)``, which is always included."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}.")
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def prompt_capture_sizes(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Single-prompt token counts to capture: ``PROMPT_CAPTURE_SIZES`` that a step can hold
    (``max_num_batched_tokens``) and a sequence can reach (``max_model_len``)."""
    cap = min(max_num_batched_tokens, max_model_len)
    return [s for s in PROMPT_CAPTURE_SIZES if s <= cap]


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """Mixed-step token counts to capture: ``MIXED_CAPTURE_SIZES`` below the step's token
    budget, then the budget itself (at most the largest size); none below 1,024 tokens."""
    budget = min(max_num_batched_tokens, MIXED_CAPTURE_SIZES[-1])
    sizes = [s for s in MIXED_CAPTURE_SIZES if s < budget]
    return sizes + [budget] if budget >= MIXED_CAPTURE_SIZES[0] else []


MIXED_GRAPHS_ENV = "PAGEDLLM_MIXED_GRAPHS"


def mixed_graphs_enabled() -> bool:
    """Whether the engine captures mixed-step graphs: ``PAGEDLLM_MIXED_GRAPHS=1`` (off by
    default until measured against the eager steps on a GPU)."""
    return switch(MIXED_GRAPHS_ENV, False)


def verify_capture_sizes(max_num_seqs: int, width: int, max_num_batched_tokens: int) -> list[int]:
    """Verify batch sizes to capture for requests of ``width`` rows each: the decode sizes
    of at most ``max_num_batched_tokens // width`` requests (a step's token budget, padded
    rows counted), that largest count included; none for ``width < 2`` (no speculation)."""
    if width < 2:
        return []
    cap = min(max_num_seqs, max_num_batched_tokens // width)
    return capture_sizes(cap) if cap >= 1 else []


def padded_size(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``num_tokens``; None if none does."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


DECODE, SHORT_DECODE, PROMPT, VERIFY, MIXED = "decode", "short decode", "prompt", "verify", "mixed"
# (DECODE or SHORT_DECODE, requests = tokens), (PROMPT, tokens), (VERIFY, requests of
# verify_width rows) or (MIXED, tokens).
GraphKey = tuple[str, int]


class CudaGraphRunner:
    """Captures and replays the model's forward for decode batches, single prompts and
    verify batches (see the module docstring).

    ``kv_caches`` must be the engine's final cache tensors: their addresses are baked into
    the graphs. ``max_num_batched_tokens`` bounds the prompt sizes and the verify batches
    (0: decodes only); ``verify_width`` (``W``, 0: none) is the most tokens a request
    computes in a verify step. ``mixed_graphs`` also captures mixed steps (prompts and
    decodes together) up to ``max_num_batched_tokens`` tokens. ``short_decode_len`` (below
    ``max_model_len``, else ignored) also captures the decode sizes under that context
    bound, for decode steps whose contexts all fit it.
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
        max_num_batched_tokens: int = 0,
        verify_width: int = 0,
        use_graphs: bool = True,
        mixed_graphs: bool = False,
        short_decode_len: int | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = {
            DECODE: capture_sizes(max_num_seqs),
            SHORT_DECODE: (capture_sizes(max_num_seqs) if short_decode_len is not None
                           and short_decode_len < max_model_len else []),
            PROMPT: prompt_capture_sizes(max_num_batched_tokens, max_model_len),
            VERIFY: verify_capture_sizes(max_num_seqs, verify_width, max_num_batched_tokens),
            MIXED: (mixed_capture_sizes(min(max_num_batched_tokens, max_model_len))
                    if mixed_graphs else []),
        }
        self.verify_width = verify_width if self.sizes[VERIFY] else 0
        self.short_decode_len = short_decode_len if self.sizes[SHORT_DECODE] else None
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = torch.device(device)
        self.use_graphs = use_graphs
        self.pool_bytes = 0
        max_tokens = self.max_tokens
        # Rows padded to 16 blocks: the same stride class as eager steps' block tables
        # (device_inputs.py), so both share the attention kernels' compiled variants.
        blocks_per_seq = -(-max_model_len // block_size)
        max_blocks = -(-blocks_per_seq // 16) * 16
        max_seqs = self.sizes[DECODE][-1] + 1  # a mixed step's padding sequence
        # Device inputs, one copy a step: [input_ids; positions; slot_mapping; verify
        # steps' gather rows (the padded row of each real token)].
        self._tokens = torch.zeros(4, max_tokens, dtype=torch.int64, device=self.device)
        self._tokens[2].fill_(-1)
        self._seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=self.device)
        self._decode_query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=self.device)
        self._prompt_query_start_loc = {
            size: torch.tensor([0, size], dtype=torch.int32, device=self.device)
            for size in self.sizes[PROMPT]
        }
        self._verify_query_start_loc = self._decode_query_start_loc * self.verify_width
        self._mixed_query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=self.device)
        self._block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=self.device)
        pin = self.device.type == "cuda"
        self._host_tokens = torch.zeros(4, max_tokens, dtype=torch.int64, pin_memory=pin)
        self._host_seq_lens = torch.zeros(max_seqs, dtype=torch.int32, pin_memory=pin)
        self._host_blocks = torch.zeros(max_seqs * max_blocks, dtype=torch.int32, pin_memory=pin)
        self._host_query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, pin_memory=pin)
        self._np_tokens = self._host_tokens.numpy()
        self._np_seq_lens = self._host_seq_lens.numpy()
        self._np_blocks = self._host_blocks.numpy()
        self._np_query_start_loc = self._host_query_start_loc.numpy()
        self._copied = torch.cuda.Event() if pin else None
        self._metadata: dict[GraphKey, AttentionMetadata] = {}
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[GraphKey, torch.Tensor] = {}

    @property
    def max_size(self) -> int:
        """The largest captured decode batch."""
        return self.sizes[DECODE][-1]

    @property
    def max_tokens(self) -> int:
        """The most tokens any captured step holds."""
        return max(self.num_tokens((kind, sizes[-1]))
                   for kind, sizes in self.sizes.items() if sizes)

    @property
    def mixed_seqs(self) -> int:
        """The sequence slots of a mixed graph: the largest decode batch and a padding one."""
        return self.max_size + 1

    def num_tokens(self, key: GraphKey) -> int:
        """The rows of the graph ``key``'s forward."""
        kind, size = key
        return size * self.verify_width if kind == VERIFY else size

    def graph_for(self, inputs: StepInputs) -> GraphKey | None:
        """The captured step that serves ``inputs``: a pure-decode step (one token per
        request) within the largest decode size (a short decode if every context is within
        ``short_decode_len``); a verify step (every request computing 1
        to ``verify_width`` tokens and holding at least ``verify_width`` with its context)
        within the largest verify size; else one request's prompt tokens (2 or more)
        within the largest prompt size whose padded length stays within
        ``max_model_len``; else any step within the largest mixed size whose requests and
        padding sequence fit ``mixed_seqs``; None otherwise."""
        n = inputs.num_tokens
        if inputs.max_query_len == 1:
            size = padded_size(n, self.sizes[DECODE])
            if size is None:
                return None
            short = (self.short_decode_len is not None
                     and int(inputs.seq_lens.max()) <= self.short_decode_len)
            return SHORT_DECODE if short else DECODE, size
        if inputs.max_query_len <= self.verify_width:
            size = padded_size(len(inputs.seq_lens), self.sizes[VERIFY])
            if size is not None and int(inputs.seq_lens.min()) >= self.verify_width:
                return VERIFY, size
        if len(inputs.seq_lens) == 1:
            size = padded_size(n, self.sizes[PROMPT])
            if size is not None and int(inputs.seq_lens[0]) - n + size <= self.max_model_len:
                return PROMPT, size
        size = padded_size(n, self.sizes[MIXED])
        if size is None or len(inputs.seq_lens) + (size > n) > self.mixed_seqs:
            return None
        return MIXED, size

    def can_run(self, inputs: StepInputs) -> bool:
        return self.graph_for(inputs) is not None

    # -- capture ----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per shape, the most tokens first, each after an eager warm-up
        run (which compiles the Triton kernels outside the capture). Inputs are padding."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        keys = [(kind, size) for kind, sizes in self.sizes.items() for size in sizes]
        for key in sorted(keys, key=lambda k: (-self.num_tokens(k), k[0])):
            self._fill_padding(key)  # the warm-up reads the buffers
            self._forward(key)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self._forward(key)
            self._graphs[key] = graph
            self._outputs[key] = output
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        prompts, verifies, mixed = self.sizes[PROMPT], self.sizes[VERIFY], self.sizes[MIXED]
        logger.info(
            "Captured CUDA graphs for %d decode batch sizes (1..%d%s), %d prompt lengths (%s), "
            "%d verify batch sizes (%s) and %d mixed-step sizes (%s) in %.1f s, %.0f MiB",
            len(self.sizes[DECODE]), self.max_size,
            f"; again for contexts of at most {self.short_decode_len} tokens"
            if self.short_decode_len else "", len(prompts),
            f"{prompts[0]}..{prompts[-1]}" if prompts else "none", len(verifies),
            f"1..{verifies[-1]} x {self.verify_width} tokens" if verifies else "none",
            len(mixed), f"{mixed[0]}..{mixed[-1]} tokens" if mixed else "none",
            time.perf_counter() - start, self.pool_bytes / 2**20,
        )

    def _fill_padding(self, key: GraphKey) -> None:
        """Device buffers holding a step of padding only: a prompt of ``Q`` tokens with no
        context, padding verify requests (``W`` tokens, no context) or empty decode rows;
        no KV slot, gather rows 0."""
        kind, size = key
        self._tokens[:2].zero_()
        self._tokens[2].fill_(-1)
        self._tokens[3].zero_()
        if kind == PROMPT:
            self._seq_lens[:1].fill_(size)
        elif kind == MIXED:  # one padding sequence of all the tokens, then empty ones
            self._seq_lens.zero_()
            self._seq_lens[:1].fill_(size)
            self._mixed_query_start_loc.fill_(size)
            self._mixed_query_start_loc[:1].zero_()
        else:
            self._seq_lens[:size].fill_(self.verify_width if kind == VERIFY else 0)

    def _attention_metadata(self, key: GraphKey) -> AttentionMetadata:
        metadata = self._metadata.get(key)
        if metadata is None and key[0] == MIXED:
            size, seqs = key[1], self.mixed_seqs
            metadata = AttentionMetadata(
                num_actual_tokens=size,
                slot_mapping=self._tokens[2, :size],
                query_start_loc=self._mixed_query_start_loc,
                seq_lens=self._seq_lens[:seqs],
                block_tables=self._block_tables[:seqs],
                max_query_len=size,
                max_seq_len=self.max_model_len,
                block_size=self.block_size,
                # The capture's layout; the eager padded forward stages each step's here
                # (a reference backend reads it), a replay reads the device buffers.
                query_start_loc_cpu=[0] + [size] * seqs,
                seq_lens_cpu=[size] + [0] * (seqs - 1),
                has_decodes=True,
            )
            self._metadata[key] = metadata
        if metadata is None:
            kind, size = key
            seqs = 1 if kind == PROMPT else size
            width = {DECODE: 1, SHORT_DECODE: 1, PROMPT: size, VERIFY: self.verify_width}[kind]
            # A bound of every context the graph replays (the short decodes': theirs).
            bound = self.short_decode_len if kind == SHORT_DECODE else self.max_model_len
            query_start_loc = (self._prompt_query_start_loc[size] if kind == PROMPT else
                               (self._verify_query_start_loc if kind == VERIFY else
                                self._decode_query_start_loc)[: size + 1])
            metadata = AttentionMetadata(
                num_actual_tokens=self.num_tokens(key),
                slot_mapping=self._tokens[2, : self.num_tokens(key)],
                query_start_loc=query_start_loc,
                seq_lens=self._seq_lens[:seqs],
                block_tables=self._block_tables[:seqs],
                max_query_len=width,
                max_seq_len=bound,
                block_size=self.block_size,
                query_start_loc_cpu=list(range(0, seqs * width + 1, width)),
                seq_lens_cpu=[bound] * seqs,
            )
            self._metadata[key] = metadata
        return metadata

    def _forward(self, key: GraphKey) -> torch.Tensor:
        """The padded forward of ``key``'s rows; for a verify step its hidden states
        gathered into the real tokens' order (rows past them: copies of row 0)."""
        rows = self.num_tokens(key)
        with set_forward_context(self._attention_metadata(key), self.kv_caches):
            hidden_states = self.model(self._tokens[0, :rows], self._tokens[1, :rows])
        if key[0] == VERIFY:
            return hidden_states.index_select(0, self._tokens[3, :rows])
        return hidden_states

    # -- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self,
        inputs: StepInputs,
        fill_input_ids: Callable[[torch.Tensor, StepInputs], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of the step's ``n`` tokens (see ``graph_for``).

        ``fill_input_ids(input_ids, inputs)``, if given, may rewrite the staged input ids
        on the device before the replay (ids known only on the device); in a padded verify
        step it gets every row and ``inputs`` with its pending tokens' indices moved to
        their padded rows.
        """
        key = self.graph_for(inputs)
        if key is None:
            raise ValueError(
                f"No captured graph serves this step: decodes of at most {self.max_size} "
                f"requests, verify steps of at most {max(self.sizes[VERIFY], default=0)} "
                f"requests of 1..{self.verify_width} tokens, one prompt of "
                f"2..{max(self.sizes[PROMPT], default=0)} tokens, or mixed steps of at most "
                f"{max(self.sizes[MIXED], default=0)} tokens."
            )
        n = inputs.num_tokens
        padded_rows = self._stage(inputs, key)
        if fill_input_ids is not None:
            input_ids, step = self._tokens[0, :n], inputs
            if padded_rows is not None:
                input_ids = self._tokens[0, : self.num_tokens(key)]
                if len(inputs.pending_token_indices):
                    step = dataclasses.replace(
                        inputs, pending_token_indices=padded_rows[inputs.pending_token_indices])
            fill_input_ids(input_ids, step)
        if self.use_graphs:
            self._graphs[key].replay()
            return self._outputs[key][:n]
        return self._forward(key)[:n]

    def _stage(self, inputs: StepInputs, key: GraphKey) -> np.ndarray | None:
        """Fill the host buffers (real rows, then padding) and copy them to the device;
        returns the padded row of each real token of a verify step (None otherwise)."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the buffers
        kind, size = key
        n = inputs.num_tokens
        rows = self.num_tokens(key)
        tokens, seq_lens = self._np_tokens, self._np_seq_lens
        seqs = len(inputs.seq_lens)
        padded_rows = None
        if kind == VERIFY:
            per_request = self.verify_width
            # Request b's q tokens go to the last q of its rows b*W .. b*W + W - 1.
            ends = inputs.query_start_loc[1:]
            query_lens = np.diff(inputs.query_start_loc)
            shift = np.arange(1, seqs + 1) * per_request - ends
            padded_rows = np.arange(n) + np.repeat(shift, query_lens)
            tokens[0:2, :rows] = 0
            tokens[2, :rows] = -1
            tokens[0, padded_rows] = inputs.input_ids
            tokens[1, padded_rows] = inputs.positions
            tokens[2, padded_rows] = inputs.slot_mapping
            tokens[3, :n] = padded_rows
            tokens[3, n:rows] = 0
            seq_lens[:seqs] = inputs.seq_lens
            seq_lens[seqs:size] = per_request
        else:
            tokens[0, :n] = inputs.input_ids
            tokens[1, :n] = inputs.positions
            tokens[2, :n] = inputs.slot_mapping
            tokens[0:2, n:size] = 0
            tokens[2, n:size] = -1
            seq_lens[:seqs] = inputs.seq_lens
            if kind in (DECODE, SHORT_DECODE):
                seq_lens[seqs:size] = 0
            elif kind == PROMPT:  # the padding tokens extend the prompt
                seq_lens[0] += size - n
            else:  # a padding sequence of size - n tokens, then empty ones
                self._stage_mixed_layout(inputs, size)
        width = inputs.block_tables.shape[1]
        self._np_blocks[: seqs * width].reshape(seqs, width)[:] = inputs.block_tables
        if self._tokens.shape[1] <= SMALL_TOKEN_BUFFER:
            self._tokens.copy_(self._host_tokens, non_blocking=True)  # one small copy
        else:  # the buffers hold a large mixed graph's rows: copy the step's graph's only
            for row in range(self._tokens.shape[0]):
                self._tokens[row, :rows].copy_(self._host_tokens[row, :rows], non_blocking=True)
        self._seq_lens.copy_(self._host_seq_lens, non_blocking=True)
        self._block_tables[:seqs, :width].copy_(
            self._host_blocks[: seqs * width].view(seqs, width), non_blocking=True
        )
        if kind == MIXED:
            self._mixed_query_start_loc.copy_(self._host_query_start_loc, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return padded_rows

    def _stage_mixed_layout(self, inputs: StepInputs, size: int) -> None:
        """The host side of a mixed step's sequences (see the module docstring): its
        ``query_start_loc`` and ``seq_lens`` past the real requests, and, for the eager
        padded forward (``use_graphs=False``), the same layout in the metadata's host lists
        (a replay reads only the device buffers)."""
        n, seqs, slots = inputs.num_tokens, len(inputs.seq_lens), self.mixed_seqs
        qsl, seq_lens = self._np_query_start_loc, self._np_seq_lens
        qsl[: seqs + 1] = inputs.query_start_loc
        qsl[seqs + 1 : slots + 1] = size
        seq_lens[seqs:slots] = 0
        if size > n:
            seq_lens[seqs] = size - n
        if not self.use_graphs:  # the eager forward's backend may read the host lists
            metadata = self._attention_metadata((MIXED, size))
            metadata.query_start_loc_cpu = qsl[: slots + 1].tolist()
            metadata.seq_lens_cpu = seq_lens[:slots].tolist()
