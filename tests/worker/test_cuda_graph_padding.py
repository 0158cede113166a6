"""Steps padded to a captured size compute what the unpadded step computes.

A CUDA graph replays a fixed shape. A decode batch's padding rows carry slot -1 (no KV
write) and context length 0 (attention reads nothing and writes zeros); a single prompt's
padding tokens follow its real ones, so causality hides them. These tests pin that
contract on the kernels and on the whole engine, running the padded forward eagerly
(``use_graphs=False``), which is what a replay computes.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
from pagedllm.layers.attention.triton_decode import paged_decode_attention
from pagedllm.worker.cuda_graphs import (
    CudaGraphRunner,
    capture_sizes,
    padded_size,
    prompt_capture_sizes,
)
from tests.kernels.paged_batch import DEVICE, TOLERANCE, make_step, reference_attention
from tests.utils import make_attention_metadata

DECODES = ((5, 1), (17, 1), (2, 1))  # (cached tokens, new tokens) per sequence


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(100)[-1] == 100
    assert capture_sizes(4096)[-1] == 512
    sizes = capture_sizes(100)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 97, 100, 101)] == [
        1, 4, 8, 8, 16, 100, 100, None
    ]
    assert prompt_capture_sizes(2048, 131072) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert prompt_capture_sizes(100, 64) == [16, 32, 64]  # a prompt never exceeds the model


def _padded_decode_metadata(step, size: int, max_seq_len: int):
    """The graph's layout: ``size`` sequences of query length 1; rows past the real ones
    have slot -1, seq_len 0 and a block table row of stale ids."""
    md = step.metadata
    n = md.num_actual_tokens
    pad = size - n
    tables = md.block_tables.tolist() + [[0] * md.block_tables.shape[1]] * pad
    padded = make_attention_metadata(
        [t for t in tables], [max(s, 1) for s in md.seq_lens_cpu] + [1] * pad, [1] * size,
        md.block_size, device=DEVICE,
    )
    padded.slot_mapping[n:] = -1
    padded.seq_lens[n:] = 0
    padded.slot_mapping[:n] = md.slot_mapping
    padded.max_seq_len = max_seq_len
    return padded


@pytest.mark.parametrize("num_splits", [None, 3])
def test_padding_sequences_write_no_kv_and_attend_to_nothing(num_splits) -> None:
    step = make_step(DECODES, seed=4)
    n = step.query.shape[0]
    expected, expected_cache = reference_attention(step, 0.25, None)
    size = 8
    metadata = _padded_decode_metadata(step, size, max_seq_len=48)

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.randn(size - n, *x.shape[1:], device=x.device)])

    query, key, value = padded(step.query), padded(step.key), padded(step.value)
    if num_splits is None:
        out = TritonAttentionBackend().forward(
            query, key, value, step.kv_cache, metadata, 0.25, None
        )
    else:  # the split-K path (what small batches use on a GPU)
        TritonAttentionBackend().forward(query, key, value, step.kv_cache, metadata, 0.25, None)
        out = torch.full_like(query, float("nan"))
        paged_decode_attention(
            query, step.kv_cache[0], step.kv_cache[1], metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, out, max_seq_len=48, scale=0.25, num_splits=num_splits,
        )
    torch.testing.assert_close(out[:n], expected, **TOLERANCE[torch.float32])
    assert torch.count_nonzero(out[n:]) == 0
    assert torch.equal(step.kv_cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))


@pytest.fixture
def triton_llm_factory(monkeypatch, tmp_path):
    """LLMs on the tiny checkpoint whose attention runs the Triton backend."""
    from tests.utils import make_tiny_checkpoint

    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    checkpoints = {}

    def build(family: str = "qwen3", **overrides) -> LLM:
        if family not in checkpoints:
            extra = dict(sliding_window=12) if family == "mistral" else {}
            checkpoints[family] = make_tiny_checkpoint(
                tmp_path, family, vocab_size=128, max_position_embeddings=128, **extra)
        kwargs = dict(block_size=8, max_model_len=64, max_num_seqs=12, seed=0,
                      enforce_eager=True)
        return LLM(str(checkpoints[family]), **{**kwargs, **overrides})

    return build


def test_padded_decode_forward_gives_the_eager_greedy_tokens(triton_llm_factory) -> None:
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 120 + 4 for j in range(3 + 4 * i)]}
               for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True)
              for i in range(5)]  # decode batches of 5, 4, 3, 2, 1
    eager = triton_llm_factory()
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]

    padded = triton_llm_factory()
    runner = padded.llm_engine.engine_core.model_runner
    graph_runner = CudaGraphRunner(
        runner.model, runner.kv_caches, max_num_seqs=12, max_model_len=64, block_size=8,
        device=runner.device, use_graphs=False,
    )
    runner.graph_runner = graph_runner
    steps = []
    original_run = graph_runner.run
    graph_runner.run = lambda inputs, fill=None: steps.append(inputs.num_tokens) or original_run(inputs, fill)
    got = [o.outputs[0].token_ids for o in padded.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert 5 in steps and 3 in steps  # 5 -> padded to 8, 3 -> padded to 4


@pytest.mark.parametrize("family, chunk", [("qwen3", None), ("qwen3", 16), ("mistral", None)],
                         ids=["whole-prompts", "chunked-prefill", "sliding-window"])
def test_padded_prompt_forward_gives_the_eager_greedy_tokens(triton_llm_factory, family, chunk) -> None:
    """One prompt at a time (the latency case): each prefill, or chunk of one, runs padded
    to a captured prompt length, including a prefix-cache hit (context before the chunk)
    and a sliding window shorter than the prompts; the tokens equal the eager engine's."""
    shared = [(5 * j) % 120 + 4 for j in range(24)]  # 3 blocks of 8: cached after the first
    prompts = [[(7 * j) % 120 + 4 for j in range(3)], shared + [9, 10],
               shared + [(11 * j) % 120 + 4 for j in range(17)], list(range(4, 44))]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    overrides = {} if chunk is None else dict(max_num_batched_tokens=chunk)

    def run(llm: LLM) -> list[list[int]]:
        return [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
                for p in prompts]

    want = run(triton_llm_factory(family, **overrides))
    padded = triton_llm_factory(family, **overrides)
    runner = padded.llm_engine.engine_core.model_runner
    budget = padded.llm_engine.config.scheduler_config.max_num_batched_tokens
    graph_runner = CudaGraphRunner(
        runner.model, runner.kv_caches, max_num_seqs=12, max_model_len=64, block_size=8,
        device=runner.device, max_num_batched_tokens=budget, use_graphs=False,
    )
    runner.graph_runner = graph_runner
    served = []
    original_run = graph_runner.run
    graph_runner.run = lambda inputs, fill=None: (
        served.append((graph_runner.graph_for(inputs), int(inputs.seq_lens[0]) - inputs.num_tokens))
        or original_run(inputs, fill))
    assert run(padded) == want
    prompt_steps = [(key, context) for key, context in served if key[0] == "prompt"]
    assert ("prompt", 16) in [key for key, _ in prompt_steps]  # 3 tokens padded to 16
    assert any(context > 0 for _, context in prompt_steps)  # after a prefix-cache hit
    if chunk is None:
        assert ("prompt", 64) in [key for key, _ in prompt_steps]  # 40 tokens padded to 64
    else:
        assert all(key[1] == 16 for key, _ in prompt_steps)  # chunks of at most 16 tokens
