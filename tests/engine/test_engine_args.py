"""Engine arguments as the offline API takes them: refusals say what to change."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM


def test_cuda_with_a_cpu_only_torch_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match="CPU-only build: install a CUDA build of torch") as info:
        LLM(device="cuda")
    assert "--device cpu" in str(info.value)


def test_cuda_that_sees_no_gpu_names_the_driver_and_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ValueError, match="sees no GPU: check the NVIDIA driver"):
        LLM(device="cuda")


def test_unknown_device_names_the_valid_ones():
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'gpu'"):
        LLM(device="gpu")


def test_unsupported_option_names_the_flag_to_drop_and_the_keyword():
    with pytest.raises(ValueError) as info:
        LLM(quantization="bitsandbytes")
    assert str(info.value) == (
        "--quantization bitsandbytes (quantization='bitsandbytes') is not supported by "
        "pagedllm yet: use fp8, compressed-tensors, gptq or awq, or drop --quantization (the "
        "quantization keyword in Python).")
    with pytest.raises(ValueError, match=r"^--enable-lora \(enable_lora=True\) is not supported"):
        LLM(enable_lora=True)
