"""KV cache sizing: the plain arithmetic doctor and plan share, and the engine's sizing on
top of it, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker import kv_allocator
from pagedllm.worker.kv_allocator import (
    block_bytes, blocks_for_bytes, blocks_per_request, bytes_per_block, cpu_kv_bytes,
    determine_num_blocks, gpu_kv_bytes, kv_element_size, max_concurrency, weight_bytes,
)

GIB = 1 << 30


def test_block_bytes_counts_k_and_v_of_every_layer() -> None:
    # Llama-3.1-8B in bf16: 2 x 32 layers x 16 tokens x 8 heads x 128 x 2 bytes = 2 MiB.
    assert block_bytes(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128,
                       element_size=2) == 2 * 32 * 16 * 8 * 128 * 2 == 2 << 20


def test_blocks_concurrency_and_budgets_by_hand() -> None:
    assert blocks_per_request(8192, 16) == 512 and blocks_per_request(8193, 16) == 513
    assert blocks_for_bytes(10 * GIB, 2 << 20, 10**9) == 5120
    assert blocks_for_bytes(10 * GIB, 2 << 20, 4000) == 4000
    assert blocks_for_bytes(-GIB, 2 << 20, 4000) == 0
    assert max_concurrency(5120, 8192, 16) == 10
    assert gpu_kv_bytes(100 * GIB, 0.9, 16 * GIB) == 74 * GIB
    assert gpu_kv_bytes(100 * GIB, 0.9, 16 * GIB, reserved_bytes=GIB) == 73 * GIB
    assert cpu_kv_bytes(2.0) == 2 * GIB


def test_fp8_weights_take_one_byte_per_projection_weight_plus_channel_scales() -> None:
    hf = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
          "intermediate_size": 16, "vocab_size": 10, "num_hidden_layers": 1}
    # head_dim 4: q 8, k 4, v 4 -> qkv 8x16 + o 8x8 + gate/up/down 3x8x16 = 576 weights;
    # 16 + 8 + 32 + 8 = 64 output channels; 2 norms of 8; embed + head 2 x 80; final norm 8.
    assert weight_bytes(hf, 2) == (576 + 16 + 160 + 8) * 2
    assert weight_bytes(hf, 2, "fp8") == 576 + 64 * 4 + 16 * 2 + (160 + 8) * 2


def _config(**kwargs):
    return EngineArgs(model="qwen3-0.6b", device="cpu", **kwargs).create_engine_config()


def test_engine_sizes_the_cpu_cache_from_kv_cache_memory_gb() -> None:
    config = _config(max_model_len=4096, max_num_seqs=256, kv_cache_memory_gb=1.0)
    # qwen3-0.6b: 28 layers, 8 KV heads, head_dim 128; float32 on the CPU.
    per_block = 2 * 28 * 16 * 8 * 128 * 4
    assert bytes_per_block(config, torch.float32) == per_block
    blocks = determine_num_blocks(config, torch.float32, torch.device("cpu"), lambda: None)
    assert blocks == GIB // per_block == 292


def test_engine_cache_stops_at_what_max_num_seqs_requests_can_use() -> None:
    config = _config(max_model_len=256, max_num_seqs=4, kv_cache_memory_gb=1.0)
    assert determine_num_blocks(config, torch.float32, torch.device("cpu"), lambda: None) == 64


def test_engine_refuses_a_cache_smaller_than_one_request() -> None:
    config = _config(max_model_len=40960, kv_cache_memory_gb=1.0)
    with pytest.raises(ValueError, match="holds 4672 tokens .* needs 40960: lower --max-model-len"):
        determine_num_blocks(config, torch.float32, torch.device("cpu"), lambda: None)


def test_an_fp8_cache_takes_one_byte_an_element_whatever_the_model_dtype() -> None:
    assert kv_element_size("fp8", "bfloat16") == kv_element_size("fp8", "float32") == 1
    assert kv_element_size("auto", "bfloat16") == 2 and kv_element_size("auto", "float32") == 4
    config = _config(max_model_len=4096, kv_cache_memory_gb=1.0, kv_cache_dtype="fp8")
    assert bytes_per_block(config, torch.float8_e4m3fn) == 2 * 28 * 16 * 8 * 128
    bf16 = determine_num_blocks(config, torch.bfloat16, torch.device("cpu"), lambda: None)
    fp8 = determine_num_blocks(config, torch.float8_e4m3fn, torch.device("cpu"), lambda: None)
    assert (bf16, fp8) == (585, 1170)  # 1 GiB / 1,835,008 and / 917,504 bytes


def test_the_engine_with_an_fp8_cache_holds_twice_the_tokens_and_says_so(caplog) -> None:
    """The demo model in bfloat16 on the CPU, 0.01 GiB of cache: 2 x 6 layers x 16 tokens
    x 2 heads x 64 dims = 24,576 elements a block, 49,152 bytes in bf16 (218 blocks),
    24,576 in FP8 (436 blocks)."""
    import logging

    from pagedllm import LLM

    tokens = {}
    for cache_dtype in ("auto", "fp8"):
        with caplog.at_level(logging.INFO, logger="pagedllm.engine.engine_core"):
            llm = LLM(dtype="bfloat16", kv_cache_dtype=cache_dtype, kv_cache_memory_gb=0.01,
                      device="cpu")
        core = llm.llm_engine.engine_core
        tokens[cache_dtype] = core.num_kv_tokens
        assert core.model_runner.kv_caches[0].dtype == (
            torch.bfloat16 if cache_dtype == "auto" else torch.float8_e4m3fn)
    assert tokens == {"auto": 218 * 16, "fp8": 436 * 16}
    assert "KV cache (float8_e4m3fn) 436 blocks x 16 tokens = 6976 tokens" in caplog.text
    assert "KV cache (bfloat16) 218 blocks x 16 tokens = 3488 tokens" in caplog.text


def test_swap_space_beyond_the_available_host_memory_is_refused_at_start(monkeypatch) -> None:
    """--swap-space larger than MemAvailable would fail to page-lock, or starve the host:
    the engine refuses it before allocating, naming both figures."""
    from pagedllm import LLM
    from pagedllm.worker import model_runner

    assert kv_allocator.host_memory_available() is None or kv_allocator.host_memory_available() > 0
    monkeypatch.setattr(model_runner, "host_memory_available", lambda: 2**30)
    with pytest.raises(ValueError, match=r"--swap-space 2 GiB is more than the 1\.0 GiB of host "
                                         "memory available: lower it"):
        LLM(device="cpu", swap_space=2.0)
    llm = LLM(device="cpu", swap_space=0.5, max_model_len=64)  # within it: allocated
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.num_host_blocks == kv_allocator.host_blocks(
        0.5, kv_allocator.bytes_per_block(runner.config, runner.kv_cache_dtype))
    assert sum(cache.numel() for cache in runner.host_kv_caches) <= 0.5 * 2**30
