"""Engine limits that default by device: a GPU runs larger steps than the CPU."""

from __future__ import annotations

import torch

from pagedllm.engine.arg_utils import CUDA_MAX_NUM_BATCHED_TOKENS, CUDA_MAX_NUM_SEQS, EngineArgs
from pagedllm.worker.cuda_graphs import MAX_CAPTURE_SIZE


def _limits(model: str, **kwargs) -> tuple[int, int]:
    scheduler = EngineArgs(model=model, **kwargs).create_engine_config().scheduler_config
    return scheduler.max_num_seqs, scheduler.max_num_batched_tokens


def test_cuda_runs_512_requests_at_once_and_the_cpu_256(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA config on any host
    model = str(tiny_model_dir)
    assert _limits(model, device="cuda") == (512, CUDA_MAX_NUM_BATCHED_TOKENS)
    assert _limits(model, device="cpu") == (256, 2048)
    assert _limits(model, device="cuda", max_num_seqs=64) == (64, CUDA_MAX_NUM_BATCHED_TOKENS)
    assert _limits(model, device="cpu", max_num_seqs=1024) == (1024, 2048)
    # Every decode batch of the default fits a captured graph.
    assert CUDA_MAX_NUM_SEQS <= MAX_CAPTURE_SIZE
