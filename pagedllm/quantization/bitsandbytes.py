"""bitsandbytes checkpoints as transformers saves a model loaded with ``BitsAndBytesConfig``:
4-bit weights (NF4 and FP4, ``load_in_4bit``; the same quantization of an unquantized
checkpoint at load, ``--quantization bitsandbytes``) and 8-bit ones (LLM.int8,
``load_in_8bit``: ``P.weight`` int8 ``[N, K]``, ``P.SCB`` float32 ``[N]`` and
``P.weight_format``, multiplied by ``pagedllm.quantization.llm_int8``).

The 4-bit format (bitsandbytes' ``QuantState.as_dict(packed=True)``), per quantized projection
``P`` of ``N`` outputs and ``K`` inputs, ``B`` the block size (``blocksize``)::

    P.weight                    uint8 [N * K / 2, 1] (or the same bytes viewed as
                                bnb_4bit_quant_storage's dtype): the codes of the flattened
                                weight, element 2i in the high nibble of byte i, 2i + 1 in
                                the low one
    P.weight.quant_map          float32 [16]: the value of each code (NF4 or FP4)
    P.weight.absmax             float32 [N * K / B]: the largest magnitude of each block of B
                                consecutive weights; with double quantization uint8 codes
                                of ``absmax - offset``, quantized in blocks of ``B2``:
    P.weight.nested_absmax      float32 [ceil(N * K / B / B2)]
    P.weight.nested_quant_map   float32 [256]
    P.weight.quant_state.bitsandbytes__nf4 (or __fp4)
                                uint8: a JSON object with ``quant_type``, ``blocksize``,
                                ``dtype``, ``shape`` and, with double quantization,
                                ``nested_blocksize`` and ``nested_offset`` (``offset``)

    w = quant_map[code] * absmax[block]                     (float32, then the model dtype)
    absmax = nested_quant_map[q] * nested_absmax[q_block] + offset      (float32)

``checkpoint_tensors`` turns those tensors into the integer-weight layer's
(``int_weights``, layout ``bitsandbytes``): ``P.weight`` as codes ``[N, K / 2]`` (bytes of
one row each), ``P.weight_absmax`` float32 ``[N, K / G]`` (double quantization undone; ``G
= stored_group(K)``, 64 where it divides the rows, each block's scale given to every group
it holds) and ``P.weight_quant_map`` (checked against the code's standard values, which
bitsandbytes' own kernels assume). The products compute ``quant_map[code] * absmax`` in
float32 and round it once, as bitsandbytes' dequantization does.
"""

from __future__ import annotations

import json
import math
import re
from typing import Iterable, Iterator

import torch

from pagedllm.distributed import sharding
from pagedllm.quantization.checkpoint import BNB_GROUP, BNB_QUANT_TYPES

# The columns a stored scale covers: bitsandbytes' default block (transformers' 4-bit
# checkpoints); a larger block, a multiple of it, gives its scale to each group it holds.
GROUP = BNB_GROUP
_STATE = ".weight.quant_state.bitsandbytes__"
_ROW_MAX = ".SCB"  # an 8-bit projection's row scales (bitsandbytes' name)
_FORMAT = ".weight_format"
_PIECES = re.compile(r"^(.*)\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|"
                     r"quant_state\.bitsandbytes__(?:nf4|fp4))$")


def code_values(quant_type: str) -> torch.Tensor:
    """The 16 values of bitsandbytes' ``quant_type`` code (float32, in code order): NF4's
    normal-float quantiles, or FP4's sign, 2-bit exponent and 1-bit mantissa values."""
    if quant_type == "nf4":
        values = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                  -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                  0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                  0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                  0.7229568362236023, 1.0]
    elif quant_type == "fp4":  # 1 sign, 2 exponent and 1 mantissa bits, scaled to [-1, 1]
        magnitudes = torch.tensor([0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0]) / 12
        return torch.cat([magnitudes, -magnitudes]).index_fill_(0, torch.tensor([8]), 0.0)
    else:
        raise ValueError(f"bitsandbytes quant type {quant_type!r}: pagedllm reads "
                         f"{' and '.join(BNB_QUANT_TYPES)}.")
    return torch.tensor(values, dtype=torch.float32)


