"""Which tile the grouped MoE GEMM launches with, per layer shape and batch.

A tile is ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)``: ``BLOCK_M``
sorted slots by ``BLOCK_N`` output columns per program, ``BLOCK_K`` of the reduction per
step, ``GROUP_M`` row blocks walked together before the next column block (so a wave of
programs shares weight columns and activation rows in L2), and Triton's launch settings.

One tile serves both GEMMs of a layer call, because the slot sort (``triton_moe``) pads
each expert's run to ``BLOCK_M`` once and both launches read it; so the tile is chosen
before the sort. The choice, first match wins:

1. ``PAGEDLLM_MOE_TILE="BLOCK_M,BLOCK_N,BLOCK_K[,GROUP_M],num_warps,num_stages"``, for
   every call (for sweeps and trials; a malformed value raises ValueError);
2. ``DEFAULT_TILES[bucket]``.

The bucket is that of the average slots an expert receives, ``tokens * top_k / E``
(``E`` experts): ``"<=16"``, ``"<=64"``, ``"<=256"``, ``"<=1024"`` or ``">1024"``.
``scripts/bench_fused_moe.py --sweep`` times candidate tiles per expert shape and token
count against these.
"""

from __future__ import annotations

import functools
import os
from dataclasses import astuple, dataclass

TILE_ENV = "PAGEDLLM_MOE_TILE"
# Upper bounds of the buckets of average slots per expert; above the last is ">1024".
ROW_BUCKETS = (16, 64, 256, 1024)
BUCKETS = tuple(f"<={b}" for b in ROW_BUCKETS) + (f">{ROW_BUCKETS[-1]}",)
DEFAULT_GROUP_M = 8
WARPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class MoeTile:
    """Block sizes are powers of two of at least 16 (``tl.dot``'s smallest operand side),
    ``num_warps`` one of 1, 2, 4, 8, 16, ``group_m`` and ``num_stages`` at least 1."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = DEFAULT_GROUP_M
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        blocks = (self.block_m, self.block_n, self.block_k)
        if not all(b >= 16 and b & (b - 1) == 0 for b in blocks):
            raise ValueError(f"MoE tile blocks {blocks}: BLOCK_M, BLOCK_N and BLOCK_K must be "
                             "powers of two of at least 16.")
        if self.num_warps not in WARPS:
            raise ValueError(f"MoE tile num_warps={self.num_warps}: give one of {WARPS}.")
        if self.group_m < 1 or self.num_stages < 1:
            raise ValueError(f"MoE tile GROUP_M={self.group_m}, num_stages={self.num_stages}: "
                             "both must be at least 1.")

    def spec(self) -> str:
        """The tile as ``PAGEDLLM_MOE_TILE`` takes it (six values)."""
        return ",".join(str(v) for v in astuple(self))


# Slots an expert gets on average -> tile. A few rows an expert: 16-row blocks and long
# reduction steps, so the weights stream through with little padding; from 17 rows on:
# 128 x 128 blocks (the gated GEMM holds two such accumulators, gate and up) with 8 warps
# and 3 stages, the shape vLLM's tuned bf16 MoE configs settle on for Hopper. Both were
# picked from a sweep of Mixtral-8x7B's and Qwen3-30B-A3B's expert shapes on an H200
# (``scripts/bench_fused_moe.py --sweep``) as near the best at every token count.
_LARGE = MoeTile(128, 128, 64, num_warps=8, num_stages=3)
DEFAULT_TILES: dict[str, MoeTile] = {
    "<=16": MoeTile(16, 64, 128, num_warps=4, num_stages=4),
    "<=64": _LARGE,
    "<=256": _LARGE,
    "<=1024": _LARGE,
    ">1024": _LARGE,
}
assert tuple(DEFAULT_TILES) == BUCKETS


def row_bucket(num_slots: int, num_experts: int) -> str:
    """The bucket of ``num_slots / num_experts`` average slots per expert."""
    rows = num_slots / num_experts
    for bound in ROW_BUCKETS:
        if rows <= bound:
            return f"<={bound}"
    return BUCKETS[-1]


def choose_tile(num_experts: int, num_slots: int) -> MoeTile:
    """The tile for ``num_slots`` (token, choice) slots over ``num_experts`` experts, in
    the order the module docstring gives."""
    spec = os.environ.get(TILE_ENV)
    if spec:
        return parse_tile(spec)
    return DEFAULT_TILES[row_bucket(num_slots, num_experts)]


@functools.cache
def parse_tile(spec: str) -> MoeTile:
    """``"BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages"`` (``GROUP_M`` then defaults to
    8) or ``"BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,num_warps,num_stages"``; ValueError otherwise."""
    usage = (f"{TILE_ENV}={spec!r} is not a tile: give BLOCK_M,BLOCK_N,BLOCK_K,num_warps,"
             "num_stages or BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,num_warps,num_stages as integers, "
             "e.g. 128,128,64,8,3 (blocks powers of two >= 16, num_warps in 1, 2, 4, 8, 16)")
    try:
        values = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(usage + ".") from None
    if len(values) == 5:
        values.insert(3, DEFAULT_GROUP_M)
    if len(values) != 6:
        raise ValueError(usage + f"; it has {len(values)} values.")
    try:
        return MoeTile(*values)
    except ValueError as error:
        raise ValueError(f"{usage}. {error}") from None
