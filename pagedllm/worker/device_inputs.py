"""Moving one step's flat inputs to the GPU: persistent pinned buffers, two copies per step.

Allocating pinned memory is slow (a driver call per buffer), so the host side of every
transfer is a buffer allocated once and refilled each step. The step's arrays are packed
so that each dtype travels in ONE contiguous copy::

    int64 buffer:  [ input_ids (T) | positions (T) | slot_mapping (T) | logits_indices (S) ]
    int32 buffer:  [ query_start_loc (B + 1) | seq_lens (B) | block_tables (B x W16) ]

(``T`` tokens, ``B`` sequences, ``S`` sampling sequences.) Every segment starts on a
256-byte boundary and block-table rows are padded to ``W16``, a multiple of 16 blocks:
Triton specialises kernels on pointer alignment and on strides divisible by 16, so
unaligned segments or a ragged row stride would compile new kernel variants mid-run as
batch shapes change. Columns past a row's real blocks are stale and never read.

The device tensors handed to the model are views of two device buffers with the same
layout; they stay valid until the next step's copy, which the stream orders after this
step's kernels. A copy is asynchronous, so the host buffers must not be refilled while one
is in flight: an event recorded after the copies is waited on before the next refill
(normally long done, since every step that samples reads its tokens back).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.worker.input_batch import StepInputs

_ALIGN = 32  # elements: 256 bytes of int64, 128 of int32


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class DeviceStepInputs:
    """Device views of one step's inputs (valid until the next ``DeviceInputBuffers.stage``)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [S] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W16] int32 (columns past a row's blocks are stale)


class DeviceInputBuffers:
    """Pinned host + device buffers sized for the largest step the scheduler can send."""

    def __init__(
        self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        pin = device.type == "cuda"
        n64 = 3 * _up(max_num_tokens, _ALIGN) + max_num_seqs
        n32 = (_up(max_num_seqs + 1, _ALIGN) + _up(max_num_seqs, _ALIGN)
               + max_num_seqs * _up(max_blocks_per_seq, 16))
        self._host64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self._np64 = self._host64.numpy()
        self._np32 = self._host32.numpy()
        self._dev64 = torch.zeros(n64, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event() if pin else None
        # Pending-token indices (see input_batch.py): [flat positions | sampled-id rows].
        self._host_pending = torch.zeros(2 * max_num_seqs, dtype=torch.int64, pin_memory=pin)
        self._dev_pending = torch.zeros(2 * max_num_seqs, dtype=torch.int64, device=device)
        self._pending_copied = torch.cuda.Event() if pin else None

    def stage_pending(self, token_indices: np.ndarray, sample_rows: np.ndarray) -> torch.Tensor:
        """Copy a step's pending-token indices (two int64 arrays of one length ``n``, at most
        ``max_num_seqs``) to the device; returns the device view ``[2, n]``."""
        n = len(token_indices)
        if self._pending_copied is not None:
            self._pending_copied.synchronize()
        host = self._host_pending.numpy()
        host[:n] = token_indices
        host[n:2 * n] = sample_rows
        self._dev_pending[:2 * n].copy_(self._host_pending[:2 * n], non_blocking=True)
        if self._pending_copied is not None:
            self._pending_copied.record()
        return self._dev_pending[:2 * n].view(2, n)

    def stage(self, inputs: StepInputs) -> DeviceStepInputs:
        """Copy ``inputs`` to the device; returns views of the device buffers."""
        t = inputs.num_tokens
        b = len(inputs.req_ids)
        s = len(inputs.logits_indices)
        w = inputs.block_tables.shape[1]
        if t > self.max_num_tokens or b > self.max_num_seqs or w > self.max_blocks_per_seq:
            raise ValueError(
                f"A step of {t} tokens / {b} sequences / {w} blocks per row exceeds the input "
                f"buffers ({self.max_num_tokens} / {self.max_num_seqs} / {self.max_blocks_per_seq})."
            )
        if self._copied is not None:
            self._copied.synchronize()
        h64, h32 = self._np64, self._np32
        ta = _up(t, _ALIGN)
        h64[0:t] = inputs.input_ids
        h64[ta:ta + t] = inputs.positions
        h64[2 * ta:2 * ta + t] = inputs.slot_mapping
        h64[3 * ta:3 * ta + s] = inputs.logits_indices
        seq_off = _up(b + 1, _ALIGN)
        table_off = seq_off + _up(b, _ALIGN)
        width = _up(w, 16)
        h32[0:b + 1] = inputs.query_start_loc
        h32[seq_off:seq_off + b] = inputs.seq_lens
        h32[table_off:table_off + b * width].reshape(b, width)[:, :w] = inputs.block_tables
        n64, n32 = 3 * ta + s, table_off + b * width
        self._dev64[:n64].copy_(self._host64[:n64], non_blocking=True)
        self._dev32[:n32].copy_(self._host32[:n32], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        d64, d32 = self._dev64, self._dev32
        return DeviceStepInputs(
            input_ids=d64[0:t],
            positions=d64[ta:ta + t],
            slot_mapping=d64[2 * ta:2 * ta + t],
            logits_indices=d64[3 * ta:3 * ta + s],
            query_start_loc=d32[0:b + 1],
            seq_lens=d32[seq_off:seq_off + b],
            block_tables=d32[table_off:table_off + b * width].view(b, width),
        )
