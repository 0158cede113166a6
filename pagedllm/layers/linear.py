"""Linear layers whose parameters are allocated, never initialised.

Every weight is overwritten by the loader (a checkpoint or dummy values), so the layers
allocate with ``torch.empty`` on the current default device and dtype: building an 8B
model on a GPU costs no initialisation kernels and no host copy.

``FusedLinear`` stacks several checkpoint projections into one matmul (``[q; k; v]``,
``[gate; up]``); each named shard owns a contiguous block of output rows::

    weight rows:  [ shard 0 | shard 1 | ... ]      out = x @ weight.T (+ bias)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.triton_ops import small_batch_matmul, use_small_batch_matmul
from pagedllm.quantization.fp8 import fp8_linear, quantize_rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``; small CUDA batches (decode steps of a few sequences) take the
    Triton matrix-vector kernel (``triton_ops.small_batch_matmul``), the rest BLAS.
    ``weight_scale``: an FP8 weight's row scales (FP8 W8A8, see ``fp8_linear``)."""
    if use_small_batch_matmul(x, weight):
        if weight_scale is None:
            return small_batch_matmul(x, weight, bias)
        return small_batch_matmul(x, weight, bias, weight_scale=weight_scale)
    if weight_scale is not None:
        return fp8_linear(x, weight, weight_scale, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight: [output_size, input_size]``.

    After ``quantize_fp8`` the weight is float8_e4m3fn with ``weight_scale [output_size, 1]``
    (float32, one per output channel) and the product is FP8 W8A8
    (``pagedllm.quantization.fp8``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        )
        self.weight_scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale)

    def quantize_fp8(self) -> None:
        """Replace the loaded weight by its FP8 rows and their scales (once)."""
        if self.weight_scale is None:
            quantized, scale = quantize_rows(self.weight.data)
            self.weight = nn.Parameter(quantized, requires_grad=False)
            self.weight_scale = scale

    def extra_repr(self) -> str:
        fp8 = ", fp8" if self.weight_scale is not None else ""
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}{fp8}"


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

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor into ``shard``'s rows of ``weight`` or ``bias``.

        Raises ValueError when the shard is unknown or the tensor's shape does not match
        the rows it must fill.
        """
        if shard not in self.shard_sizes:
            raise ValueError(f"Unknown shard {shard!r}; this layer has {list(self.shard_sizes)}.")
        param = getattr(self, param_name)
        if param is None:
            raise ValueError(f"This layer has no {param_name!r} parameter.")
        rows = param.data.narrow(0, self.shard_offsets[shard], self.shard_sizes[shard])
        if tuple(tensor.shape) != tuple(rows.shape):
            raise ValueError(
                f"shard {shard!r} of {param_name} expects shape {tuple(rows.shape)}, "
                f"got {tuple(tensor.shape)}."
            )
        rows.copy_(tensor)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, shards={self.shard_sizes}, bias={self.bias is not None}"


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
