"""Run Triton kernels natively on a CUDA machine and under Triton's interpreter elsewhere.

``TRITON_INTERPRET`` is read when a kernel is decorated, so a conftest calls
``interpret_without_cuda()`` before any test module imports the kernels.
"""

from __future__ import annotations

import os

import torch


def interpret_without_cuda() -> None:
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    if os.environ.get("TRITON_INTERPRET") == "1":
        _let_interpreter_scalars_bound_loops()


def _let_interpreter_scalars_bound_loops() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with ``int(array_of_shape_1)``,
    which NumPy >= 2.4 refuses, so ``range(start, runtime_end)`` in a kernel fails
    (triton-lang/triton#9171). Convert through a 0-d view instead, as upstream does."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.zeros(1, dtype=np.int32))
        return
    except TypeError:
        pass
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    interpreter._patch_lang_tensor = patched
