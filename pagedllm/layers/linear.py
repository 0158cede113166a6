"""Linear layers whose parameters are allocated, never initialised.

Every weight is overwritten by the loader (a checkpoint or dummy values), so the layers
allocate with ``torch.empty`` on the current default device and dtype: building an 8B
model on a GPU costs no initialisation kernels and no host copy.

``FusedLinear`` stacks several checkpoint projections into one matmul (``[q; k; v]``,
``[gate; up]``); each named shard owns a contiguous block of output rows::

    weight rows:  [ shard 0 | shard 1 | ... ]      out = x @ weight.T (+ bias)

An FP8 projection (``pagedllm.quantization.fp8``) holds a float8_e4m3fn ``weight``, a
float32 ``weight_scale [out, 1]`` and, with static activation scales, a float32
``input_scale [1]``. An integer-weight projection (W4A16, W8A16) holds no ``weight`` but
``qweight``, ``scales`` and ``zeros`` in the stored layout of
``pagedllm.quantization.int_weights`` (rows are output channels there too, so shards are
row blocks), and with act-order the ``act_perm`` of its input columns. ``Linear.load``
fills all of them from checkpoint tensors, converting each format's tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.int_matmul import int_linear
from pagedllm.layers.triton_ops import small_batch_matmul, use_small_batch_matmul
from pagedllm.quantization import int_weights
from pagedllm.quantization.checkpoint import IntWeightScheme
from pagedllm.quantization.fp8 import FP8_DTYPE, fp8_linear, quantize_rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None,
           input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``; small CUDA batches (decode steps of a few sequences) take the
    Triton matrix-vector kernel (``triton_ops.small_batch_matmul``), the rest BLAS.
    ``weight_scale``: an FP8 weight's row scales, ``input_scale``: its static activation
    scale, if any (FP8 W8A8, see ``fp8_linear``)."""
    if use_small_batch_matmul(x, weight):
        if weight_scale is None:
            return small_batch_matmul(x, weight, bias)
        return small_batch_matmul(x, weight, bias, weight_scale=weight_scale,
                                  input_scale=input_scale)
    if weight_scale is not None:
        return fp8_linear(x, weight, weight_scale, bias, input_scale)
    return F.linear(x, weight, bias)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight: [output_size, input_size]``.

    FP8 (after ``make_fp8`` and loading, or ``quantize_fp8``): the weight is
    float8_e4m3fn with ``weight_scale [output_size, 1]`` (float32, one per output channel),
    optionally ``input_scale [1]``, and the product is FP8 W8A8
    (``pagedllm.quantization.fp8``).

    Integer weights (after ``make_int``, loading and ``finish_int_load``): ``weight`` is
    None, ``int_scheme`` says the bits and groups of ``qweight``/``scales``/``zeros``, and
    the product is ``layers.int_matmul.int_linear``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _frozen(torch.empty(output_size, input_size))
        self.bias = _frozen(torch.empty(output_size)) if bias else None
        self.register_parameter("weight_scale", None)
        self.register_parameter("input_scale", None)
        self.int_scheme: IntWeightScheme | None = None
        self.register_buffer("act_perm", None)
        # Parameters the checkpoint need not hold (filled when made); act-order g_idx per
        # shard, until finish_int_load.
        self._preset: frozenset[str] = frozenset()
        self._g_idx: dict[str | None, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int_scheme is not None:
            return int_linear(x, self.qweight, self.scales, self.zeros,
                              bits=self.int_scheme.bits, group_size=self.int_scheme.group_size,
                              in_features=self.input_size, bias=self.bias, perm=self.act_perm)
        return linear(x, self.weight, self.bias, self.weight_scale, self.input_scale)

    def make_int(self, scheme: IntWeightScheme) -> None:
        """Replace the weight by the parameters an integer-weight checkpoint of ``scheme``
        fills (``int_weights``' stored layout); scales take the default dtype (the model's).
        Zero points start at ``2**(bits - 1)``, all a symmetric compressed-tensors
        checkpoint implies (it stores none)."""
        device = self.weight.device
        words = -(-self.input_size // int_weights.values_per_word(scheme.bits))
        groups = int_weights.num_groups(self.input_size, scheme.group_size)
        self.register_parameter("weight", None)
        self.qweight = _frozen(torch.empty(self.output_size, words, dtype=torch.int32,
                                           device=device))
        self.scales = _frozen(torch.empty(self.output_size, groups, device=device))
        self.zeros = _frozen(torch.full((self.output_size, groups), 1 << (scheme.bits - 1),
                                        dtype=torch.uint8, device=device))
        self.int_scheme = scheme
        if scheme.symmetric and scheme.layout == "compressed-tensors":
            self._preset = frozenset({"zeros"})

    def finish_int_load(self) -> None:
        """After loading: sort the input columns of an act-order checkpoint by group
        (``int_weights.act_order_permutation``) into ``act_perm``. Raises ValueError when
        the shards of a fused projection hold different ``g_idx`` or an act-order
        checkpoint holds none."""
        g_idx, self._g_idx = self._g_idx, {}
        scheme = self.int_scheme
        if scheme is None:
            return
        if not g_idx:
            if scheme.act_order and scheme.layout != "compressed-tensors":
                raise ValueError("the checkpoint's quantization_config says desc_act=true but "
                                 "the projection has no g_idx.")
            return
        first = next(iter(g_idx.values()))
        if len(g_idx) != len(self._shards()) or any(
                not torch.equal(first, other) for other in g_idx.values()):
            raise ValueError(f"the projections fused here ({', '.join(map(str, self._shards()))}) "
                             "hold different g_idx; pagedllm needs one input order for them.")
        perm = int_weights.act_order_permutation(first.to(self.qweight.device),
                                                 scheme.group_size)
        if perm is not None:
            self.qweight.data = int_weights.permute_columns(
                self.qweight.data, scheme.bits, self.input_size, perm)
            self.act_perm = perm.to(torch.int32)

    def checkpoint_parameters(self) -> list[str]:
        """The parameters a checkpoint must fill (each once per shard)."""
        return [name for name, _ in self.named_parameters(recurse=False)
                if name not in self._preset]

    def reads(self, param_name: str) -> bool:
        """Whether ``load`` takes a checkpoint tensor called ``param_name``."""
        if self.int_scheme is not None and param_name in int_weights.checkpoint_names(
                self.int_scheme):
            return True
        return isinstance(getattr(self, param_name, None), nn.Parameter)

    def _shards(self) -> list[str | None]:
        return [None]

    def quantize_fp8(self) -> None:
        """Replace the loaded weight by its FP8 rows and their scales (once)."""
        if self.weight_scale is None:
            quantized, scale = quantize_rows(self.weight.data)
            self.weight = _frozen(quantized)
            self.weight_scale = _frozen(scale)

    def make_fp8(self, static_input: bool) -> None:
        """Give this projection the parameters an FP8 checkpoint fills: the FP8 weight, its
        row scales, and with ``static_input`` the activation scale (starting at 0: the
        largest of the loaded shards' scales is kept)."""
        device = self.weight.device
        self.weight = _frozen(torch.empty(self.weight.shape, dtype=FP8_DTYPE, device=device))
        self.weight_scale = _frozen(torch.empty(self.output_size, 1, dtype=torch.float32,
                                                device=device))
        if static_input:
            self.input_scale = _frozen(torch.zeros(1, dtype=torch.float32, device=device))

    def load(self, param_name: str, tensor: torch.Tensor, shard: str | None = None
             ) -> str | None:
        """Copy a checkpoint tensor into ``param_name`` (the rows of ``shard`` for a fused
        projection); returns the parameter filled, or None for a tensor kept aside
        (act-order ``g_idx``) or only checked (``weight_shape``).

        A ``weight_scale`` of one element (per tensor) fills all the rows it covers; an
        ``input_scale`` keeps the largest value loaded (the shards of a fused projection
        share one input, so one scale, and the largest never clips any of them). An
        integer-weight checkpoint's tensors are converted to the stored layout first.
        Raises ValueError when the parameter or shard is unknown or the shape does not
        match.
        """
        if self.int_scheme is not None and param_name in int_weights.checkpoint_names(
                self.int_scheme):
            rows = self._rows(self.scales, shard).shape[0]
            param_name, tensor = int_weights.convert(
                self.int_scheme, param_name, tensor.to(self.scales.device), rows,
                self.input_size)
            if param_name is None:
                return None
            if param_name == "g_idx":
                self._g_idx[shard] = tensor
                return None
        param = getattr(self, param_name, None)
        if not isinstance(param, nn.Parameter):
            kind = ""
            if self.int_scheme is not None:
                kind = (f" (its weights are {self.int_scheme.bits}-bit integers in the "
                        f"{self.int_scheme.layout} layout)")
            elif param_name.endswith("_scale"):
                kind = " (it is not FP8)"
            raise ValueError(f"This layer has no {param_name!r} parameter{kind}.")
        if param_name == "input_scale":
            if tensor.numel() != 1:
                raise ValueError(f"input_scale must be one value (per tensor), got shape "
                                 f"{tuple(tensor.shape)}.")
            param.data.copy_(torch.maximum(param.data, tensor.reshape(1).to(param.dtype)))
            return param_name
        rows = self._rows(param, shard)
        if param_name == "weight_scale":
            if tensor.numel() == 1:
                rows.fill_(tensor.reshape(()).item())
                return param_name
            tensor = tensor.reshape(-1, 1) if tensor.numel() == rows.shape[0] else tensor
        if tuple(tensor.shape) != tuple(rows.shape):
            where = f"shard {shard!r} of {param_name}" if shard else param_name
            raise ValueError(f"{where} expects shape {tuple(rows.shape)}, got "
                             f"{tuple(tensor.shape)}.")
        if param.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
            raise ValueError(f"{param_name} is FP8 (float8_e4m3fn) in this checkpoint's "
                             f"quantization_config, got {tensor.dtype}.")
        rows.copy_(tensor)
        return param_name

    def _rows(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        if shard is not None:
            raise ValueError(f"This layer is not fused; it has no shard {shard!r}.")
        return param.data

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"
                f"{self._format_repr()}")

    def _format_repr(self) -> str:
        if self.int_scheme is not None:
            scheme = self.int_scheme
            order = ", act-order" if self.act_perm is not None else ""
            return f", int{scheme.bits} groups of {scheme.group_size}{order}"
        if self.weight_scale is not None:
            return ", fp8 static input" if self.input_scale is not None else ", fp8"
        return ""


class FusedLinear(Linear):
    """One matmul whose output is the concatenation of named shards, in declaration order."""

    def __init__(self, input_size: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in self.shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def _rows(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        if shard not in self.shard_sizes:
            raise ValueError(f"Unknown shard {shard!r}; this layer has {list(self.shard_sizes)}.")
        return param.data.narrow(0, self.shard_offsets[shard], self.shard_sizes[shard])

    def _shards(self) -> list[str | None]:
        return list(self.shard_sizes)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, shards={self.shard_sizes}, bias={self.bias is not None}"
                f"{self._format_repr()}")


class Embedding(nn.Module):
    """Token id -> row of ``weight: [num_embeddings, embedding_dim]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
