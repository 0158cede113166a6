"""What Triton compiles a kernel launch for, recorded on the CPU.

Triton compiles one variant of a kernel per combination of its constexpr values, launch
options (warps, stages), argument dtypes, and the values of its integer and pointer
arguments as far as it specialises on them: an integer equal to 1 or divisible by 16, a
pointer aligned to 16 bytes (unless the kernel lists the argument in
``do_not_specialize``). ``LaunchKeys`` records that key for every launch, so a test can
check that what varies from step to step (batch size, split count) compiles nothing new.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def _spec(value: Any, specialised: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, specialised and value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value).__name__ if isinstance(value, float) else value
    return ("int", specialised and value == 1, specialised and value % 16 == 0)


class LaunchKeys:
    """Records ``module.name[grid](...)``'s compile key at each launch (the launch runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        kernel = getattr(module, name)
        self.keys: list[tuple] = []
        names = list(kernel.arg_names)
        fixed = set(getattr(kernel, "kwargs", {}).get("do_not_specialize") or [])
        outer = self

        class Spy:
            def __getitem__(self, grid):
                launch = kernel[grid]

                def run(*args, **kwargs):
                    key = tuple(_spec(v, names[i] not in fixed) for i, v in enumerate(args))
                    outer.keys.append(key + tuple(sorted((k, _spec(v, True)) for k, v in kwargs.items())))
                    return launch(*args, **kwargs)

                return run

        monkeypatch.setattr(module, name, Spy())
