"""Worker tests drive the Triton attention backend: natively on a CUDA machine, under
Triton's interpreter elsewhere (set before any kernel module is imported)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

torch.set_num_threads(1)
pytest.importorskip("triton")

from tests.kernels.conftest import _let_interpreter_scalars_bound_loops  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    _let_interpreter_scalars_bound_loops()
