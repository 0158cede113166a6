"""This process's place among the ranks: its tensor-parallel group and pipeline stage, and
the collectives and transfers between them.

One process runs one rank. Rank ``r`` of ``tp * pp`` is tensor-parallel rank ``r % tp`` of
pipeline stage ``r // tp``; each stage's ``tp`` ranks form a tensor-parallel group, and
rank ``r`` passes its stage's hidden states to rank ``r + tp`` of the next stage. With one
rank (the default, and every process that never calls ``init_distributed``) the group is
this process alone: the collectives return their input untouched and the layers build
their full weights, so the single-device path runs exactly the code it ran before
parallelism existed.

The collectives go through ``torch.distributed``: NCCL between GPUs, gloo between CPU
processes (so the whole parallel path runs and is tested on the CPU). On CUDA they are
enqueued on the current stream and captured by CUDA graphs like any kernel.
"""

from __future__ import annotations

import functools
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


@dataclass(frozen=True)
class PipelineStage:
    """``stage`` of ``num_stages`` (0 of 1 when not pipelined); ``rank`` is the global
    rank, ``tp_size`` the ranks per stage."""

    stage: int = 0
    num_stages: int = 1
    rank: int = 0
    tp_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The decoder layers ``[start, end)`` this stage holds: an even split, the earlier
        stages taking one more where it does not divide (the last stage also holds the
        LM head)."""
        return stage_layer_range(num_layers, self.stage, self.num_stages)


def stage_layer_range(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


_TP = TensorParallelGroup()
_PP = PipelineStage()


def get_tp() -> TensorParallelGroup:
    return _TP


def get_pp() -> PipelineStage:
    return _PP


def init_distributed(rank: int, world_size: int, tensor_parallel_size: int, init_method: str,
                     device: str, timeout_s: float = 600.0) -> None:
    """Join the ``world_size`` processes rendezvousing at ``init_method``
    (``tcp://host:port``) as ``rank``, and form the tensor-parallel groups of
    ``tensor_parallel_size`` ranks (one per pipeline stage): NCCL on ``device`` "cuda" (the
    current CUDA device must already be this rank's), gloo on "cpu". NVLink multicast
    (NVLS) stays off unless the environment turns it on."""
    global _TP, _PP
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {}
    if device == "cuda":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s),
                            **kwargs)
    tp = tensor_parallel_size
    num_stages = world_size // tp
    stage = rank // tp
    group = dist.group.WORLD
    if num_stages > 1:  # every rank makes every group, in the same order
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(num_stages)]
        group = groups[stage]
    _TP = TensorParallelGroup(rank % tp, tp, group if tp > 1 else None)
    _PP = PipelineStage(stage, num_stages, rank, tp)


def destroy_distributed() -> None:
    global _TP, _PP
    _SENDS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP, _PP = TensorParallelGroup(), PipelineStage()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks (in place; returns ``x``)."""
    if _TP.size > 1:
        dist.all_reduce(x, group=_TP.group)
    return x


def max_over_ranks_(x: torch.Tensor) -> torch.Tensor:
    """The elementwise largest of ``x`` over the ranks (in place; returns ``x``)."""
    if _TP.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_TP.group)
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
    """The smallest of all ranks' ``value`` (e.g. the KV blocks each rank's memory holds)."""
    if _TP.size == 1 and _PP.num_stages == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


# Sends in flight (their tensors must live until sent), oldest first.
_SENDS: list = []
MAX_SENDS_IN_FLIGHT = 64


def _send(tensor: torch.Tensor, to_rank: int) -> None:
    """Send without waiting for the receiver; the oldest sends are waited for once many
    are in flight."""
    _SENDS.append(dist.isend(tensor.contiguous(), to_rank))
    while len(_SENDS) > MAX_SENDS_IN_FLIGHT:
        _SENDS.pop(0).wait()


def send_to_next_stage(*tensors: torch.Tensor) -> None:
    """Hand this stage's outputs to the same tensor-parallel rank of the next stage (which
    receives them with ``recv_from_previous_stage``), without waiting for it."""
    for tensor in tensors:
        _send(tensor, _PP.rank + _PP.tp_size)


def recv_from_previous_stage(count: int, shape: tuple[int, ...], dtype: torch.dtype,
                             device: torch.device | str) -> list[torch.Tensor]:
    """The previous stage's ``count`` tensors of ``shape`` for this step."""
    tensors = [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
    for tensor in tensors:
        dist.recv(tensor, _PP.rank - _PP.tp_size)
    return tensors


def send_sampled_ids(ids: torch.Tensor) -> None:
    """Last stage: a step's sampled ids to the same tensor-parallel rank of every earlier
    stage (whose inputs need them), without waiting for them to be taken."""
    for stage in range(_PP.num_stages - 1):
        _send(ids, stage * _PP.tp_size + _PP.rank % _PP.tp_size)


def recv_sampled_ids(count: int, device: torch.device | str):
    """Earlier stages: ``(ids, wait)``: the buffer the last stage's ``count`` sampled ids of
    this step arrive in, and the function that waits for them (so later steps launch
    meanwhile). Nothing may read ``ids`` before ``wait()`` has returned: gloo fills it from
    another thread, and NCCL on its own stream (``wait`` orders the current stream after
    it). ``wait`` may be called again: it waits once (a second wait on gloo's receive would
    wait for another message)."""
    ids = torch.empty(count, dtype=torch.int64, device=device)
    last = (_PP.num_stages - 1) * _PP.tp_size + _PP.rank % _PP.tp_size
    return ids, functools.cache(dist.irecv(ids, last).wait)
