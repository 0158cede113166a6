"""Shared fixtures. Helpers live in ``tests/utils.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """``tiny_checkpoint(family, **overrides) -> Path``: see ``make_tiny_checkpoint``."""
    from tests.utils import make_tiny_checkpoint

    def build(family: str, **overrides: Any) -> Path:
        return make_tiny_checkpoint(tmp_path, family, **overrides)

    return build
