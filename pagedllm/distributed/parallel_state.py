"""This process's place in the tensor-parallel group, and the group's collectives.

One process runs one rank. With ``tensor_parallel_size`` 1 (the default, and every
process that never calls ``init_tensor_parallel``) the group is this process alone: the
collectives return their input untouched and the layers build their full weights, so the
single-device path runs exactly the code it ran before parallelism existed.

The collectives go through ``torch.distributed``: NCCL between GPUs, gloo between CPU
processes (so the whole parallel path runs and is tested on the CPU). On CUDA they are
enqueued on the current stream and captured by CUDA graphs like any kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """``rank`` of ``size`` (0 of 1 when not parallel); ``group`` is None for size 1."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


_TP = TensorParallelGroup()


def get_tp() -> TensorParallelGroup:
    return _TP


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: str,
                         timeout_s: float = 600.0) -> TensorParallelGroup:
    """Join the group of ``world_size`` processes rendezvousing at ``init_method``
    (``tcp://host:port``) as ``rank``: NCCL on ``device`` "cuda" (the current CUDA device
    must already be this rank's), gloo on "cpu". NVLink multicast (NVLS) stays off unless
    the environment turns it on."""
    global _TP
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {}
    if device == "cuda":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s),
                            **kwargs)
    _TP = TensorParallelGroup(rank, world_size, dist.group.WORLD)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP.group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallelGroup()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks (in place; returns ``x``)."""
    if _TP.size > 1:
        dist.all_reduce(x, group=_TP.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` on every rank -> ``[..., size * n]``: rank r's values at columns
    ``r * n .. (r + 1) * n``."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int, device: torch.device | str) -> int:
    """The smallest of the ranks' ``value`` (e.g. the KV blocks each rank's memory holds)."""
    if _TP.size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_TP.group)
    return int(tensor.item())
