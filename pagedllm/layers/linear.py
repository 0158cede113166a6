"""Linear layers whose parameters are allocated, never initialised.

Every weight is overwritten by the loader (a checkpoint or dummy values), so the layers
allocate with ``torch.empty`` on the current default device and dtype: building an 8B
model on a GPU costs no initialisation kernels and no host copy.

``FusedLinear`` stacks several checkpoint projections into one matmul (``[q; k; v]``,
``[gate; up]``); each named shard owns a contiguous block of output rows::

    weight rows:  [ shard 0 | shard 1 | ... ]      out = x @ weight.T (+ bias)

An FP8 projection (``pagedllm.quantization.fp8``) holds a float8_e4m3fn ``weight``, a
float32 ``weight_scale [out, 1]`` and, with static activation scales, a float32
``input_scale [1]``; with block-wise weights (``fp8_block = (rows, columns)``)
``weight_scale [cdiv(out, rows), cdiv(in, columns)]``, one scale per block, so each
shard of a fused projection, and each rank's part, starts on a block. An INT8 W8A8
projection (``pagedllm.quantization.int8``) holds an int8 ``weight`` with the same
``weight_scale [out, 1]`` (and ``input_scale`` when static); a bitsandbytes 8-bit one
(``pagedllm.quantization.llm_int8``) too, its ``weight_scale`` then each row's largest
magnitude (bitsandbytes' ``SCB``). An integer-weight
projection (W4A16, W8A16) holds no ``weight`` but ``qweight``, ``scales`` and ``zeros`` in
the stored layout of ``pagedllm.quantization.int_weights`` (rows are output channels there
too, so shards are row blocks), and with act-order the ``act_perm`` of its input columns.
``Linear.load`` fills all of them from checkpoint tensors, converting each format's tensors.

Tensor parallelism (``pagedllm.distributed``): a ``parallel="column"`` projection holds
its rank's output rows (each shard of a fused one split on its own, in whole heads), a
``parallel="row"`` one its rank's input columns and sums the ranks' partial products
(adding the bias once, after the sum); ``load`` takes the full checkpoint tensor, or a
``CheckpointSlice`` of it, and reads only the rank's part. With one rank (or
``parallel=None``) a layer holds everything, as it always did. ``VocabParallelEmbedding``
and an LM head made with ``parallel="vocab"`` split the vocabulary rows
(``sharding.vocab_range``); ``gather_logits`` joins the ranks' logits.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import sharding
from pagedllm.distributed.parallel_state import (
    all_gather_last_dim,
    all_reduce,
    get_tp,
    max_over_ranks_,
)
from pagedllm.layers.int_matmul import int_linear, wgmma_config
from pagedllm.layers.triton_ops import (
    IntWeights,
    int_small_batch_tile,
    small_batch_matmul,
    use_fused_ops,
    use_small_batch_matmul,
)
from pagedllm.quantization import bitsandbytes, int_weights
from pagedllm.quantization.checkpoint import IntWeightScheme
from pagedllm.quantization.fp8 import (
    FP8_DTYPE,
    Fp8Rows,
    Fp8Sums,
    fp8_block_linear,
    fp8_linear,
    quantize_rows,
)
from pagedllm.quantization.int8 import int8_linear
from pagedllm.quantization.llm_int8 import llm_int8_linear


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


def small_batch_product(proj: Linear, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None, *,
                        silu_gated: bool = False,
                        norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """``x @ proj.weight.T + bias`` on the small-batch kernel (``small_batch_matmul``, with
    ``silu_gated`` or ``norm`` riding on it), for every weight format: bf16/fp16, FP8 and
    packed integers. None where that kernel does not take the product (not CUDA, more rows
    than ``gemv_max_rows``, integer groups no tile fits, 4-bit steps the Hopper kernel
    takes (``int_matmul.wgmma_config``), rows already quantized for a larger FP8 product,
    block-wise FP8 weights, bitsandbytes' LLM.int8): the caller multiplies."""
    if isinstance(x, Fp8Rows) or proj.fp8_block is not None or proj.llm_int8_threshold is not None:
        return None
    scheme = proj.int_scheme
    if scheme is not None and scheme.codebook is not None:
        return None  # the lane-wise sums need (q - zero) * scale; int_linear takes codebooks
    if scheme is None:
        if not use_small_batch_matmul(x, proj.weight):
            return None
        return small_batch_matmul(x, proj.weight, bias, silu_gated=silu_gated, norm=norm,
                                  weight_scale=proj.weight_scale, input_scale=proj.input_scale)
    if not use_small_batch_matmul(x, proj.qweight) or (
            proj.zeros is not None and wgmma_config(x.shape[0], proj.qweight.shape[0],
                                                    proj.input_size, scheme.group_size,
                                                    scheme.bits, x.device) is not None):
        return None
    ints = IntWeights(proj.scales, proj.zeros, scheme.bits, scheme.group_size, proj.act_perm)
    if int_small_batch_tile(x.shape[0], proj.qweight.shape[0], proj.input_size, ints) is None:
        return None
    return small_batch_matmul(x, proj.qweight, bias, silu_gated=silu_gated, norm=norm,
                              int_weights=ints)


# The block scales' name in Qwen3's and DeepSeek-V3's FP8 checkpoints (``weight_scale`` in
# compressed-tensors'); either fills ``weight_scale``.
BLOCK_SCALE_NAME = "weight_scale_inv"


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

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 parallel: str | None = None, unit: int = 1) -> None:
        """``input_size``/``output_size``: the checkpoint's (all ranks'); ``parallel``:
        None (every rank holds the whole weight), "column" (output rows split in whole
        ``unit``s), "row" (input columns split) or "vocab" (output rows split as the
        vocabulary, padded; see ``sharding.vocab_range``)."""
        super().__init__()
        tp = get_tp()
        self._checkpoint_sizes = (output_size, input_size)
        self.parallel = parallel if tp.size > 1 else None
        # The checkpoint rows or columns this rank holds: (dim, start, length), or None.
        self.tp_part: tuple[int, int, int] | None = None
        if self.parallel == "column":
            start, output_size = sharding.shard_range(output_size, unit, tp.rank, tp.size)
            self.tp_part = (0, start, output_size)
        elif self.parallel == "vocab":
            start, length, output_size = sharding.vocab_range(output_size, tp.rank, tp.size)
            self.tp_part = (0, start, length)
        elif self.parallel == "row":
            start, input_size = sharding.shard_range(input_size, unit, tp.rank, tp.size)
            self.tp_part = (1, start, input_size)
        elif self.parallel is not None:
            raise ValueError(f"parallel must be None, 'column', 'row' or 'vocab', got "
                             f"{parallel!r}.")
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _frozen(torch.empty(output_size, input_size))
        self.bias = _frozen(torch.empty(output_size)) if bias else None
        self.register_parameter("weight_scale", None)
        self.register_parameter("input_scale", None)
        self.int_scheme: IntWeightScheme | None = None
        # Block-wise FP8 weights: the (rows, columns) one weight scale covers.
        self.fp8_block: tuple[int, int] | None = None
        self.register_buffer("act_perm", None)
        self.register_buffer("codebook", None)  # a codebook scheme's 16 values (float32)
        # bitsandbytes' LLM.int8 (``make_int8``): its outlier threshold.
        self.llm_int8_threshold: float | None = None
        # Parameters the checkpoint need not hold (filled when made); act-order g_idx per
        # shard, until finish_int_load.
        self._preset: frozenset[str] = frozenset()
        self._g_idx: dict[str | None, torch.Tensor] = {}

    @property
    def reduces(self) -> bool:
        """Whether the output is a sum over the tensor-parallel ranks (row-parallel)."""
        return self.parallel == "row"

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether this projection would quantize ``x`` (its input, or a tensor of the
        input's rows, dtype and device) for an FP8 product of its own: FP8 weights, on
        CUDA, more rows than the small-batch kernel takes. The op that makes the input may
        then hand it over quantized (``Fp8Rows``, see ``RMSNorm.feeds``)."""
        return (self.weight_scale is not None and self.weight.dtype == FP8_DTYPE
                and self.fp8_block is None and x.dim() == 2
                and use_fused_ops(x) and not use_small_batch_matmul(x, self.weight))

    def forward(self, x: torch.Tensor | Fp8Rows, sums: bool = False) -> torch.Tensor | Fp8Sums:
        """``sums=True``: the caller's consumer scales an FP8 product's sums itself (it
        takes ``Fp8Sums``, see ``fp8_linear``); an output summed over tensor-parallel ranks
        or with a bias comes scaled."""
        bias = None if self.reduces else self.bias
        sums = sums and self.bias is None and not (self.reduces and get_tp().size > 1)
        out = small_batch_product(self, x, bias)
        if out is None and isinstance(x, Fp8Rows):
            out = fp8_linear(x, self.weight, self.weight_scale, bias, sums=sums)
        elif out is None and sums and self.takes_fp8_rows(x):
            out = fp8_linear(x, self.weight, self.weight_scale, bias, self.input_scale, sums=True)
        elif out is None and self.fp8_block is not None:
            out = fp8_block_linear(x, self.weight, self.weight_scale, self.fp8_block, bias)
        elif out is None and self.llm_int8_threshold is not None:
            out = llm_int8_linear(x, self.weight, self.weight_scale, self.llm_int8_threshold,
                                  bias, max_over_ranks_ if self.reduces else None)
        elif out is None and self.weight is not None and self.weight.dtype == torch.int8:
            out = int8_linear(x, self.weight, self.weight_scale, self.input_scale, bias)
        elif out is None and self.int_scheme is not None:
            out = int_linear(x, self.qweight, self.scales, self.zeros,
                             bits=self.int_scheme.bits, group_size=self.int_scheme.group_size,
                             in_features=self.input_size, bias=bias, perm=self.act_perm,
                             codebook=self.codebook)
        elif out is None:
            out = linear(x, self.weight, bias, self.weight_scale, self.input_scale)
        if self.reduces:
            out = all_reduce(out)
            if self.bias is not None:
                out += self.bias
        return out

    def make_int(self, scheme: IntWeightScheme) -> None:
        """Replace the weight by the parameters an integer-weight checkpoint of ``scheme``
        fills (``int_weights``' stored layout); scales take the default dtype (the model's),
        float32 for a codebook scheme, which has no zero points and holds its codebook's
        values. Zero points start at ``2**(bits - 1)``, all a symmetric compressed-tensors
        checkpoint implies (it stores none)."""
        device = self.weight.device
        if scheme.codebook is not None:  # bitsandbytes' blocks may span rows
            scheme = replace(scheme, group_size=bitsandbytes.stored_group(
                self._checkpoint_sizes[1]))
        words = -(-self.input_size // int_weights.values_per_word(scheme.bits))
        groups = int_weights.num_groups(self.input_size, scheme.group_size)
        self.register_parameter("weight", None)
        self.qweight = _frozen(torch.empty(self.output_size, words, dtype=torch.int32,
                                           device=device))
        self.int_scheme = scheme
        codebook = scheme.codebook is not None
        self.scales = _frozen(torch.empty(self.output_size, groups,
                                          dtype=torch.float32 if codebook else None,
                                          device=device))
        if codebook:
            self.register_parameter("zeros", None)
            self.codebook = bitsandbytes.code_values(scheme.codebook).to(device)
            return
        self.zeros = _frozen(torch.full((self.output_size, groups), 1 << (scheme.bits - 1),
                                        dtype=torch.uint8, device=device))
        if scheme.symmetric and scheme.layout == "compressed-tensors":
            self._preset = frozenset({"zeros"})

    def quantize_int(self, scheme: IntWeightScheme) -> None:
        """Replace the loaded weight by its 4-bit codes in ``scheme``'s codebook
        (``bitsandbytes.quantize``: bitsandbytes' own quantization), once."""
        if self.int_scheme is not None:
            return
        codes, absmax = bitsandbytes.quantize(self.weight.data, scheme.codebook)
        self.make_int(scheme)
        if absmax.shape != self.scales.shape:  # a row-parallel part of a row of odd length
            raise ValueError(f"this tensor-parallel rank's {self.input_size} inputs a row cut "
                             "bitsandbytes' blocks of 64: pick another --tensor-parallel-size.")
        self.qweight.data.copy_(int_weights.pack_rows(codes, scheme.bits))
        self.scales.data.copy_(absmax)

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
            int_weights.require_g_idx(scheme, "the projection")
            return
        shards = self._shards()
        perm = int_weights.shared_input_order(
            [g_idx.get(shard) for shard in shards], scheme.group_size, self.qweight.device,
            f"the projections fused here ({', '.join(map(str, shards))})")
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
        if param_name == BLOCK_SCALE_NAME:
            return self.fp8_block is not None
        return isinstance(getattr(self, param_name, None), nn.Parameter)

    def _shards(self) -> list[str | None]:
        return [None]

    def quantize_fp8(self) -> None:
        """Replace the loaded weight by its FP8 rows and their scales (once)."""
        if self.weight_scale is None:
            quantized, scale = quantize_rows(self.weight.data)
            self.weight = _frozen(quantized)
            self.weight_scale = _frozen(scale)

    def make_fp8(self, static_input: bool, block: tuple[int, int] | None = None) -> None:
        """Give this projection the parameters an FP8 checkpoint fills: the FP8 weight, its
        row scales (with ``block``: one per block of ``(rows, columns)``), and with
        ``static_input`` the activation scale (starting at 0: the largest of the loaded
        shards' scales is kept)."""
        self._make_byte_weights(FP8_DTYPE, static_input, block)

    def make_int8(self, static_input: bool, outlier_threshold: float | None = None) -> None:
        """The parameters an INT8 W8A8 checkpoint fills: as ``make_fp8``'s per-channel ones,
        the weight in int8. ``outlier_threshold``: a bitsandbytes 8-bit checkpoint, whose
        ``SCB`` fills ``weight_scale`` (each row's largest magnitude, not a multiplier) and
        whose products are LLM.int8's (``pagedllm.quantization.llm_int8``)."""
        self._make_byte_weights(torch.int8, static_input)
        self.llm_int8_threshold = outlier_threshold

    def _make_byte_weights(self, dtype: torch.dtype, static_input: bool,
                           block: tuple[int, int] | None = None) -> None:
        device = self.weight.device
        self.weight = _frozen(torch.empty(self.weight.shape, dtype=dtype, device=device))
        scale_shape = (self.output_size, 1)
        if block is not None:
            self.fp8_block = block
            scale_shape = (-(-self.output_size // block[0]), -(-self.input_size // block[1]))
        self.weight_scale = _frozen(torch.empty(scale_shape, dtype=torch.float32, device=device))
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

        With tensor parallelism ``tensor`` is the checkpoint's whole tensor (or a
        ``CheckpointSlice`` of it): only this rank's part is read (``_rank_part``).
        """
        if param_name == BLOCK_SCALE_NAME and self.fp8_block is not None:
            param_name = "weight_scale"  # a multiplier despite its name
        tensor = self._rank_part(param_name, tensor, shard)
        if self.int_scheme is not None and param_name in int_weights.checkpoint_names(
                self.int_scheme):
            # Converted at the checkpoint's shape, then split (packed words and groups).
            part = self._part(shard)
            rows, in_features = self._rows(self.scales, shard).shape[0], self.input_size
            if part is not None:
                rows, in_features = self.checkpoint_shape("weight", shard)
            param_name, tensor = int_weights.convert(
                self.int_scheme, param_name, tensor.to(self.scales.device), rows, in_features)
            if param_name is None:
                return None
            if part is not None:
                tensor = int_weights.rank_part(self.int_scheme, param_name, tensor, *part)
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
        if param_name == "weight_scale" and self.fp8_block is not None:
            rows = self._block_rows(param, shard)
        else:
            rows = self._rows(param, shard)
        if param_name == "weight_scale" and self.fp8_block is None:
            if tensor.numel() == 1:
                rows.fill_(tensor.reshape(()).item())
                return param_name
            tensor = tensor.reshape(-1, 1) if tensor.numel() == rows.shape[0] else tensor
        if tuple(tensor.shape) != tuple(rows.shape):
            where = f"shard {shard!r} of {param_name}" if shard else param_name
            raise ValueError(f"{where} expects shape {tuple(rows.shape)}, got "
                             f"{tuple(tensor.shape)}.")
        if param.dtype in (FP8_DTYPE, torch.int8) and tensor.dtype != param.dtype:
            kind = "FP8 (float8_e4m3fn)" if param.dtype == FP8_DTYPE else "int8"
            raise ValueError(f"{param_name} is {kind} in this checkpoint's "
                             f"quantization_config, got {tensor.dtype}.")
        rows.copy_(tensor)
        return param_name

    def checkpoint_shape(self, param_name: str, shard: str | None = None) -> tuple[int, ...]:
        """The shape of the checkpoint tensor (all ranks' rows and columns) that fills
        ``param_name``, "weight" or "bias" (the rows of ``shard`` of a fused projection)."""
        output_size, input_size = self._checkpoint_sizes
        return (output_size, input_size) if param_name == "weight" else (output_size,)

    def _rows(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        if shard is not None:
            raise ValueError(f"This layer is not fused; it has no shard {shard!r}.")
        return param.data

    def _row_range(self, shard: str | None) -> tuple[int, int]:
        """(first row, rows) of ``shard`` in this rank's weight."""
        self._rows(self.weight, shard)  # checks the shard
        return 0, self.output_size

    def _block_rows(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        """The rows of block scales ``shard`` fills: its rows must start on a block."""
        start, length = self._row_range(shard)
        rows = self.fp8_block[0]
        if start % rows:
            raise ValueError(f"shard {shard!r} starts at row {start}, inside a block of {rows} "
                             "rows: block-wise FP8 needs every fused shard to start on a block.")
        return param.data.narrow(0, start // rows, -(-length // rows))

    def _part(self, shard: str | None) -> tuple[int, int, int] | None:
        """(dim, start, length) of the checkpoint tensor ``shard`` this rank holds."""
        return self.tp_part

    def _rank_part(self, param_name: str, tensor, shard: str | None) -> torch.Tensor:
        """This rank's part of a checkpoint tensor for ``param_name``: a row-parallel
        weight's input columns; a column-parallel weight's, bias's or per-channel scale's
        output rows (padded with zeros to the rank's rows for the vocabulary). Scales of
        one value, static input scales and a row-parallel bias are whole on every rank."""
        part = self._part(shard)
        if part is None or self.int_scheme is not None:  # integer weights: split in load
            return sharding.read(tensor)
        dim, start, length = part
        if param_name == "weight_scale" and self.fp8_block is not None:
            block = self.fp8_block[dim]
            full = self.checkpoint_shape("weight", shard)[dim]
            if start % block or (length % block and start + length < full):
                raise ValueError(
                    f"this rank's {'rows' if dim == 0 else 'columns'} [{start}, "
                    f"{start + length}) cut the checkpoint's FP8 blocks of {block}: use a "
                    "tensor-parallel size that splits the projection in whole blocks.")
            return sharding.narrow(tensor, dim, start // block, -(-length // block))
        if dim == 1:
            return sharding.narrow(tensor, 1, start, length) if param_name == "weight" \
                else sharding.read(tensor)
        if param_name not in ("weight", "bias", "weight_scale") or (
                param_name == "weight_scale" and math.prod(tensor.shape) == 1):
            return sharding.read(tensor)
        rows = sharding.narrow(tensor, 0, start, length)
        padded = self.output_size if shard is None else length
        if rows.shape[0] < padded:  # the last vocabulary part
            rows = torch.cat([rows, rows.new_zeros(padded - rows.shape[0], *rows.shape[1:])])
        return rows

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"
                f"{self._format_repr()}")

    def _format_repr(self) -> str:
        if self.int_scheme is not None:
            scheme = self.int_scheme
            order = ", act-order" if self.act_perm is not None else ""
            values = scheme.codebook or f"int{scheme.bits}"
            return f", {values} groups of {scheme.group_size}{order}"
        if self.fp8_block is not None:
            return f", fp8 blocks of {self.fp8_block[0]}x{self.fp8_block[1]}"
        if self.llm_int8_threshold is not None:
            return f", llm.int8 outlier threshold {self.llm_int8_threshold:g}"
        if self.weight_scale is not None:
            kind = "int8 w8a8" if self.weight.dtype == torch.int8 else "fp8"
            return f", {kind} static input" if self.input_scale is not None else f", {kind}"
        return ""


class FusedLinear(Linear):
    """One matmul whose output is the concatenation of named shards, in declaration order.

    ``shard_sizes`` are the checkpoint's; column-parallel (``parallel="column"``), each
    shard is split over the ranks on its own, in whole ``units[shard]`` rows (default 1),
    and ``shard_sizes`` become this rank's."""

    def __init__(self, input_size: int, shard_sizes: dict[str, int], bias: bool = False,
                 parallel: str | None = None, units: dict[str, int] | None = None) -> None:
        tp = get_tp()
        checkpoint_sizes = dict(shard_sizes)
        parts: dict[str, tuple[int, int, int]] = {}
        if parallel == "column" and tp.size > 1:
            units = units or {}
            for name, size in shard_sizes.items():
                start, length = sharding.shard_range(size, units.get(name, 1), tp.rank, tp.size)
                parts[name] = (0, start, length)
            shard_sizes = {name: part[2] for name, part in parts.items()}
        elif parallel not in (None, "column"):
            raise ValueError(f"A fused projection is column-parallel or not, got {parallel!r}.")
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        self.parallel = "column" if parts else None
        self._shard_parts = parts
        self.shard_sizes = dict(shard_sizes)
        # The shards' rows in the checkpoint (all ranks'); shard_sizes are this rank's.
        self.checkpoint_shard_sizes = checkpoint_sizes
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in self.shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def checkpoint_parts(self, param_name: str, tensor: torch.Tensor | sharding.CheckpointSlice
                         ) -> list[tuple[str, torch.Tensor]]:
        """A checkpoint tensor that holds this fused projection whole (Phi-3's ``qkv_proj``
        and ``gate_up_proj``) as each shard's own tensor, in the checkpoint's layout: its
        output rows cut in shard order (a packed integer layout's along its own dimension,
        ``int_weights.shard_of_whole``; block scales by blocks), and a tensor that
        describes the whole projection (a per-tensor or input scale) given to every shard.
        Raises ValueError when the rows do not add up to the shards'."""
        tensor = sharding.read(tensor)
        scheme = self.int_scheme
        packed = scheme is not None and param_name in int_weights.checkpoint_names(scheme)
        whole = param_name == "input_scale" or (param_name.endswith("_scale")
                                                and tensor.numel() == 1)
        blocks = param_name in ("weight_scale", BLOCK_SCALE_NAME) and self.fp8_block is not None
        total = sum(self.checkpoint_shard_sizes.values())
        if not (packed or whole or blocks) and tensor.shape[0] != total:
            raise ValueError(f"{param_name} of {self.checkpoint_shard_sizes} expects {total} "
                             f"rows, got shape {tuple(tensor.shape)}.")

        def cut(start: int, rows: int) -> torch.Tensor:
            if packed:
                return int_weights.shard_of_whole(scheme, param_name, tensor, start, rows)
            if whole:
                return tensor
            if blocks:
                block = self.fp8_block[0]
                return tensor.narrow(0, start // block, -(-rows // block))
            return tensor.narrow(0, start, rows)  # weight, bias, per-channel scales

        parts, start = [], 0
        for shard, rows in self.checkpoint_shard_sizes.items():
            parts.append((shard, cut(start, rows)))
            start += rows
        return parts

    def checkpoint_shape(self, param_name: str, shard: str | None = None) -> tuple[int, ...]:
        if shard not in self.checkpoint_shard_sizes:
            raise ValueError(f"Unknown shard {shard!r}; this layer has {list(self.shard_sizes)}.")
        rows = self.checkpoint_shard_sizes[shard]
        return (rows, self.input_size) if param_name == "weight" else (rows,)

    def _rows(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        if shard not in self.shard_sizes:
            raise ValueError(f"Unknown shard {shard!r}; this layer has {list(self.shard_sizes)}.")
        return param.data.narrow(0, self.shard_offsets[shard], self.shard_sizes[shard])

    def _shards(self) -> list[str | None]:
        return list(self.shard_sizes)

    def _row_range(self, shard: str | None) -> tuple[int, int]:
        self._rows(self.weight, shard)  # checks the shard
        return self.shard_offsets[shard], self.shard_sizes[shard]

    def _part(self, shard: str | None) -> tuple[int, int, int] | None:
        if not self._shard_parts or shard not in self._shard_parts:
            return None
        return self._shard_parts[shard]

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, shards={self.shard_sizes}, bias={self.bias is not None}"
                f"{self._format_repr()}")


class Embedding(nn.Module):
    """Token id -> row of ``weight: [num_embeddings, embedding_dim]``.

    ``parallel=True`` with several tensor-parallel ranks: each rank holds its part of the
    vocabulary (``sharding.vocab_range``, zero rows padding the last part), looks up the
    ids that fall in it, and the ranks' rows are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: bool = False) -> None:
        super().__init__()
        tp = get_tp()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        rows = num_embeddings
        self.vocab_part: tuple[int, int] | None = None  # (start, length) when split
        if parallel and tp.size > 1:
            start, length, rows = sharding.vocab_range(num_embeddings, tp.rank, tp.size)
            self.vocab_part = (start, length)
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_part is None:
            return F.embedding(input_ids, self.weight)
        start, length = self.vocab_part
        local = input_ids - start
        outside = (local < 0) | (local >= length)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))

    def reads(self, param_name: str) -> bool:
        return param_name == "weight"

    def checkpoint_shape(self, param_name: str = "weight", shard: str | None = None
                         ) -> tuple[int, ...]:
        """The checkpoint's ``weight`` shape (the whole vocabulary)."""
        return (self.num_embeddings, self.embedding_dim)

    def load(self, param_name: str, tensor, shard: str | None = None) -> str:
        """Copy the checkpoint's ``weight`` (this rank's vocabulary rows of it)."""
        if param_name != "weight" or shard is not None:
            raise ValueError(f"An embedding has only a weight, not {param_name!r}.")
        if self.vocab_part is None:
            rows = sharding.read(tensor)
        else:
            start, length = self.vocab_part
            rows = sharding.narrow(tensor, 0, start, length)
            rows = torch.cat([rows, rows.new_zeros(self.weight.shape[0] - length,
                                                   *rows.shape[1:])])
        if tuple(rows.shape) != tuple(self.weight.shape):
            raise ValueError(f"Expected shape {tuple(self.weight.shape)}, got "
                             f"{tuple(rows.shape)}.")
        self.weight.data.copy_(rows)
        return "weight"

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The whole vocabulary's logits ``[N, vocab_size]`` from each rank's part (the
    identity with one rank)."""
    if get_tp().size == 1:
        return logits
    return all_gather_last_dim(logits)[:, :vocab_size]
