"""Which attention backend a device uses.

CUDA runs the Triton kernels (``triton_backend.py``) when triton is installed; every other
device, and CUDA without triton, runs the torch reference. The environment variable
``PAGEDLLM_ATTENTION_BACKEND=torch|triton`` overrides the choice, e.g. to compare the two
on one GPU; ``triton`` on the CPU needs ``TRITON_INTERPRET=1`` (slow; for tests).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from pagedllm.layers.attention.backend import AttentionBackend
from pagedllm.layers.attention.torch_ref import TorchReferenceBackend

BACKEND_ENV = "PAGEDLLM_ATTENTION_BACKEND"
BACKEND_NAMES = ("torch", "triton")

_backends: dict[tuple[str, str], AttentionBackend] = {}


def attention_backend_name(device: torch.device) -> str:
    """``"torch"`` or ``"triton"`` for ``device``, honouring ``PAGEDLLM_ATTENTION_BACKEND``."""
    choice = os.environ.get(BACKEND_ENV, "").strip().lower()
    has_triton = importlib.util.find_spec("triton") is not None
    if not choice:
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if choice not in BACKEND_NAMES:
        raise ValueError(
            f"{BACKEND_ENV}={choice!r} names no attention backend: set it to one of "
            f"{', '.join(BACKEND_NAMES)}, or unset it to choose by device."
        )
    if choice == "triton":
        if not has_triton:
            raise ValueError(
                f"{BACKEND_ENV}=triton needs the triton package: pip install triton, "
                f"or set {BACKEND_ENV}=torch."
            )
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"{BACKEND_ENV}=triton on the CPU runs only under Triton's interpreter: "
                f"set TRITON_INTERPRET=1 as well, or set {BACKEND_ENV}=torch."
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"{BACKEND_ENV}=triton has no kernels for device {device.type!r}: "
                f"set {BACKEND_ENV}=torch."
            )
    return choice


def get_attention_backend(device: torch.device | str | None = None) -> AttentionBackend:
    """The backend for ``device`` (default: the current default device).

    One instance per device type and backend, shared by all attention layers so per-step
    routing and index tensors are derived once for the whole model.
    """
    device = torch.device(device) if device is not None else torch.get_default_device()
    name = attention_backend_name(device)
    key = (device.type, name)
    if key not in _backends:
        if name == "triton":
            from pagedllm.layers.attention.triton_backend import TritonAttentionBackend

            _backends[key] = TritonAttentionBackend()
        else:
            _backends[key] = TorchReferenceBackend()
    return _backends[key]
