"""Switches read from the environment: on/off (``PAGEDLLM_...=1`` or ``=0``), choices
among named values, and integers in a range.

A value outside the switch's own is refused with a message naming the variable and the
values it takes, so a switch that is set never goes silently unread.
"""

from __future__ import annotations

import os


def switch(name: str, default: bool) -> bool:
    """Whether the switch ``name`` is on: ``1`` on, ``0`` off, unset or empty ``default``;
    raises ValueError for any other value."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: give 1 (on) or 0 (off).")
    return value == "1"


def choice(name: str, values: tuple[str, ...], default: str) -> str:
    """The value of the switch ``name``, one of ``values`` (case-insensitive; unset or empty
    gives ``default``); raises ValueError for any other value."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in values:
        raise ValueError(f"{name}={value!r}: give one of {', '.join(values)}.")
    return value


def integer(name: str, default: int | None, low: int, high: int) -> int | None:
    """The value of the switch ``name``, an integer from ``low`` to ``high`` (unset or
    empty gives ``default``); raises ValueError for any other value."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or not low <= int(value) <= high:
        raise ValueError(f"{name}={value!r}: give an integer from {low} to {high}.")
    return int(value)
