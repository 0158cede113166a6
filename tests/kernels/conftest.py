"""Kernel tests run natively on a CUDA machine and under Triton's interpreter elsewhere."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before any test module imports the kernels
triton = pytest.importorskip("triton")
