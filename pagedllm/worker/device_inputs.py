"""Moving one step's flat inputs to the GPU: persistent pinned buffers, two copies per step.

Allocating pinned memory is slow (a driver call per buffer), so the host side of every
transfer is a buffer allocated once and refilled each step. The step's arrays are packed
so that each dtype travels in ONE contiguous copy::

    int64 buffer:  [ input_ids (T) | positions (T) | slot_mapping (T) | logits_indices (S) ]
    int32 buffer:  [ query_start_loc (B + 1) | seq_lens (B) | block_tables (B * W) ]

(``T`` tokens, ``B`` sequences, ``S`` sampling sequences, ``W`` blocks per row.) The device
tensors handed to the model are views of two device buffers with the same layout; they
stay valid until the next step's copy, which the stream orders after this step's kernels.

A copy is asynchronous, so the host buffers must not be refilled while one is in flight:
an event recorded after the copies is waited on before the next refill (normally long
done, since every step that samples reads its tokens back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.worker.input_batch import StepInputs


@dataclass
class DeviceStepInputs:
    """Device views of one step's inputs (valid until the next ``DeviceInputBuffers.stage``)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [S] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32


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
        n64 = 3 * max_num_tokens + max_num_seqs
        n32 = 2 * max_num_seqs + 1 + max_num_seqs * max_blocks_per_seq
        self._host64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self._np64 = self._host64.numpy()
        self._np32 = self._host32.numpy()
        self._dev64 = torch.zeros(n64, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event() if pin else None

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
        h64[0:t] = inputs.input_ids
        h64[t:2 * t] = inputs.positions
        h64[2 * t:3 * t] = inputs.slot_mapping
        h64[3 * t:3 * t + s] = inputs.logits_indices
        h32[0:b + 1] = inputs.query_start_loc
        h32[b + 1:2 * b + 1] = inputs.seq_lens
        h32[2 * b + 1:2 * b + 1 + b * w].reshape(b, w)[:] = inputs.block_tables
        n64, n32 = 3 * t + s, 2 * b + 1 + b * w
        self._dev64[:n64].copy_(self._host64[:n64], non_blocking=True)
        self._dev32[:n32].copy_(self._host32[:n32], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        d64, d32 = self._dev64, self._dev32
        return DeviceStepInputs(
            input_ids=d64[0:t],
            positions=d64[t:2 * t],
            slot_mapping=d64[2 * t:3 * t],
            logits_indices=d64[3 * t:3 * t + s],
            query_start_loc=d32[0:b + 1],
            seq_lens=d32[b + 1:2 * b + 1],
            block_tables=d32[2 * b + 1:2 * b + 1 + b * w].view(b, w),
        )
