"""Start-up checks of a tensor-parallel engine: each failure mode operators meet says what
to do before any rank starts (the heads and MLP width are checked earlier, in
``ParallelConfig.check_model``)."""

from __future__ import annotations

import logging
import os

from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

SHM_PATH = "/dev/shm"
# NCCL stages intra-node traffic in /dev/shm; Docker's default 64 MiB is not enough.
MIN_SHM_BYTES = 1 << 30


def shm_problem(size_bytes: int | None, tensor_parallel_size: int) -> str | None:
    """The message for a ``/dev/shm`` of ``size_bytes`` (None: absent) too small for
    NCCL between ``tensor_parallel_size`` GPUs, or None when it is large enough."""
    if size_bytes is not None and size_bytes >= MIN_SHM_BYTES:
        return None
    have = "no /dev/shm" if size_bytes is None else f"/dev/shm of {size_bytes >> 20} MiB"
    return (f"--tensor-parallel-size {tensor_parallel_size} needs shared memory for NCCL, and "
            f"this machine has {have} (at least {MIN_SHM_BYTES >> 30} GiB is needed). In "
            "Docker, run with --ipc=host or --shm-size=16g; in Kubernetes, mount an emptyDir "
            "with medium: Memory at /dev/shm.")


def shm_size(path: str = SHM_PATH) -> int | None:
    """Bytes of the shared-memory filesystem at ``path``, None when there is none."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_frsize * stat.f_blocks


def check_parallel_start(config: EngineConfig) -> None:
    """Raise ValueError for a start that cannot work (too few GPUs, too little
    ``/dev/shm`` for NCCL); warn about GPUs without peer-to-peer access. NVLink multicast
    (NVLS) stays off unless the environment turns it on."""
    size = config.parallel_config.world_size
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if config.device != "cuda":
        return
    import torch

    local = config.parallel_config.distributed_executor_backend == "mp"
    count = torch.cuda.device_count()
    if local and count < size:
        raise ValueError(f"{size} ranks (--tensor-parallel-size x --pipeline-parallel-size) "
                         f"need {size} GPUs on this host and torch sees {count}: lower the "
                         "sizes, or check CUDA_VISIBLE_DEVICES (across machines, use "
                         "--distributed-executor-backend ray).")
    problem = shm_problem(shm_size(), size)
    if problem is not None:
        raise ValueError(problem)
    if local and os.environ.get("NCCL_P2P_DISABLE") != "1":
        blocked = [(i, j) for i in range(size) for j in range(size)
                   if i != j and not torch.cuda.can_device_access_peer(i, j)]
        if blocked:
            i, j = blocked[0]
            logger.warning(
                "GPUs %d and %d cannot reach each other's memory directly (no peer-to-peer "
                "access); NCCL will route through host memory. If start-up or the first step "
                "hangs, set NCCL_P2P_DISABLE=1: all-reduces then always go through host "
                "memory, which costs tensor-parallel throughput.", i, j)
