"""Integer weight-only projections (W4A16, W8A16): one stored layout for every checkpoint
format, the conversions into it, and the exact torch reference product.

Stored layout (one projection, ``N`` output rows, ``K`` input columns, ``b`` bits, ``P =
32 // b`` values per word, groups of ``G`` input columns, ``g = ceil(K / G)`` groups)::

    qweight  int32 [N, ceil(K / P)]  value k of row n in word k // P, in slot
                                     stored_slots(b)[k % P] (bits b * slot upwards)
    scales   model dtype [N, g]      scale of group k // G of row n
    zeros    uint8 [N, g]            unsigned zero point of the same group
    w[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G]

4-bit words hold their eight values in the slot order 0 2 4 6 1 3 5 7 (AWQ's): values
``2p`` and ``2p + 1`` sit 16 bits apart (slots ``p`` and ``p + 4``), so one shift and one
mask put a pair into the two halves of a register, as two half-precision numbers for the
GPU kernels' paired arithmetic. 8-bit words hold their four values in order.

Rows are output channels, so the shards of a fused projection (q/k/v, gate/up) are blocks
of rows of every tensor. Checkpoint layouts, converted tensor by tensor at load:

=====================  ==========================================  ======================
checkpoint             weights                                     zero points
=====================  ==========================================  ======================
compressed-tensors     ``weight_packed [N, K/P]``: packed along K  ``weight_zero_point``
(pack-quantized)       in order (values stored with offset         packed along N; none
                       ``2**(b-1)``); ``weight_scale [N, g]``      when symmetric: 2**(b-1)
GPTQ (``gptq``,        ``qweight [K/P, N]``: packed along K in     ``qzeros [g, N/P]``
``gptq_v2``)           order, transposed; ``scales [g, N]``        packed along N; ``gptq``
                                                                   stores zero - 1
AWQ (``gemm``)         ``qweight [K, N/8]``: packed along N in     ``qzeros [g, N/8]``, the
                       the order 0 2 4 6 1 3 5 7; ``scales [g, N]``  same order
bitsandbytes (4-bit,   ``weight [N, K/2]`` uint8, two codes a      none: ``codebook[q] *
as ``bitsandbytes``    byte, high nibble first; ``weight_absmax    scale``, the codebook
hands it over)         [N, g]`` float32; ``weight_quant_map [16]`` NF4's or FP4's values
=====================  ==========================================  ======================

A codebook scheme (``IntWeightScheme.codebook``) keeps its scales in float32 and has no
zero points (``zeros`` is None): ``w[n, k] = codebook[q[n, k]] * scales[n, k // G]``.

Act-order (GPTQ ``desc_act``, compressed-tensors ``actorder: group``): ``g_idx [K]`` gives
each input column's group, not ``k // G``. At load the input columns are sorted by group
once (``act_order_permutation``); the stored weight holds column ``perm[j]`` at ``j`` and
``perm`` travels with it, so the product gathers the activation's columns (``x[:, perm]``,
inside the GPU kernel), never the weight. The shards of a fused projection share their
input, so they must share ``g_idx``.

Scales are kept in the model's dtype (a float16 scale in a bfloat16 model is rounded to
bfloat16 once, at load). The reference (``int_linear_reference``) dequantizes in float32,
rounds once to the activation dtype and multiplies with ``F.linear`` in the original
column order: the same weights, and the same product, as dequantizing the checkpoint.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagedllm.quantization import bitsandbytes
from pagedllm.quantization.checkpoint import IntWeightScheme

# AutoAWQ packs the 4-bit values of columns 0..7 into slots 0..7 in the column order
# 0 2 4 6 1 3 5 7, so column j sits in slot _AWQ_SLOT_OF_COLUMN[j]; the stored layout
# does the same.
_AWQ_SLOT_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)


def values_per_word(bits: int) -> int:
    return 32 // bits


def stored_slots(bits: int) -> tuple[int, ...]:
    """The slot of each of a stored word's values, in column order (see the module
    docstring): AWQ's order for 4 bits, in order for 8."""
    return _AWQ_SLOT_OF_COLUMN if bits == 4 else tuple(range(values_per_word(bits)))


