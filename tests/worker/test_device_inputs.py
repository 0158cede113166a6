"""The packed staging buffers hand the model exactly the step's arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.worker.device_inputs import DeviceInputBuffers
from pagedllm.worker.input_batch import StepInputs


def _step(query_lens: list[int], width: int) -> StepInputs:
    rng = np.random.default_rng(0)
    t, b = sum(query_lens), len(query_lens)
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    return StepInputs(
        req_ids=[str(i) for i in range(b)], states=[],
        input_ids=rng.integers(0, 100, t), positions=rng.integers(0, 50, t),
        slot_mapping=rng.integers(0, 400, t), query_start_loc=qsl,
        seq_lens=rng.integers(1, 50, b), block_tables=rng.integers(0, 30, (b, width)).astype(np.int32),
        max_query_len=max(query_lens), sample_req_indices=[0, b - 1],
        logits_indices=qsl[1:][[0, b - 1]] - 1,
        pending_token_indices=np.zeros(0, dtype=np.int64),
        pending_sample_rows=np.zeros(0, dtype=np.int64),
    )


def test_staged_views_hold_the_step_arrays_in_their_dtypes() -> None:
    buffers = DeviceInputBuffers(max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=6,
                                 device=torch.device("cpu"))
    for query_lens, width in (([5, 1, 3], 4), ([1, 1, 1, 1], 6)):  # a second, differently shaped step
        step = _step(query_lens, width)
        staged = buffers.stage(step)
        for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
            assert getattr(staged, name).dtype == torch.int64
            assert getattr(staged, name).tolist() == getattr(step, name).tolist(), name
        for name in ("query_start_loc", "seq_lens"):
            assert getattr(staged, name).dtype == torch.int32
            assert getattr(staged, name).tolist() == getattr(step, name).tolist(), name
        # Rows padded to 16 blocks (one stride class for the kernels); real columns first.
        assert staged.block_tables.shape == (len(query_lens), 16)
        assert staged.block_tables[:, :width].tolist() == step.block_tables.tolist()


def test_staged_segments_are_aligned_for_the_kernels() -> None:
    buffers = DeviceInputBuffers(max_num_tokens=64, max_num_seqs=8, max_blocks_per_seq=20,
                                 device=torch.device("cpu"))
    staged = buffers.stage(_step([3, 1, 1], 5))
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices",
                 "query_start_loc", "seq_lens", "block_tables"):
        assert getattr(staged, name).data_ptr() % 16 == 0, name
    assert staged.block_tables.stride(0) % 16 == 0


def test_a_step_larger_than_the_buffers_is_refused() -> None:
    buffers = DeviceInputBuffers(max_num_tokens=4, max_num_seqs=4, max_blocks_per_seq=6,
                                 device=torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds the input buffers"):
        buffers.stage(_step([3, 3], 2))
