"""The warm-up steps: they reach every kernel variant a real step can, and change nothing."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.layers.attention.triton_decode import LONGEST_FIRST_MIN_SEQS, plan_decode_splits
from pagedllm.layers.attention.triton_prefill import prefill_tile_config
from pagedllm.worker.warmup import warm_up_kernels, warm_up_layouts

H200_SMS = 132


def _variant(layout, num_kv_heads: int) -> tuple[bool, bool, bool]:
    """(prompt present, decodes started longest first, decodes split) of a step."""
    decodes = [c + 1 for c, q in layout if q == 1]
    splits = plan_decode_splits(len(decodes), num_kv_heads, max(c + q for c, q in layout), H200_SMS)
    return (any(q > 1 for _, q in layout), len(decodes) >= LONGEST_FIRST_MIN_SEQS, splits > 1)


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
@pytest.mark.parametrize("max_num_seqs, budget, max_model_len", [
    (256, 8192, 131072), (512, 16384, 4096), (64, 2048, 32768), (12, 64, 64)])
def test_layouts_reach_every_decode_variant_a_step_can(max_num_seqs, budget, max_model_len,
                                                      num_kv_heads) -> None:
    layouts = warm_up_layouts(max_num_seqs, budget, max_model_len)
    for layout in layouts:
        assert len(layout) <= max_num_seqs and sum(q for _, q in layout) <= budget
        assert max(c + q for c, q in layout) <= max_model_len
    warmed = {_variant(layout, num_kv_heads) for layout in layouts if any(q == 1 for _, q in layout)}
    for num_decodes in range(1, max_num_seqs + 1):
        for longest in (1, 100, 256, 257, 1000, 5000, max_model_len):
            if longest > max_model_len:
                continue
            for with_prompt in (False, True):
                if num_decodes + with_prompt > max_num_seqs or num_decodes + 5 * with_prompt > budget:
                    continue
                step = ((longest - 1, 1),) * num_decodes + ((0, 5),) * with_prompt
                assert _variant(step, num_kv_heads) in warmed, step


@pytest.mark.parametrize("queries_per_kv", [1, 2, 4, 8])
@pytest.mark.parametrize("max_num_seqs, budget, max_model_len", [(256, 8192, 131072), (12, 64, 64)])
def test_layouts_reach_every_prefill_tile_a_step_can(max_num_seqs, budget, max_model_len,
                                                     queries_per_kv) -> None:
    """The prefill kernel's query tile follows the step's longest prompt; a step with
    decodes beside its prompts is a variant of its own."""
    cuda = torch.device("cuda")

    def variant(longest_prompt: int, with_decodes: bool) -> tuple[int, bool]:
        return prefill_tile_config(longest_prompt, queries_per_kv, 128, cuda)[0], with_decodes

    warmed = {variant(max(q for _, q in layout), any(q == 1 for _, q in layout))
              for layout in warm_up_layouts(max_num_seqs, budget, max_model_len)
              if any(q > 1 for _, q in layout)}
    for longest in range(2, min(budget, max_model_len) + 1):
        assert variant(longest, False) in warmed
        if longest < budget:
            assert variant(longest, True) in warmed


def test_warm_up_runs_every_layout_and_caches_nothing(monkeypatch, tmp_path) -> None:
    """On the Triton kernels (the interpreter here): every step of the warm-up runs, the
    KV cache holds afterwards exactly what it held before, and long prompts' library
    attention is readied with the model's dtype, cache and head count."""
    from tests.utils import make_tiny_checkpoint

    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    path = make_tiny_checkpoint(tmp_path, "qwen3", vocab_size=128, max_position_embeddings=128)
    llm = LLM(str(path), block_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
              seed=0, enforce_eager=True)
    runner = llm.llm_engine.engine_core.model_runner
    for cache in runner.kv_caches:
        cache.normal_()
    before = [cache.clone() for cache in runner.kv_caches]
    layouts = warm_up_layouts(4, 64, 64)
    forwards, dense = [], []
    original = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda *a: forwards.append(1) or original(*a))
    from pagedllm.layers.attention import dense_prefill
    monkeypatch.setattr(dense_prefill, "warm_up", lambda dtype, cache, heads: dense.append(
        (dtype, cache.shape, heads)))
    warm_up_kernels(runner.model, runner.sampler, runner.kv_caches, layouts,
                    block_size=8, vocab_size=128, device=runner.device)
    assert len(forwards) == len(layouts)
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_caches, before))
    config = runner.model.config  # long prompts' library path readied for this model
    assert dense == [(runner.dtype, runner.kv_caches[0].shape, config.num_heads)]


def test_warm_up_block_tables_are_strided_as_a_real_steps() -> None:
    """Triton specialises on a stride's divisibility by 16: the warm-up must pad its
    block-table rows as ``DeviceInputBuffers`` pads a real step's, or it compiles variants
    no step uses."""
    from pagedllm.worker.warmup import _metadata

    for layout in warm_up_layouts(256, 8192, 131072):
        table = _metadata(layout, 16, torch.device("cpu")).block_tables
        assert table.stride(0) % 16 == 0 and table.shape[1] * 16 >= max(c + q for c, q in layout)
