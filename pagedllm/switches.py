"""On/off switches read from the environment (``PAGEDLLM_...=1`` or ``=0``).

A value other than ``1`` or ``0`` is refused with a message naming the variable, so a
switch that is set never goes silently unread.
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
