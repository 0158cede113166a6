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

FP8 experts (``make_fp8`` for an FP8 checkpoint, ``quantize_fp8`` at load): ``w13`` and
``w2`` in float8_e4m3fn with float32 scales ``w13_scale`` / ``w2_scale``, one per output
channel (``[E, 2I, 1]``, ``[E, H, 1]``) or, block-wise, one per ``fp8_block = (rows,
columns)`` of each expert's weight; inputs are quantized per token (and group) in the step,
or with static scales (``w13_input_scale`` for the gate/up input, ``w2_input_scale`` for
the down input: the largest of the experts' own, as every expert reads the same rows;
``torch_ref.ExpertScales``). Block-wise, the up rows and each rank's part start on a block.
INT8 W8A8 experts (``make_int8``) are the per-channel form with int8 weights, their inputs
quantized to int8 (``quantization.int8``).

Integer experts (``make_int``, W4A16 / W8A16 from GPTQ, AWQ or compressed-tensors
checkpoints): ``w13`` and ``w2`` hold each expert's weights packed in int32 words in
``int_weights``' stored layout, with ``w13_scales`` / ``w2_scales`` (the model's dtype)
and ``w13_zeros`` / ``w2_zeros`` (uint8) per output row and group of inputs, converted
tensor by tensor from the checkpoint's layout at load; act-order experts keep each
expert's sorted input order in ``w13_perm`` / ``w2_perm`` (``finish_int_load``; the gate
and up of an expert read one input, so they must share ``g_idx``). With tensor
parallelism the down projections split along their inputs in whole words and groups.
bitsandbytes' 4-bit experts (a codebook scheme) keep float32 scales and no zero points
(``w13_zeros`` / ``w2_zeros`` None; ``codebook`` holds the 16 values); ``quantize_int``
makes them from loaded weights (``--quantization bitsandbytes``).

