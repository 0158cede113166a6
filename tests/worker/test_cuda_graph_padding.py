"""Steps padded to a captured size compute what the unpadded step computes.

A CUDA graph replays a fixed shape. A decode batch's padding rows carry slot -1 (no KV
write) and context length 0 (attention reads nothing and writes zeros); a single prompt's
padding tokens follow its real ones, so causality hides them; a verify step's requests
get padding rows before their real ones (at context positions, slot -1) up to ``K + 1``
rows each, and padding requests of ``K + 1`` rows fill the batch. These tests pin that
contract on the kernels and on the whole engine, running the padded forward eagerly
(``use_graphs=False``), which is what a replay computes.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention.backend import set_forward_context
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
from pagedllm.layers.attention.triton_decode import paged_decode_attention
from pagedllm.worker.cuda_graphs import (
    DECODE,
    SHORT_DECODE,
    CudaGraphRunner,
    capture_sizes,
    padded_size,
    prompt_capture_sizes,
    verify_capture_sizes,
)
from pagedllm.worker.input_batch import StepInputs
from tests.kernels.paged_batch import DEVICE, TOLERANCE, make_step, reference_attention
from tests.spec_decode.conftest import without_last_layer
from tests.utils import make_attention_metadata, make_tiny_checkpoint

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
    # Verify batches of K + 1 rows a request, within the token budget.
    assert verify_capture_sizes(256, 5, 8192) == capture_sizes(256)
    assert verify_capture_sizes(512, 5, 2048) == capture_sizes(409)  # 409 x 5 <= 2048
    assert verify_capture_sizes(100, 1, 8192) == []  # no speculation
    assert verify_capture_sizes(8, 5, 4) == []


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
    """LLMs on the tiny checkpoint whose attention runs the Triton backend; with
    ``reference=True`` the torch backend, whose eager greedy tokens are the references
    (fast on the CPU; they equal the Triton backend's eager ones on these models)."""
    checkpoints = {}

    def build(family: str = "qwen3", reference: bool = False, **overrides) -> LLM:
        monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "torch" if reference else "triton")
        if family not in checkpoints:
            extra = dict(sliding_window=12) if family == "mistral" else {}
            checkpoints[family] = make_tiny_checkpoint(
                tmp_path, family, vocab_size=128, max_position_embeddings=128, **extra)
        kwargs = dict(block_size=8, max_model_len=64, max_num_seqs=12, seed=0,
                      enforce_eager=True)
        return LLM(str(checkpoints[family]), **{**kwargs, **overrides})

    return build


@pytest.mark.parametrize("short_decode_len", [None, 16])
def test_padded_decode_forward_gives_the_eager_greedy_tokens(triton_llm_factory,
                                                             short_decode_len) -> None:
    """With ``short_decode_len``, decode steps whose contexts all fit it replay the short
    decode graphs (captured under that bound), the others the plain ones; tokens as eager."""
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 120 + 4 for j in range(19 - 4 * i)]}
               for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True)
              for i in range(5)]  # decode batches of 5, 4, 3, 2, 1, the longest prompts first done
    eager = triton_llm_factory(reference=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]

    padded = triton_llm_factory()
    runner = padded.llm_engine.engine_core.model_runner
    graph_runner = CudaGraphRunner(
        runner.model, runner.kv_caches, max_num_seqs=12, max_model_len=64, block_size=8,
        device=runner.device, use_graphs=False, short_decode_len=short_decode_len,
    )
    runner.graph_runner = graph_runner
    steps, kinds = [], Counter()

    def run(inputs, fill=None):
        steps.append(inputs.num_tokens)
        kind, size = graph_runner.graph_for(inputs)
        kinds[kind] += 1
        bound = graph_runner._attention_metadata((kind, size)).max_seq_len
        assert int(inputs.seq_lens.max()) <= bound == (16 if kind == SHORT_DECODE else 64)
        return original_run(inputs, fill)

    original_run = graph_runner.run
    graph_runner.run = run
    got = [o.outputs[0].token_ids for o in padded.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert 5 in steps and 3 in steps  # 5 -> padded to 8, 3 -> padded to 4
    # Prompts of 19..3 tokens: the first decodes hold contexts past 16, the later ones not.
    assert set(kinds) == ({SHORT_DECODE, DECODE} if short_decode_len else {DECODE})


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

    want = run(triton_llm_factory(family, reference=True, **overrides))
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


@pytest.mark.parametrize("family", ["qwen3", "mistral"], ids=["full", "sliding-window"])
def test_padded_mixed_forward_gives_the_eager_greedy_tokens(triton_llm_factory, monkeypatch,
                                                            family) -> None:
    """Steps of several prompts, chunks and decodes together, each padded to a captured
    mixed size over a padding sequence and empty ones (sizes shrunk to the tiny model's:
    16, 32, 48 tokens); the tokens equal the eager engine's, through prefix-cache hits,
    chunked prefill and a sliding window."""
    from pagedllm.worker import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "MIXED_CAPTURE_SIZES", (16, 32, 48))
    monkeypatch.setattr(cuda_graphs, "SMALL_TOKEN_BUFFER", 0)  # stage rows as large buffers do
    shared = [(5 * j) % 120 + 4 for j in range(16)]  # two blocks of 8, shared
    prompts = [{"prompt_token_ids": ids} for ids in (
        [(7 * j) % 120 + 4 for j in range(3)], shared + [9, 10, 11],
        shared + [(11 * j) % 120 + 4 for j in range(19)], list(range(4, 34)),
        [(13 * j) % 120 + 4 for j in range(9)])]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True)
              for i in range(len(prompts))]
    overrides = dict(max_num_batched_tokens=48)
    want = [o.outputs[0].token_ids
            for o in triton_llm_factory(family, reference=True, **overrides).generate(
                prompts, params, use_tqdm=False)]

    padded = triton_llm_factory(family, **overrides)
    runner = padded.llm_engine.engine_core.model_runner
    graph_runner = CudaGraphRunner(
        runner.model, runner.kv_caches, max_num_seqs=12, max_model_len=64, block_size=8,
        device=runner.device, max_num_batched_tokens=48, use_graphs=False, mixed_graphs=True,
    )
    assert graph_runner.sizes["mixed"] == [16, 32, 48]
    # A capture's own layout (one padding prompt) holds no decode; its graph must still
    # launch the decode kernel for the steps it will serve.
    assert TritonAttentionBackend()._step_has_decodes(graph_runner._attention_metadata(("mixed", 48)))
    runner.graph_runner = graph_runner
    served = []
    original_run = graph_runner.run
    graph_runner.run = lambda inputs, fill=None: (
        served.append((graph_runner.graph_for(inputs), inputs.num_tokens,
                       np.diff(inputs.query_start_loc).tolist()))
        or original_run(inputs, fill))
    got = [o.outputs[0].token_ids for o in padded.generate(prompts, params, use_tqdm=False)]
    assert got == want
    mixed = [(key, n, lens) for key, n, lens in served if key[0] == "mixed"]
    assert any(len(lens) > 1 and 1 in lens and max(lens) > 1 for _, _, lens in mixed)  # with decodes
    assert any(key[1] > n for key, n, _ in mixed)  # a padding sequence
    assert any(len(lens) > 1 and min(lens) > 1 for _, _, lens in mixed)  # prompts only


