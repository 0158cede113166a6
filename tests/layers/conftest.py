"""The fused-op kernels run natively on a CUDA machine and under Triton's interpreter elsewhere.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any
test module imports the kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

torch.set_num_threads(1)
triton = pytest.importorskip("triton")