def num_groups(in_features: int, group_size: int) -> int:
    """Groups of one row (``group_size`` -1: one)."""
    return 1 if group_size == -1 else -(-in_features // group_size)


def unpack_rows(packed: torch.Tensor, bits: int, columns: int,
                slot_of_column: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``[R, W]`` packed along its rows -> int32 ``[R, columns]`` of unsigned values;
    column ``j`` of a word's run is in slot ``slot_of_column[j]`` (default: slot ``j``, a
    checkpoint's order; ``stored_slots(bits)`` reads the stored layout)."""
    per_word = values_per_word(bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if slot_of_column is not None:
        values = values[..., list(slot_of_column)]
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)[:, :columns]


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int ``[R, C]`` of unsigned ``bits``-bit values -> int32 ``[R, ceil(C / P)]`` in the
    stored layout: value ``k`` in word ``k // P``, slot ``stored_slots(bits)[k % P]``."""
    per_word = values_per_word(bits)
    rows, columns = values.shape
    padded = -(-columns // per_word) * per_word
    wide = F.pad(values.to(torch.int64), (0, padded - columns))
    shifts = bits * torch.tensor(stored_slots(bits), dtype=torch.int64, device=values.device)
    words = (wide.reshape(rows, padded // per_word, per_word) << shifts).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits, signed


def to_stored_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words packed along their rows with values in order -> the same values in the
    stored layout's slots (a new tensor; word by word, no unpacking)."""
    slots = stored_slots(bits)
    if slots == tuple(range(len(slots))):
        return words.contiguous()
    mask = (1 << bits) - 1
    out = torch.zeros_like(words, memory_format=torch.contiguous_format)
    for column, slot in enumerate(slots):
        out |= ((words >> (bits * column)) & mask) << (bits * slot)
    return out


# Checkpoint parameter name -> stored parameter, per layout.
_NAMES = {
    "compressed-tensors": {"weight_packed": "qweight", "weight_scale": "scales",
                           "weight_zero_point": "zeros", "weight_g_idx": "g_idx",
                           "weight_shape": None},
    "gptq": {"qweight": "qweight", "scales": "scales", "qzeros": "zeros", "g_idx": "g_idx"},
    "awq": {"qweight": "qweight", "scales": "scales", "qzeros": "zeros"},
    "bitsandbytes": {"weight": "qweight", "weight_absmax": "scales",
                     "weight_quant_map": None},
}
_NAMES["gptq_v2"] = _NAMES["gptq"]


def checkpoint_names(scheme: IntWeightScheme) -> tuple[str, ...]:
    """The parameter names a checkpoint of ``scheme``'s layout stores for a projection."""
    return tuple(_NAMES[scheme.layout])


def convert(scheme: IntWeightScheme, name: str, tensor: torch.Tensor, rows: int,
            in_features: int) -> tuple[str | None, torch.Tensor | None]:
    """Checkpoint tensor ``name`` (one of ``checkpoint_names``) of a projection, or shard,
    of ``rows`` outputs and ``in_features`` inputs -> ``(stored parameter, tensor)``: the
    parameter is ``qweight``, ``scales``, ``zeros`` or ``g_idx`` (kept aside for
    ``act_order_permutation``), or None for a tensor that only describes the others
    (``weight_shape``, bitsandbytes' ``weight_quant_map``: checked). Raises ValueError
    naming the expected shape when the tensor does not fit the scheme."""
    param = _NAMES[scheme.layout][name]
    bits, layout = scheme.bits, scheme.layout
    groups = num_groups(in_features, scheme.group_size)
    if param is None and layout == "bitsandbytes":  # the code's values, as bitsandbytes' own
        if not torch.equal(tensor.float().cpu(), bitsandbytes.code_values(scheme.codebook)):
            raise ValueError(f"weight_quant_map holds values other than bitsandbytes' "
                             f"{scheme.codebook} code.")
        return None, None
    if param is None:  # compressed-tensors' weight_shape: [rows, in_features]
        _expect(name, tensor, (2,))
        if tensor.tolist() != [rows, in_features]:
            raise ValueError(f"weight_shape is {tensor.tolist()}, this layer is "
                             f"[{rows}, {in_features}].")
        return None, None
    if param == "g_idx":
        _expect(name, tensor, (in_features,))
        return "g_idx", tensor.to(torch.int64)
    if param == "scales":
        if layout in ("compressed-tensors", "bitsandbytes"):
            _expect(name, tensor, (rows, groups))
            return "scales", tensor
        _expect(name, tensor, (groups, rows))
        return "scales", tensor.t()
    per_word = values_per_word(bits)
    if param == "qweight":
        if layout == "bitsandbytes":
            _expect(name, tensor, (rows, in_features // 2), torch.uint8)
            return "qweight", pack_rows(bitsandbytes.codes_of_bytes(tensor, in_features), bits)
        if layout == "compressed-tensors":
            _expect(name, tensor, (rows, -(-in_features // per_word)), torch.int32)
            return "qweight", to_stored_words(tensor, bits)
        if layout == "awq":
            _expect(name, tensor, (in_features, -(-rows // per_word)), torch.int32)
            values = unpack_rows(tensor, bits, rows, _AWQ_SLOT_OF_COLUMN)
            return "qweight", pack_rows(values.t(), bits)
        _expect(name, tensor, (-(-in_features // per_word), rows), torch.int32)
        return "qweight", to_stored_words(tensor.t(), bits)
    # Zero points, packed along the output rows in every layout.
    if layout == "compressed-tensors":
        _expect(name, tensor, (-(-rows // per_word), groups), torch.int32)
        zeros = unpack_rows(tensor.t(), bits, rows).t()
    else:
        _expect(name, tensor, (groups, -(-rows // per_word)), torch.int32)
        order = _AWQ_SLOT_OF_COLUMN if layout == "awq" else None
        zeros = unpack_rows(tensor, bits, rows, order).t()
        if layout == "gptq":  # the historical format stores zero - 1 (wrapping)
            zeros = (zeros + 1) & ((1 << bits) - 1)
    return "zeros", zeros.to(torch.uint8)


# Where a checkpoint tensor of a fused projection stored whole (Phi-3's qkv_proj) keeps the
# output rows, per layout and name: (dimension, rows an element holds: 1, or the values of
# a packed word), None for a tensor that describes the whole projection.
_WHOLE_ROWS = {
    "compressed-tensors": {"weight_packed": (0, 1), "weight_scale": (0, 1),
                           "weight_zero_point": (0, "word"), "weight_g_idx": None,
                           "weight_shape": None},
    "gptq": {"qweight": (1, 1), "scales": (1, 1), "qzeros": (1, "word"), "g_idx": None},
    "awq": {"qweight": (1, "word"), "scales": (1, 1), "qzeros": (1, "word")},
    "bitsandbytes": {"weight": (0, 1), "weight_absmax": (0, 1), "weight_quant_map": None},
}
_WHOLE_ROWS["gptq_v2"] = _WHOLE_ROWS["gptq"]


def shard_of_whole(scheme: IntWeightScheme, name: str, tensor: torch.Tensor, start: int,
                   rows: int) -> torch.Tensor:
    """The part of checkpoint tensor ``name`` of a fused projection stored whole that a
    shard of output rows ``start .. start + rows`` would store, in the checkpoint's layout
    (``weight_shape`` made the shard's); a tensor that describes the whole projection
    (``g_idx``, bitsandbytes' code) as it is. Raises ValueError when the shard does not
    start and end on a packed word."""
    where = _WHOLE_ROWS[scheme.layout][name]
    if where is None:
        if name == "weight_shape":
            return torch.tensor([rows, int(tensor[1])], dtype=tensor.dtype)
        return tensor
    dim, per = where
    per = values_per_word(scheme.bits) if per == "word" else per
    if start % per or rows % per:
        raise ValueError(f"a fused shard of {rows} rows from row {start} is not a whole number "
                         f"of {scheme.bits}-bit words of {name}.")
    return tensor.narrow(dim, start // per, rows // per)


def rank_part(scheme: IntWeightScheme, param: str, tensor: torch.Tensor, dim: int,
              start: int, length: int) -> torch.Tensor:
    """A tensor-parallel rank's part of a converted tensor (``param`` as ``convert``
    returns it) of a projection split along ``dim`` (0: output rows, 1: input columns)
    at ``start .. start + length``. Input columns split in whole packed words and whole
    groups; an act-order (``g_idx``) projection is not split along its inputs. Raises
    ValueError saying what to change otherwise."""
    if dim == 0:
        return tensor if param == "g_idx" else tensor.narrow(0, start, length)
    per_word, group = values_per_word(scheme.bits), scheme.group_size
    unit = per_word if group == -1 else math.lcm(per_word, group)
    if start % unit or length % unit:
        raise ValueError(f"the tensor-parallel split gives each rank {length} input columns, "
                         f"which is not a whole number of {scheme.bits}-bit words and groups of "
                         f"{group}: pick another --tensor-parallel-size.")
    if param == "qweight":
        return tensor.narrow(1, start // per_word, length // per_word)
    if param == "g_idx":
        local = tensor.narrow(0, start, length) - (start // group if group > 0 else 0)
        if group > 0 and not torch.equal(local, torch.arange(length, device=local.device) // group):
            raise ValueError("act-order (desc_act / actorder) weights cannot be split over "
                             "tensor-parallel ranks along their inputs: serve a checkpoint "
                             "quantized without act-order, or drop --tensor-parallel-size.")
        return local
    return tensor if group == -1 else tensor.narrow(1, start // group, length // group)


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...],
            dtype: torch.dtype | None = None) -> None:
    if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
        want = f"{list(shape)}" + (f" {dtype}" if dtype is not None else "")
        raise ValueError(f"{name} expects {want} for this layer and the checkpoint's "
                         f"quantization_config, got {list(tensor.shape)} {tensor.dtype}.")


def act_order_permutation(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input order that makes groups contiguous: ``perm`` with ``g_idx[perm[j]] ==
    j // group_size``, or None when ``g_idx`` is already ``k // group_size``. Raises
    ValueError when some group does not hold ``group_size`` columns (the last may hold
    fewer)."""
    in_features = g_idx.numel()
    size = in_features if group_size == -1 else group_size
    natural = torch.arange(in_features, device=g_idx.device) // size
    if torch.equal(g_idx, natural):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], natural):
        raise ValueError(f"g_idx does not assign {size} input columns to each group "
                         f"(counts {torch.bincount(g_idx).tolist()[:8]}...); pagedllm reads "
                         "act-order checkpoints whose groups are equal in size.")
    return perm


def require_g_idx(scheme: IntWeightScheme, holder: str) -> None:
    """Raise ValueError when ``scheme`` says act-order (``desc_act``) but ``holder`` (the
    projection, the experts) loaded no ``g_idx``; compressed-tensors' act-order may store
    none (``actorder: weight`` keeps the order)."""
    if scheme.act_order and scheme.layout != "compressed-tensors":
        raise ValueError(f"the checkpoint's quantization_config says desc_act=true but "
                         f"{holder} has no g_idx.")


def shared_input_order(orders: list[torch.Tensor | None], group_size: int,
                       device: torch.device, holders: str) -> torch.Tensor | None:
    """The act-order permutation (``act_order_permutation``) of projections fused into one
    product (``holders``, named in the error): they read one input, so every one must hold
    the same ``g_idx``. Raises ValueError otherwise."""
    if any(order is None for order in orders) or any(
            not torch.equal(orders[0], other) for other in orders[1:]):
        raise ValueError(f"{holders} hold different g_idx (or some none); pagedllm needs one "
                         "input order for them.")
    return act_order_permutation(orders[0].to(device), group_size)


def permute_columns(qweight: torch.Tensor, bits: int, in_features: int,
                    perm: torch.Tensor) -> torch.Tensor:
    """``qweight`` with column ``perm[j]`` moved to ``j`` (re-packed)."""
    values = unpack_rows(qweight, bits, in_features, stored_slots(bits))
    return pack_rows(values[:, perm.to(qweight.device)], bits)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               bits: int, group_size: int, in_features: int, dtype: torch.dtype,
               codebook: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, in_features]`` weights in ``dtype``: ``(q - zero) * scale`` (or
    ``codebook[q] * scale``) in float32, rounded once."""
    values = unpack_rows(qweight, bits, in_features, stored_slots(bits))
    size = in_features if group_size == -1 else group_size
    rows, groups = scales.shape
    scales = scales.to(torch.float32)
    if in_features % size == 0:  # whole groups: broadcast rather than gather
        values, scales = values.view(rows, groups, size), scales[:, :, None]
        zeros = None if zeros is None else zeros[:, :, None]
    else:
        group = torch.arange(in_features, device=qweight.device) // size
        scales = scales[:, group]
        zeros = None if zeros is None else zeros[:, group]
    if codebook is not None:
        numbers = codebook.to(torch.float32)[values.long()]
    else:
        numbers = (values - zeros.to(torch.int32)).to(torch.float32)
    return (numbers * scales).to(dtype).view(rows, in_features)


def int_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                         zeros: torch.Tensor | None, *, bits: int, group_size: int,
                         in_features: int, bias: torch.Tensor | None = None,
                         perm: torch.Tensor | None = None,
                         codebook: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` dequantized to ``x``'s dtype and put back in the
    checkpoint's column order (``perm``: the act-order sort of the stored columns)."""
    weight = dequantize(qweight, scales, zeros, bits, group_size, in_features, x.dtype,
                        codebook)
    if perm is not None:
        original = torch.empty_like(weight)
        original[:, perm.long()] = weight
        weight = original
    return F.linear(x, weight, bias)


def fill_dummy(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               bits: int, weight_range: float, generator: torch.Generator) -> None:
    """Random weights uniform over the ``bits``-bit values, zero points at the middle
    ``2**(bits-1)`` and scales ``weight_range / 2**(bits-1)``: weights in
    ``[-weight_range, weight_range)``, like the dummy loader's unquantized ones. A codebook
    scheme (no ``zeros``; its values span [-1, 1]) takes scales of ``weight_range``."""
    qweight.random_(-(1 << 31), 1 << 31, generator=generator)
    if zeros is None:
        scales.fill_(weight_range)
        return
    middle = 1 << (bits - 1)
    zeros.fill_(middle)
    scales.fill_(weight_range / middle)
