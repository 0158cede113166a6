"""The experts of one mixture-of-experts layer as two stacked weights, and the block that
routes tokens to them.

``w13 [E, 2I, H]`` holds each expert's gate rows then up rows, ``w2 [E, H, I]`` its down
projection: the layout newer checkpoints save (``experts.gate_up_proj``,
``experts.down_proj``). Checkpoints with one tensor per expert (``experts.N.w1/w3/w2``
in Mixtral, ``experts.N.gate_proj/up_proj/down_proj`` in Qwen3-MoE) are copied into
their expert's rows at load.

With tensor parallelism every rank holds every expert, each with its share of the
intermediate width (``I / tp`` gate, up and down columns, split like a dense MLP's), and
``MoEBlock`` sums the ranks' outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import sharding
from pagedllm.distributed.parallel_state import all_reduce, get_tp
from pagedllm.layers.activation import GatedActivation
from pagedllm.layers.fused_moe.routing import select_experts
from pagedllm.layers.fused_moe.torch_ref import fused_moe_dense, fused_moe_reference
from pagedllm.layers.linear import Linear
from pagedllm.layers.triton_ops import use_fused_ops

# Per-expert checkpoint module -> (our parameter, shard); shard None fills the whole expert.
EXPERT_TENSORS = {
    "w1": ("w13", "gate"), "gate_proj": ("w13", "gate"),
    "w3": ("w13", "up"), "up_proj": ("w13", "up"),
    "w2": ("w2", None), "down_proj": ("w2", None),
}
# Stacked checkpoint tensors -> our parameter.
STACKED_TENSORS = {"gate_up_proj": "w13", "down_proj": "w2"}


class FusedMoE(nn.Module):
    """``forward(x [T, H], router_logits [T, E]) -> [T, H]``: the routing-weighted sum of
    each token's ``top_k`` experts' gated MLPs."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, renormalize: bool, hidden_act: str = "silu") -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number "
                             f"of experts ({num_experts}).")
        self.num_experts = num_experts
        self.top_k = top_k
        tp = get_tp()
        # This rank's intermediate columns of each expert (start, length).
        self.tp_part = sharding.shard_range(intermediate_size, 1, tp.rank, tp.size)
        intermediate_size = self.tp_part[1]
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.act = GatedActivation(hidden_act)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                               requires_grad=False)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.act.is_silu and use_fused_ops(x):
            from pagedllm.layers.fused_moe.triton_moe import fused_moe_triton

            return fused_moe_triton(x, self.w13, self.w2, weights, ids)
        if x.is_cuda:  # no host sync: the step may be captured in a CUDA graph
            return fused_moe_dense(x, self.w13, self.w2, weights, ids, self.act._fn)
        return fused_moe_reference(x, self.w13, self.w2, weights, ids, self.act._fn)

    def load_parts(self) -> list[tuple[str, str]]:
        """Every (parameter, part) a checkpoint must fill: ``"e:gate"``, ``"e:up"``,
        ``"e:down"`` per expert ``e``."""
        return [(param, f"{e}:{part}") for e in range(self.num_experts)
                for param, part in (("w13", "gate"), ("w13", "up"), ("w2", "down"))]

    def load(self, name: str, tensor: torch.Tensor) -> list[tuple[str, str]]:
        """Copy a checkpoint tensor named relative to this module (``N.w1.weight``,
        ``gate_up_proj``, ...) into its rows; returns the parts it filled. Raises
        ValueError on an unknown name, expert or shape."""
        parts = name.split(".")
        tensor = sharding.read(tensor)
        if len(parts) == 1 and name in STACKED_TENSORS:
            param = getattr(self, STACKED_TENSORS[name])
            if name == "down_proj":
                tensor = self._rank_columns(tensor)
            else:  # [E, 2I, H]: this rank's gate rows, then its up rows
                gate, up = tensor.chunk(2, dim=1)
                tensor = torch.cat([self._rank_rows(gate, 1), self._rank_rows(up, 1)], dim=1)
            _copy(param.data, tensor)
            return [(p, part) for p, part in self.load_parts()
                    if p == STACKED_TENSORS[name]]
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in EXPERT_TENSORS \
                or parts[2] != "weight":
            raise ValueError(f"no expert tensor is called {name!r}.")
        expert = int(parts[0])
        if expert >= self.num_experts:
            raise ValueError(f"expert {expert} is past the {self.num_experts} experts "
                             "config.json declares.")
        param_name, shard = EXPERT_TENSORS[parts[1]]
        rows = getattr(self, param_name).data[expert]
        size = self.intermediate_size
        if shard == "gate":
            rows, tensor = rows[:size], self._rank_rows(tensor, 0)
        elif shard == "up":
            rows, tensor = rows[size:], self._rank_rows(tensor, 0)
        else:
            tensor = self._rank_columns(tensor)
        _copy(rows, tensor)
        return [(param_name, f"{expert}:{shard or 'down'}")]

    def _rank_rows(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's intermediate rows (along ``dim``) of a gate or up weight."""
        return tensor.narrow(dim, *self.tp_part)

    def _rank_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's intermediate columns (the last dimension) of a down weight."""
        return tensor.narrow(-1, *self.tp_part)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, "
                f"intermediate={self.intermediate_size}, renormalize={self.renormalize}")


def _copy(dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"Expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}.")
    dest.copy_(tensor)


class MoEBlock(nn.Module):
    """A sparse feed-forward block: the router ``gate`` (``[E, H]``, no bias) and the
    ``experts``; ``forward(x [T, H]) -> [T, H]`` (the down projection included)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, renormalize: bool, hidden_act: str = "silu") -> None:
        super().__init__()
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size,
                                renormalize, hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x, self.gate.weight)
        return all_reduce(self.experts(x, router_logits))