The router is never quantized.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import sharding
from pagedllm.distributed.parallel_state import all_reduce, get_tp
from pagedllm.layers.activation import GatedActivation
from pagedllm.layers.fused_moe.routing import select_experts
from pagedllm.layers.fused_moe.triton_moe import fused_moe_triton, int_block_k
from pagedllm.layers.fused_moe.torch_ref import (
    ExpertInts,
    ExpertQuant,
    ExpertScales,
    fused_moe_dense,
    fused_moe_reference,
)
from pagedllm.layers.linear import BLOCK_SCALE_NAME, Linear, _frozen
from pagedllm.layers.triton_ops import use_fused_ops
from pagedllm.quantization import bitsandbytes, int_weights
from pagedllm.quantization.checkpoint import IntWeightScheme
from pagedllm.quantization.fp8 import FP8_DTYPE, quantize_rows

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
        self.checkpoint_intermediate_size = intermediate_size
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
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        self.w13_input_scale: nn.Parameter | None = None
        self.w2_input_scale: nn.Parameter | None = None
        self.fp8_block: tuple[int, int] | None = None
        self.int_scheme: IntWeightScheme | None = None
        self.register_buffer("w13_perm", None)
        self.register_buffer("w2_perm", None)
        self.register_buffer("codebook", None)  # a codebook scheme's 16 values (float32)
        # Parameters the checkpoint need not hold (symmetric compressed-tensors' zero
        # points); act-order g_idx per (expert, shard), until finish_int_load.
        self._preset: frozenset[str] = frozenset()
        self._g_idx: dict[tuple[int, str], torch.Tensor] = {}
        # Whether the grouped GEMM tiles the integer experts (else the torch products).
        self._int_tiles = True

    @property
    def scales(self) -> ExpertQuant | None:
        """What the quantized weights' products need besides ``w13`` and ``w2``: FP8
        scales or integer scales and zero points (None: the experts are in the model's
        dtype)."""
        if self.int_scheme is not None:
            return ExpertInts(self.w13_scales, self.w13_zeros, self.w2_scales, self.w2_zeros,
                              self.int_scheme.bits, self.int_scheme.group_size,
                              self.w13_perm, self.w2_perm, self.codebook)
        if self.w13_scale is None:
            return None
        return ExpertScales(self.w13_scale, self.w2_scale, self.fp8_block,
                            self.w13_input_scale, self.w2_input_scale)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        scales = self.scales
        if self.act.is_silu and use_fused_ops(x) and self._int_tiles:
            return fused_moe_triton(x, self.w13, self.w2, weights, ids, scales=scales)
        if x.is_cuda:  # no host sync: the step may be captured in a CUDA graph
            return fused_moe_dense(x, self.w13, self.w2, weights, ids, self.act._fn, scales)
        return fused_moe_reference(x, self.w13, self.w2, weights, ids, self.act._fn, scales)

    def make_fp8(self, block: tuple[int, int] | None = None,
                 static_input: bool = False) -> None:
        """The parameters an FP8 checkpoint fills: FP8 weights and their scales, per output
        channel or per ``block``, and with ``static_input`` the two input scales (starting
        at 0: the largest loaded is kept). Raises ValueError when the up rows or this
        rank's intermediate columns would start inside a block."""
        self._make_byte_weights(FP8_DTYPE, block, static_input)

    def make_int8(self, static_input: bool = False) -> None:
        """The parameters an INT8 W8A8 checkpoint fills: as ``make_fp8``'s per channel,
        with int8 weights (inputs quantized to int8 in the step: ``quantization.int8``)."""
        self._make_byte_weights(torch.int8, None, static_input)

    def _make_byte_weights(self, dtype: torch.dtype, block: tuple[int, int] | None,
                           static_input: bool) -> None:
        experts, two_inter, hidden = self.w13.shape
        inter = self.intermediate_size
        device = self.w13.device
        if block is not None:
            start = self.tp_part[0]
            last = start + inter == self.checkpoint_intermediate_size
            if inter % block[0] or start % block[0] or start % block[1] or (
                    inter % block[1] and not last):
                raise ValueError(
                    f"block-wise FP8 experts of {inter} intermediate rows (from {start} on "
                    f"this rank) in blocks of {list(block)}: the up rows and each rank's part "
                    "must start on a block; use a tensor-parallel size that splits the "
                    "experts in whole blocks.")
            self.fp8_block = block
            shapes = ((experts, two_inter // block[0], -(-hidden // block[1])),
                      (experts, -(-hidden // block[0]), -(-inter // block[1])))
        else:
            shapes = ((experts, two_inter, 1), (experts, hidden, 1))
        self.w13 = nn.Parameter(torch.empty(self.w13.shape, dtype=dtype, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.w2.shape, dtype=dtype, device=device),
                               requires_grad=False)
        self.w13_scale, self.w2_scale = (
            nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device),
                         requires_grad=False) for shape in shapes)
        if static_input:
            self.w13_input_scale, self.w2_input_scale = (
                nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device),
                             requires_grad=False) for _ in range(2))

    def quantize_fp8(self) -> None:
        """Replace the loaded weights by their FP8 rows and per-channel scales (once)."""
        if self.w13_scale is not None:
            return
        quantized = []
        for weight in (self.w13.data, self.w2.data):
            values, scale = quantize_rows(weight.reshape(-1, weight.shape[-1]))
            quantized.append((values.view(weight.shape), scale.view(*weight.shape[:2], 1)))
        (w13, s13), (w2, s2) = quantized
        self.w13, self.w2, self.w13_scale, self.w2_scale = (
            nn.Parameter(t, requires_grad=False) for t in (w13, w2, s13, s2))

    def make_int(self, scheme: IntWeightScheme) -> None:
        """The parameters an integer-weight checkpoint of ``scheme`` fills (see the module
        docstring); scales take the default dtype (the model's), float32 for a codebook
        scheme, which has no zero points. Zero points start at ``2**(bits - 1)``, all a
        symmetric compressed-tensors checkpoint implies."""
        experts, two_inter, hidden = self.w13.shape
        inter = self.intermediate_size
        device = self.w13.device
        per_word = int_weights.values_per_word(scheme.bits)
        if scheme.codebook is not None:  # one group size for both products
            groups = {bitsandbytes.stored_group(n)
                      for n in (hidden, self.checkpoint_intermediate_size)}
            if len(groups) > 1:
                raise ValueError(f"bitsandbytes experts of {hidden} and "
                                 f"{self.checkpoint_intermediate_size} inputs a row: pagedllm "
                                 "needs rows of a multiple of 64 inputs for 4-bit experts.")
            scheme = replace(scheme, group_size=groups.pop())
            self.codebook = bitsandbytes.code_values(scheme.codebook).to(device)
        for name, rows, inputs in (("w13", two_inter, hidden), ("w2", hidden, inter)):
            groups = int_weights.num_groups(inputs, scheme.group_size)
            setattr(self, name, _frozen(torch.empty(experts, rows, -(-inputs // per_word),
                                                    dtype=torch.int32, device=device)))
            codebook = scheme.codebook is not None
            setattr(self, f"{name}_scales", _frozen(torch.empty(
                experts, rows, groups, dtype=torch.float32 if codebook else None,
                device=device)))
            setattr(self, f"{name}_zeros", None if codebook else _frozen(torch.full(
                (experts, rows, groups), 1 << (scheme.bits - 1), dtype=torch.uint8,
                device=device)))
        self.int_scheme = scheme
        self._int_tiles = int_block_k(16, hidden, inter, scheme.group_size) is not None
        if scheme.symmetric and scheme.layout == "compressed-tensors":
            self._preset = frozenset({"w13_zeros", "w2_zeros"})

    def quantize_int(self, scheme: IntWeightScheme) -> None:
        """Replace the loaded weights by 4-bit codes in ``scheme``'s codebook, each expert's
        gate, up and down quantized as bitsandbytes quantizes one projection
        (``bitsandbytes.quantize``), once."""
        if self.int_scheme is not None:
            return
        loaded = {"w13": self.w13.data, "w2": self.w2.data}
        self.make_int(scheme)
        inter = self.intermediate_size
        for name, weight in loaded.items():
            parts = (slice(0, inter), slice(inter, 2 * inter)) if name == "w13" else (
                slice(None),)
            for expert in range(self.num_experts):
                for rows in parts:
                    codes, scales = bitsandbytes.quantize(weight[expert, rows], scheme.codebook)
                    getattr(self, name).data[expert, rows] = int_weights.pack_rows(codes,
                                                                                   scheme.bits)
                    getattr(self, f"{name}_scales").data[expert, rows] = scales

    def finish_int_load(self) -> None:
        """After loading: sort each act-order expert's input columns by group
        (``int_weights.act_order_permutation``) into ``w13_perm`` / ``w2_perm``. Raises
        ValueError naming the expert when its gate and up hold different ``g_idx``, or when
        some experts' projections hold a ``g_idx`` and others none."""
        g_idx, self._g_idx = self._g_idx, {}
        scheme = self.int_scheme
        if scheme is None:
            return
        if not g_idx:
            int_weights.require_g_idx(scheme, "the experts")
            return
        hidden = self.w2.shape[1]
        for param_name, shards, inputs in (("w13", ("gate", "up"), hidden),
                                           ("w2", ("down",), self.intermediate_size)):
            weight = getattr(self, param_name).data
            perms, sorted_any = [], False
            for expert in range(self.num_experts):
                if not any((expert, shard) in g_idx for shard in shards):
                    raise ValueError(f"expert {expert}'s {'/'.join(shards)} projection holds "
                                     "no g_idx, while other experts' do.")
                perm = int_weights.shared_input_order(
                    [g_idx.get((expert, shard)) for shard in shards], scheme.group_size,
                    weight.device, f"expert {expert}'s gate and up projections")
                if perm is None:
                    perm = torch.arange(inputs, device=weight.device)
                else:
                    sorted_any = True
                    weight[expert] = int_weights.permute_columns(weight[expert], scheme.bits,
                                                                 inputs, perm)
                perms.append(perm)
            if sorted_any:
                setattr(self, f"{param_name}_perm", torch.stack(perms).to(torch.int32))

    def load_parts(self) -> list[tuple[str, str]]:
        """Every (parameter, part) a checkpoint must fill: ``"e:gate"``, ``"e:up"``,
        ``"e:down"`` per expert ``e`` (of the scales too, for FP8 experts, and of the
        scales and zero points for integer ones)."""
        params = (("w13", "gate"), ("w13", "up"), ("w2", "down"))
        if self.int_scheme is not None:
            params += tuple((f"{p}_{kind}", part) for p, part in params
                            for kind in ("scales", "zeros") if f"{p}_{kind}" not in self._preset
                            and getattr(self, f"{p}_{kind}") is not None)
        elif self.w13_scale is not None:
            params += (("w13_scale", "gate"), ("w13_scale", "up"), ("w2_scale", "down"))
        if self.w13_input_scale is not None:
            params += (("w13_input_scale", "gate"), ("w13_input_scale", "up"),
                       ("w2_input_scale", "down"))
        return [(param, f"{e}:{part}") for e in range(self.num_experts)
                for param, part in params]

    def load(self, name: str, tensor: torch.Tensor) -> list[tuple[str, str]]:
        """Copy a checkpoint tensor named relative to this module (``N.w1.weight``,
        ``gate_up_proj``, ...) into its rows; returns the parts it filled. Raises
        ValueError on an unknown name, expert or shape."""
        parts = name.split(".")
        tensor = sharding.read(tensor)
        if self.int_scheme is not None:
            return self._load_int(name, tensor)
        if self.w13_scale is not None and parts[-1] in ("weight", *STACKED_TENSORS) \
                and tensor.dtype != self.w13.dtype:
            kind = "FP8 (float8_e4m3fn)" if self.w13.dtype == FP8_DTYPE else "int8"
            raise ValueError(f"expert weights are {kind} in this checkpoint's "
                             f"quantization_config, got {tensor.dtype}.")
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
        scale_names = () if self.w13_scale is None else (
            ("weight_scale", BLOCK_SCALE_NAME) if self.fp8_block else ("weight_scale",))
        if self.w13_input_scale is not None:
            scale_names += ("input_scale",)
        is_scale = len(parts) == 3 and parts[2] in scale_names
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in EXPERT_TENSORS \
                or not (parts[2] == "weight" or is_scale):
            takes = ", ".join(("weight",) + scale_names)
            raise ValueError(f"no expert tensor is called {name!r} (each expert's "
                             f"projection takes {takes}).")
        expert = self._expert(parts[0])
        param_name, shard = EXPERT_TENSORS[parts[1]]
        if parts[2] == "input_scale" and is_scale:
            if tensor.numel() != 1:
                raise ValueError(f"{name}: an input scale must be one value (per tensor), got "
                                 f"shape {tuple(tensor.shape)}.")
            param = getattr(self, f"{param_name}_input_scale").data
            param.copy_(torch.maximum(param, tensor.float().reshape(1).to(param.device)))
            return [(f"{param_name}_input_scale", f"{expert}:{shard or 'down'}")]
        if is_scale:
            return self._load_scale(param_name, shard, expert, tensor)
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

    def _load_int(self, name: str, tensor: torch.Tensor) -> list[tuple[str, str]]:
        """An integer-weight checkpoint tensor of one expert (``N.gate_proj.qweight``, ...)
        converted to the stored layout (``int_weights.convert``) into this rank's rows of
        its parameter; a ``g_idx`` is kept for ``finish_int_load``."""
        scheme = self.int_scheme
        names = int_weights.checkpoint_names(scheme)
        parts = name.split(".")
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in EXPERT_TENSORS \
                or parts[2] not in names:
            raise ValueError(f"no expert tensor is called {name!r}: the experts' weights are "
                             f"{scheme.bits}-bit integers in the {scheme.layout} layout, one "
                             f"projection per expert, each taking {', '.join(names)}.")
        expert = self._expert(parts[0])
        param_name, shard = EXPERT_TENSORS[parts[1]]
        shard = shard or "down"
        hidden, full = self.w2.shape[1], self.checkpoint_intermediate_size
        rows, inputs = (hidden, full) if shard == "down" else (full, hidden)
        stored, tensor = int_weights.convert(scheme, parts[2], tensor.to(self.w13.device),
                                             rows, inputs)
        if stored is None:
            return []
        start, length = self.tp_part
        if length != full:  # this rank's rows of the gate and up, inputs of the down
            tensor = int_weights.rank_part(scheme, stored, tensor, int(shard == "down"),
                                           start, length)
        if stored == "g_idx":
            self._g_idx[(expert, shard)] = tensor
            return []
        target = param_name if stored == "qweight" else f"{param_name}_{stored}"
        rows = getattr(self, target).data[expert]
        if shard == "gate":
            rows = rows[:self.intermediate_size]
        elif shard == "up":
            rows = rows[self.intermediate_size:]
        _copy(rows, tensor)
        return [(target, f"{expert}:{shard}")]

    def _expert(self, index: str) -> int:
        expert = int(index)
        if expert >= self.num_experts:
            raise ValueError(f"expert {expert} is past the {self.num_experts} experts "
                             "config.json declares.")
        return expert

    def _load_scale(self, param_name: str, shard: str | None, expert: int,
                    tensor: torch.Tensor) -> list[tuple[str, str]]:
        """An FP8 expert weight's scales into the rows of ``expert``'s: per channel (one
        value per row, or one for the whole tensor) or per block, this rank's part."""
        scale_name = f"{param_name}_scale"
        rows = getattr(self, scale_name).data[expert]
        block = self.fp8_block
        start, length = self.tp_part
        size = self.intermediate_size
        if block is None:
            if shard in ("gate", "up"):
                rows = rows[:size] if shard == "gate" else rows[size:]
            values = tensor.float().reshape(-1)
            if values.numel() == 1:  # per tensor: the same scale on every row
                values = values.expand(rows.shape[0])
            elif shard in ("gate", "up"):
                values = values.narrow(0, start, length)
            values = values.reshape(-1, 1)
        else:
            if shard in ("gate", "up"):
                blocks = size // block[0]
                rows = rows[:blocks] if shard == "gate" else rows[blocks:]
                tensor = tensor.narrow(0, start // block[0], blocks)
            else:
                tensor = tensor.narrow(1, start // block[1], -(-size // block[1]))
            values = tensor.float()
        _copy(rows, values)
        return [(scale_name, f"{expert}:{shard or 'down'}")]

    def _rank_rows(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's intermediate rows (along ``dim``) of a gate or up weight."""
        return tensor.narrow(dim, *self.tp_part)

    def _rank_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's intermediate columns (the last dimension) of a down weight."""
        return tensor.narrow(-1, *self.tp_part)

    def extra_repr(self) -> str:
        quant = ""
        if self.int_scheme is not None:
            order = ", act-order" if self.w13_perm is not None or self.w2_perm is not None \
                else ""
            values = self.int_scheme.codebook or f"int{self.int_scheme.bits}"
            quant = f", {values} groups of {self.int_scheme.group_size}{order}"
        elif self.w13_scale is not None:
            kind = "int8 w8a8" if self.w13.dtype == torch.int8 else "fp8"
            quant = f", {kind}" + (f" blocks of {self.fp8_block[0]}x{self.fp8_block[1]}"
                                   if self.fp8_block else "")
        return (f"experts={self.num_experts}, top_k={self.top_k}, "
                f"intermediate={self.intermediate_size}, renormalize={self.renormalize}{quant}")


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