def quantized_prefixes(names: Iterable[str], bits: int) -> dict[str, int]:
    """The projections a checkpoint holds quantized by bitsandbytes, from its tensor names,
    with their bits: 4 (a ``weight.quant_state`` tensor) or 8 (an ``SCB`` tensor). Raises
    ValueError naming a projection stored in other bits than ``bits``, the checkpoint's
    ``quantization_config``'s."""
    names = list(names)
    held = {name.split(_STATE)[0]: 4 for name in names if _STATE in name}
    held.update((name.removesuffix(_ROW_MAX), 8) for name in names if name.endswith(_ROW_MAX))
    other = next((prefix for prefix, stored in held.items() if stored != bits), None)
    if other is not None:
        raise ValueError(f"{other} is stored in {held[other]}-bit bitsandbytes tensors, but the "
                         f"checkpoint's quantization_config says load_in_{bits}bit.")
    return held


def checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor | sharding.CheckpointSlice]],
                       prefixes: dict[str, int]
                       ) -> Iterator[tuple[str, torch.Tensor | sharding.CheckpointSlice]]:
    """The checkpoint's tensors with each projection of ``prefixes`` (``quantized_prefixes``)
    given as pagedllm's layer reads it. A 4-bit projection's tensors are held until all of
    them have come, then replaced by ``weight``, ``weight_absmax`` and ``weight_quant_map``
    (module docstring); an 8-bit one keeps its int8 ``weight``, its ``SCB`` becomes
    ``weight_scale`` and its ``weight_format`` is checked (row-major) and dropped. Other
    tensors pass through. Raises ValueError naming the projection when its tensors are
    incomplete or not of the format."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _PIECES.match(name)
        if match:
            prefix, piece = match.group(1), match.group(2).split(".")[0]
        elif name.endswith((_ROW_MAX, _FORMAT)):
            prefix, piece = name.rsplit(".", 1)
        else:
            prefix, piece = name.removesuffix(".weight"), "weight"
        bits = prefixes.get(prefix)
        if bits == 8 and piece == "SCB":
            yield f"{prefix}.weight_scale", tensor
            continue
        if bits == 8 and piece == "weight_format":
            _check_row_major(prefix, sharding.read(tensor))
            continue
        if bits != 4 or not (match or name.endswith(".weight")):
            yield name, tensor
            continue
        pieces = pending.setdefault(prefix, {})
        pieces[piece] = sharding.read(tensor)
        if _complete(pieces):
            yield from _layer_tensors(prefix, pending.pop(prefix))
    if pending:
        prefix, pieces = next(iter(pending.items()))
        raise ValueError(f"{prefix}: the checkpoint holds only {sorted(pieces)} of this "
                         "bitsandbytes projection's tensors.")


def _check_row_major(prefix: str, weight_format: torch.Tensor) -> None:
    """bitsandbytes saves 8-bit weights row-major (``weight_format`` 0, or "row"); older
    versions could save the column-major layouts of its CUDA kernels."""
    value = weight_format.reshape(-1)[0].item() if weight_format.numel() else None
    if value != 0:
        names = {1: "col32", 2: "col_turing", 3: "col_ampere"}
        raise ValueError(f"{prefix}.weight_format is {names.get(value, value)!r}: pagedllm "
                         "reads bitsandbytes' row-major 8-bit weights (weight_format 0, "
                         "\"row\"); load the checkpoint with transformers and save it again.")


def _complete(pieces: dict[str, torch.Tensor]) -> bool:
    if not {"weight", "absmax", "quant_map", "quant_state"} <= pieces.keys():
        return False
    state = _state(pieces["quant_state"])
    return "nested_offset" not in state or {"nested_absmax", "nested_quant_map"} <= pieces.keys()


def _state(blob: torch.Tensor) -> dict:
    return json.loads(bytes(blob.to(torch.uint8).tolist()).decode())


def _layer_tensors(prefix: str, pieces: dict[str, torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    state = _state(pieces["quant_state"])
    rows, columns = state["shape"]
    block = int(state["blocksize"])
    if block % GROUP:
        raise ValueError(f"{prefix}: bitsandbytes blocks of {block} weights; pagedllm reads "
                         f"blocks of a multiple of {GROUP}.")
    codes = pieces["weight"].contiguous().view(torch.uint8).reshape(-1)
    if codes.numel() != rows * columns // 2:
        raise ValueError(f"{prefix}.weight holds {codes.numel()} bytes; its quant_state's "
                         f"shape [{rows}, {columns}] needs {rows * columns // 2}.")
    absmax = pieces["absmax"]
    if "nested_offset" in state:
        nested = pieces["nested_absmax"].float()
        index = torch.arange(absmax.numel()) // int(state["nested_blocksize"])
        absmax = (pieces["nested_quant_map"].float()[absmax.long()] * nested[index]
                  + torch.tensor(float(state["nested_offset"]), dtype=torch.float32))
    yield f"{prefix}.weight", codes.reshape(rows, columns // 2)
    yield f"{prefix}.weight_absmax", row_scales(absmax.float(), block, rows, columns)
    yield f"{prefix}.weight_quant_map", pieces["quant_map"].float()


def stored_group(columns: int) -> int:
    """The columns one stored scale covers in rows of ``columns``: ``GROUP``, or the largest
    divisor of it that divides the row (bitsandbytes' blocks run over the flattened weight,
    so a block then spans the end of one row and the start of the next)."""
    return math.gcd(GROUP, columns)


def row_scales(absmax: torch.Tensor, block: int, rows: int, columns: int) -> torch.Tensor:
    """bitsandbytes' scales, one per ``block`` weights of the flattened ``[rows, columns]``
    weight, as the stored layout's ``[rows, columns / stored_group(columns)]``: each group
    takes the scale of the block that holds it (``block`` a multiple of the group, so a
    group never straddles two blocks)."""
    group = stored_group(columns)
    starts = (torch.arange(rows, device=absmax.device)[:, None] * columns
              + torch.arange(0, columns, group, device=absmax.device)[None, :])
    return absmax[starts // block]


def codes_of_bytes(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """``[R, columns / 2]`` bytes, two codes each (high nibble first) -> int32 ``[R,
    columns]`` codes."""
    packed = packed.to(torch.int32)
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.shape[0], columns)


def quantize(weight: torch.Tensor, quant_type: str = "nf4") -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' 4-bit quantization of ``weight [N, K]`` in blocks of ``GROUP``
    consecutive weights of the flattened tensor (the last may be shorter): ``(codes int32
    [N, K], scales float32 [N, K / stored_group(K)])``. Each block's values are scaled by
    ``1 / absmax`` (clamped to [-1, 1]) and take the code whose value is nearest (ties to
    the lower), as bitsandbytes' own ``quantize_4bit`` computes them."""
    rows, columns = weight.shape
    code = code_values(quant_type).to(weight.device)
    order = torch.argsort(code)
    sorted_code = code[order]
    bounds = (sorted_code[:-1] + sorted_code[1:]) / 2
    flat = weight.float().reshape(-1)
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % GROUP)).view(-1, GROUP)
    absmax = blocks.abs().amax(dim=-1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(-1), -1, 1)
    if flat.numel() % GROUP:  # bitsandbytes divides the shorter last block by its absmax
        scaled[-1] = torch.clamp(blocks[-1] / absmax[-1].clamp(min=1e-38), -1, 1)
    codes = order.to(torch.int32)[torch.bucketize(scaled, bounds, out_int32=True)]
    codes = codes.view(-1)[:flat.numel()]
    return codes.view(rows, columns), row_scales(absmax, GROUP, rows, columns)
