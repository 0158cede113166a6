"""Worker tests drive the Triton attention backend: natively on a CUDA machine, under
Triton's interpreter elsewhere."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before any kernel module is imported
torch.set_num_threads(1)
pytest.importorskip("triton")
