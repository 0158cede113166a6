"""Which attention backend a device gets, and the PAGEDLLM_ATTENTION_BACKEND override."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.attention.selector import (
    BACKEND_ENV,
    attention_backend_name,
    get_attention_backend,
)
from pagedllm.layers.attention.torch_ref import TorchReferenceBackend
from pagedllm.layers.attention.triton_backend import TritonAttentionBackend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cuda_runs_triton_and_cpu_runs_the_torch_reference(monkeypatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert attention_backend_name(CUDA) == "triton"
    assert attention_backend_name(CPU) == "torch"
    assert isinstance(get_attention_backend("cpu"), TorchReferenceBackend)


def test_env_var_forces_the_torch_backend_on_cuda(monkeypatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert attention_backend_name(CUDA) == "torch"


def test_env_var_selects_triton_on_the_cpu_under_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "Triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(get_attention_backend("cpu"), TritonAttentionBackend)
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert isinstance(get_attention_backend("cpu"), TorchReferenceBackend)


def test_triton_on_the_cpu_without_the_interpreter_says_what_to_set(monkeypatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attention_backend_name(CPU)


def test_unknown_backend_name_is_rejected_naming_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match=f"{BACKEND_ENV}='flash'.*torch, triton"):
        attention_backend_name(CUDA)
