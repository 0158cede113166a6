"""Which part of each weight a tensor-parallel rank holds, and reading only that part.

Column-parallel projections split their output rows, row-parallel ones their input
columns, in whole units (a head's ``head_dim`` rows for q, k and v; one row elsewhere)::

    rank r of n holds rows [r * G / n, (r + 1) * G / n) of a dimension of G rows

Grouped KV heads may be fewer than the ranks: then each KV head is replicated on
``n / num_kv_heads`` consecutive ranks, the ranks whose query heads read it (query head
``h`` reads KV head ``h // (num_heads / num_kv_heads)``).

The vocabulary (embedding and LM head) splits into ``ceil(V / n)`` rows per rank; the
last rank's part is padded with zero rows, and the gathered logits are cut back to V.

``CheckpointSlice`` wraps one tensor of a safetensors file unread: ``narrow`` reads only
the rows or columns asked for, so no rank reads the whole model into memory.
"""

from __future__ import annotations

import math

import torch


def shard_range(global_size: int, unit: int, rank: int, size: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s part of a dimension of ``global_size``
    elements split over ``size`` ranks in whole ``unit``s. Raises ValueError when the units
    divide neither way."""
    units = global_size // unit
    if global_size % unit == 0 and units % size == 0:
        length = global_size // size
        return rank * length, length
    if global_size % unit == 0 and units and size % units == 0:
        replicas = size // units
        return (rank // replicas) * unit, unit
    raise ValueError(f"{global_size} = {units} x {unit} cannot be split over {size} ranks: "
                     f"the tensor-parallel size must divide {units} (or be a multiple of it).")


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """``(start, length, padded)``: rank ``rank`` holds vocabulary rows
    ``start .. start + length`` in a part of ``padded`` rows (``length <= padded``)."""
    padded = math.ceil(vocab_size / size)
    start = rank * padded
    return start, max(0, min(padded, vocab_size - start)), padded


class CheckpointSlice:
    """One safetensors tensor, read on demand (``narrow`` or ``full``)."""

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def full(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)]


def read(tensor: torch.Tensor | CheckpointSlice) -> torch.Tensor:
    """The whole tensor."""
    return tensor.full() if isinstance(tensor, CheckpointSlice) else tensor


def narrow(tensor: torch.Tensor | CheckpointSlice, dim: int, start: int,
           length: int) -> torch.Tensor:
    """``tensor``'s elements ``start .. start + length`` along ``dim``, read alone when the
    tensor is still in its file."""
    if isinstance(tensor, CheckpointSlice):
        return tensor.narrow(dim, start, length)
    return tensor.narrow(dim, start, length)