def test_mixed_graphs_are_sized_by_the_step_budget_and_the_model() -> None:
    from pagedllm.worker.cuda_graphs import mixed_capture_sizes

    assert mixed_capture_sizes(8192) == [1024, 2048, 3072, 4096, 6144, 8192]
    assert mixed_capture_sizes(5000) == [1024, 2048, 3072, 4096, 5000]
    assert mixed_capture_sizes(100_000)[-1] == 16384
    assert mixed_capture_sizes(512) == []  # the prompt graphs cover it


# -- verify steps (speculative decoding) ----------------------------------------------------


class _AttentionOnly(nn.Module):
    """One paged attention layer whose queries, keys and values are looked up by token id
    (random tables): a model whose hidden states are the attention's output."""

    def __init__(self, vocab_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                 head_dim: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        for name, width in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)):
            table = torch.randn(vocab_size, width * head_dim, generator=g)
            self.register_buffer(name, table.to(DEVICE))
        with torch.device(DEVICE):  # the layer takes the backend of the device it is built on
            self.attn = Attention(num_heads, head_dim, num_kv_heads, 0.25, layer_idx=0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.attn(self.q[input_ids], self.k[input_ids], self.v[input_ids])


def _step_inputs(step, input_ids: torch.Tensor) -> StepInputs:
    """``StepInputs`` (host arrays) of a ``make_step`` step whose tokens have ``input_ids``."""
    md = step.metadata
    qsl = np.asarray(md.query_start_loc_cpu)
    seq_lens = np.asarray(md.seq_lens_cpu)
    positions = np.concatenate([np.arange(s - (qsl[b + 1] - qsl[b]), s)
                                for b, s in enumerate(seq_lens)])
    num_seqs = len(seq_lens)
    empty = np.zeros(0, dtype=np.int64)
    return StepInputs(
        req_ids=[str(b) for b in range(num_seqs)], states=[], input_ids=input_ids.cpu().numpy(),
        positions=positions, slot_mapping=md.slot_mapping.cpu().numpy(), query_start_loc=qsl,
        seq_lens=seq_lens, block_tables=md.block_tables.cpu().numpy(),
        max_query_len=md.max_query_len, sample_req_indices=list(range(num_seqs)),
        logits_indices=qsl[1:] - 1, pending_token_indices=empty, pending_sample_rows=empty,
    )


def test_verify_steps_route_by_query_lengths_and_context() -> None:
    """Every request 1..K+1 tokens and each at least K+1 in all: a verify step, its batch
    padded up; one-token steps stay decodes, a longer chunk is a prompt or eager."""
    runner = CudaGraphRunner(_AttentionOnly(), [], max_num_seqs=12, max_model_len=64,
                             block_size=4, device=DEVICE, max_num_batched_tokens=48,
                             verify_width=4)
    assert runner.sizes["verify"] == [1, 2, 4, 8, 12]  # 12 x 4 = 48 tokens

    def key(*seqs):
        step = make_step(seqs)
        input_ids = torch.zeros(step.query.shape[0], dtype=torch.long)
        return runner.graph_for(_step_inputs(step, input_ids))

    assert key((5, 4), (9, 4), (2, 4)) == ("verify", 4)  # uniform: every request verifies K
    assert key((5, 4), (9, 1), (2, 2)) == ("verify", 4)  # a decode and a shorter run beside
    assert key((5, 1), (9, 1)) == ("decode", 2)
    assert key((5, 4), (0, 5)) is None  # a 5-token chunk beside: eager
    assert key((0, 3), (6, 4)) is None  # 3 tokens in all: no context position for a pad row
    assert key((0, 3)) == ("prompt", 16)
    assert key(*[(3, 2)] * 13) is None  # more requests than the largest verify batch


@pytest.mark.parametrize("seqs", [((6, 3), (2, 1), (9, 2)), ((6, 3), (12, 3), (3, 3))],
                         ids=["mixed-lengths", "uniform"])
def test_verify_padding_leaves_real_rows_and_the_kv_cache_as_eager(seqs, monkeypatch) -> None:
    """A verify step padded to a batch of 4 requests of 3 rows gives its real rows the
    eager step's attention output, and leaves the KV cache as the eager step does, bit
    for bit: padding rows write nothing. Unwritten cache slots hold NaN, so a padding row
    that reached a real row, or a real row that read a slot past its sequence, would show."""
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    step = make_step(seqs, block_size=4, seed=5)
    model = _AttentionOnly()
    input_ids = torch.randint(1, 64, (step.query.shape[0],),
                              generator=torch.Generator().manual_seed(1))
    inputs = _step_inputs(step, input_ids)
    eager_cache = step.kv_cache.clone()
    with set_forward_context(step.metadata, [eager_cache]):
        want = model(input_ids.to(DEVICE), torch.from_numpy(inputs.positions).to(DEVICE))

    runner = CudaGraphRunner(model, [step.kv_cache], max_num_seqs=8, max_model_len=32,
                             block_size=4, device=DEVICE, max_num_batched_tokens=32,
                             verify_width=3, use_graphs=False)
    assert runner.graph_for(inputs) == ("verify", 4)
    got = runner.run(inputs)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    assert torch.equal(step.kv_cache.nan_to_num(7.0), eager_cache.nan_to_num(7.0))


def test_padded_verify_steps_give_the_plain_greedy_tokens(monkeypatch, tmp_path) -> None:
    """Speculative decoding with a draft model, three requests verifying at once: the
    target's verification steps run padded (3 requests up to a batch of 4, with and
    without shorter rows beside full ones) and so does the draft's catch-up forward (2
    rows a request). The greedy tokens equal the plain engine's, and the KV caches of
    target and draft equal those of the same speculative engine run eagerly (to the
    rounding of another attention backend): padding rows wrote nothing."""
    target = make_tiny_checkpoint(tmp_path, "llama", vocab_size=128, max_position_embeddings=128)
    draft = without_last_layer(target, tmp_path / "draft")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 120 + 4 for j in range(3 + 2 * i)]}
               for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 4, 6)]
    kwargs = dict(block_size=8, max_model_len=64, max_num_seqs=4, seed=0, enforce_eager=True)
    spec = dict(speculative_model=str(draft), num_speculative_tokens=2)

    def greedy(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    def caches(llm: LLM) -> list[torch.Tensor]:
        runner = llm.llm_engine.engine_core.model_runner
        return runner.kv_caches + runner.drafter.kv_caches

    # The references run the torch backend (fast on the CPU); the padded engine the kernels.
    want = greedy(LLM(str(target), **kwargs))
    eager = LLM(str(target), **kwargs, **spec)
    assert greedy(eager) == want
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    padded = LLM(str(target), **kwargs, **spec)
    runner = padded.llm_engine.engine_core.model_runner
    served = Counter()
    for name, graph_runner in zip(("target", "draft"), runner.make_graph_runners(use_graphs=False)):
        def counting_run(inputs, fill=None, name=name, graph_runner=graph_runner,
                         run=graph_runner.run):
            key = graph_runner.graph_for(inputs)
            if key[0] == "verify":
                full = inputs.num_tokens == len(inputs.seq_lens) * graph_runner.verify_width
                key += (len(inputs.seq_lens), "full" if full else "mixed")
            served[(name, *key)] += 1
            return run(inputs, fill)

        graph_runner.run = counting_run
    assert greedy(padded) == want
    assert served[("target", "verify", 4, 3, "full")] > 0  # 3 requests padded up to 4
    assert served[("target", "verify", 4, 3, "mixed")] > 0  # shorter rows beside full ones
    assert any(key[:2] == ("draft", "verify") for key in served)
    for got_cache, want_cache in zip(caches(padded), caches(eager)):
        torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-5)
