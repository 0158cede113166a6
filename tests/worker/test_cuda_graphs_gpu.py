"""On a GPU: decode, prompt and verification steps replay CUDA graphs, and greedy tokens
equal the eager engine's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.cuda_graphs import capture_sizes
from tests.spec_decode.conftest import without_last_layer
from tests.utils import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cuda_graph_decode_gives_the_eager_greedy_tokens(tmp_path, kv_cache_dtype) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=256)
    prompts = [{"prompt_token_ids": [(5 * i + 11 * j) % 240 + 8 for j in range(4 + 9 * i)]}
               for i in range(9)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 4 * i, ignore_eos=True)
              for i in range(9)]
    kwargs = dict(dtype="float32", max_model_len=160, max_num_seqs=16, block_size=16,
                  device="cuda", kv_cache_dtype=kv_cache_dtype)
    graphed = LLM(str(path), **kwargs)  # asynchronous scheduling: the default on CUDA
    assert graphed.llm_engine.engine_core.async_scheduling
    runner = graphed.llm_engine.engine_core.model_runner
    assert runner.graph_runner is not None
    replays, pending = [], []
    original_run = runner.graph_runner.run

    def counting_run(inputs, fill=None):
        replays.append(inputs.num_tokens)
        pending.append(len(inputs.pending_token_indices))
        return original_run(inputs, fill)

    runner.graph_runner.run = counting_run
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]

    eager = LLM(str(path), enforce_eager=True, async_scheduling=False, **kwargs)
    assert eager.llm_engine.engine_core.model_runner.graph_runner is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert set(replays) >= {9, 5, 1}  # padded to 16, 8 and replayed exactly at 1
    assert sum(pending) > 0  # decodes took their input ids from the device
    decode_sizes = sorted(size for kind, size in runner.graph_runner._graphs if kind == "decode")
    assert decode_sizes == capture_sizes(16)


def test_fp8_cache_decodes_within_the_short_bound_replay_their_own_graphs(tmp_path) -> None:
    """Over an FP8 cache, decode steps whose contexts all fit ``SHORT_DECODE_CONTEXT``
    replay the graphs captured under it (another attention tile), longer ones the plain
    graphs; both give the eager engine's greedy tokens (which picks the tile from each
    step's own longest context)."""
    from pagedllm.layers.attention.triton_decode import SHORT_DECODE_CONTEXT

    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=1024)
    lengths = (SHORT_DECODE_CONTEXT - 10, 300, SHORT_DECODE_CONTEXT - 2, 40)
    prompts = [{"prompt_token_ids": [(3 * i + 7 * j) % 240 + 8 for j in range(n)]}
               for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0.0, max_tokens=24 - 4 * i, ignore_eos=True)
              for i in range(len(prompts))]  # the first decodes fit the bound, later ones pass it
    kwargs = dict(dtype="float32", max_model_len=1024, max_num_seqs=8, block_size=16,
                  device="cuda", kv_cache_dtype="fp8")
    graphed = LLM(str(path), **kwargs)
    runner = graphed.llm_engine.engine_core.model_runner.graph_runner
    assert runner.short_decode_len == SHORT_DECODE_CONTEXT
    kinds = []
    original_run = runner.run
    runner.run = lambda inputs, fill=None: kinds.append(runner.graph_for(inputs)[0]) or original_run(inputs, fill)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    eager = LLM(str(path), enforce_eager=True, async_scheduling=False, **kwargs)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert {"decode", "short decode"} <= set(kinds)


def test_mixed_steps_replay_mixed_graphs_and_give_the_eager_greedy_tokens(tmp_path, monkeypatch) -> None:
    """``PAGEDLLM_MIXED_GRAPHS=1``: steps of several prompts and decodes replay mixed graphs
    (sizes shrunk to the tiny model's), with asynchronous scheduling; tokens equal eager."""
    from pagedllm.worker import cuda_graphs

    monkeypatch.setenv("PAGEDLLM_MIXED_GRAPHS", "1")
    monkeypatch.setattr(cuda_graphs, "MIXED_CAPTURE_SIZES", (32, 64, 96))
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=256)
    shared = [(5 * j) % 240 + 8 for j in range(32)]
    prompts = [{"prompt_token_ids": ids} for ids in (
        [7, 8, 9], shared + [11, 12], shared + list(range(20, 61)), list(range(8, 70)),
        [(13 * j) % 240 + 8 for j in range(21)])]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]
    kwargs = dict(dtype="float32", max_model_len=160, max_num_seqs=16, block_size=16,
                  device="cuda", max_num_batched_tokens=96)
    graphed = LLM(str(path), **kwargs)
    runner = graphed.llm_engine.engine_core.model_runner.graph_runner
    assert runner.sizes["mixed"] == [32, 64, 96]
    keys = []
    original_run = runner.run
    runner.run = lambda inputs, fill=None: keys.append(runner.graph_for(inputs)) or original_run(inputs, fill)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    eager = LLM(str(path), enforce_eager=True, async_scheduling=False, **kwargs)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert any(kind == "mixed" for kind, _ in keys)


def test_single_prompts_replay_prompt_graphs_and_give_the_eager_greedy_tokens(tmp_path) -> None:
    """One request at a time, as a latency-bound user sends them: each prefill replays a
    prompt graph padded to its captured length (a prefix-cache hit included)."""
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=256)
    shared = [(5 * j) % 240 + 8 for j in range(32)]
    prompts = [[7, 8, 9], shared + [11, 12], shared + list(range(20, 61)), list(range(8, 108))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kwargs = dict(dtype="float32", max_model_len=160, max_num_seqs=16, block_size=16,
                  device="cuda")

    def run(llm: LLM) -> list[list[int]]:
        return [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
                for p in prompts]

    graphed = LLM(str(path), **kwargs)
    runner = graphed.llm_engine.engine_core.model_runner.graph_runner
    keys = []
    original_run = runner.run
    runner.run = lambda inputs, fill=None: keys.append(runner.graph_for(inputs)) or original_run(inputs, fill)
    got = run(graphed)
    want = run(LLM(str(path), enforce_eager=True, **kwargs))
    assert got == want
    assert {("prompt", 16), ("prompt", 64), ("prompt", 128)} <= set(keys)


def test_verification_steps_replay_verify_graphs_and_give_the_plain_greedy_tokens(tmp_path) -> None:
    """Speculative decoding with a draft model: steps verifying several requests replay the
    target's verify graphs (batches padded up, requests with fewer proposals or none padded
    to K + 1 rows) and the draft's catch-up forwards its own (2 rows a request); greedy
    tokens equal the plain eager engine's."""
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=256)
    draft = without_last_layer(path, tmp_path / "draft")
    prompts = [{"prompt_token_ids": [(5 * i + 11 * j) % 240 + 8 for j in range(4 + 9 * i)]}
               for i in range(7)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(7)]
    kwargs = dict(dtype="float32", max_model_len=160, max_num_seqs=8, block_size=16,
                  device="cuda")
    eager = LLM(str(path), enforce_eager=True, **kwargs)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager

    graphed = LLM(str(path), speculative_model=str(draft), num_speculative_tokens=3, **kwargs)
    runner = graphed.llm_engine.engine_core.model_runner
    verify_sizes = sorted(size for kind, size in runner.graph_runner._graphs if kind == "verify")
    assert verify_sizes == capture_sizes(8)
    assert any(kind == "verify" for kind, _ in runner.drafter.graph_runner._graphs)
    keys = {"target": [], "draft": []}
    for name, graph_runner in (("target", runner.graph_runner),
                               ("draft", runner.drafter.graph_runner)):
        def recording_run(inputs, fill=None, name=name, graph_runner=graph_runner,
                          run=graph_runner.run):
            keys[name].append((graph_runner.graph_for(inputs), len(inputs.seq_lens)))
            return run(inputs, fill)

        graph_runner.run = recording_run
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert any(key == ("verify", 8) and n == 7 for key, n in keys["target"])  # 7 padded to 8
    assert any(key[0] == "verify" and n > 1 for key, n in keys["draft"])
    stats = graphed.llm_engine.engine_core.scheduler.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_async_scheduling_on_cuda_matches_sync_for_sampling_and_preemption(tmp_path) -> None:
    """Seeded sampling, penalties, stop tokens and preemption: the asynchronous engine on
    the GPU (pinned read-back, device-side input ids, graphs) gives the synchronous one's
    tokens."""
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=256)
    prompts = [{"prompt_token_ids": [(3 * i + 7 * j) % 240 + 8 for j in range(5 + 6 * i)]}
               for i in range(8)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.3 if i % 3 == 0 else 1.0,
                             stop_token_ids=[17] if i % 4 == 1 else None)
              for i in range(8)]
    kwargs = dict(dtype="float32", max_model_len=96, max_num_seqs=8, block_size=16,
                  device="cuda", num_kv_blocks=12, enable_prefix_caching=False)
    outputs = {}
    for mode in (True, False):
        llm = LLM(str(path), async_scheduling=mode, **kwargs)
        outputs[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                         for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert outputs[True] == outputs[False]


def test_graphs_of_large_batches_start_the_longest_sequences_first(tmp_path, monkeypatch) -> None:
    """Decode batches of 64 sequences or more start their longest contexts first (an order
    computed inside each graph on every replay); tokens equal the eager engine's in the
    given order."""
    from pagedllm.layers.attention import triton_decode

    num = triton_decode.LONGEST_FIRST_MIN_SEQS + 16
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=256)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 240 + 8 for j in range(2 + (37 * i) % 90)]}
               for i in range(num)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + (11 * i) % 23, ignore_eos=True)
              for i in range(num)]
    kwargs = dict(dtype="float32", max_model_len=160, max_num_seqs=num, block_size=16, device="cuda")
    orders = []
    original = triton_decode.longest_first
    monkeypatch.setattr(triton_decode, "longest_first",
                        lambda seq_lens: orders.append(seq_lens.shape[0]) or original(seq_lens))
    from pagedllm.layers.attention import triton_backend
    monkeypatch.setattr(triton_backend, "longest_first", triton_decode.longest_first)
    graphed = LLM(str(path), **kwargs)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert max(orders) >= triton_decode.LONGEST_FIRST_MIN_SEQS

    monkeypatch.setenv(triton_decode.LONGEST_FIRST_ENV, "0")
    eager = LLM(str(path), enforce_eager=True, async_scheduling=False, **kwargs)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_no_kernel_compiles_once_the_engine_has_started(tmp_path, kv_cache_dtype) -> None:
    """The warm-up and the graphs compile every Triton kernel variant a step can need, so a
    workload of every step kind compiles nothing after start-up: prompts of many lengths,
    alone, several at once and beside decodes (chunked past the token budget), decode
    batches below and above 64 sequences at short and long contexts, and greedy, random,
    filtered and penalised rows. A compilation mid-run stalls its step for about a second.
    It runs in a process of its own: kernels the other tests compiled would hide a gap. An
    FP8 KV cache compiles variants of its own (the cache's element type is part of a
    kernel's signature)."""
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=2048)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from tests.worker.test_cuda_graphs_gpu import "
         "compiled_after_start; print('\\n'.join(compiled_after_start(*sys.argv[1:])))",
         str(path), kv_cache_dtype],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", "compiled after start-up:\n" + result.stdout


def compiled_after_start(path: str, kv_cache_dtype: str = "auto") -> list[str]:
    """The Triton kernel variants compiled while an engine started on ``path`` (with a KV
    cache of ``kv_cache_dtype``) serves a workload of every step kind (after its start-up)."""
    import triton

    llm = LLM(path, dtype="bfloat16", max_model_len=1536, max_num_seqs=96, block_size=16,
              max_num_batched_tokens=1024, device="cuda", kv_cache_dtype=kv_cache_dtype)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
             SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3),
             SamplingParams(temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.5)]
    prompts = [{"prompt_token_ids": [(3 * i + 7 * j) % 240 + 8 for j in range(2 + (37 * i) % 1200)]}
               for i in range(80)]
    params = [kinds[i % len(kinds)].clone(max_tokens=1 + (13 * i) % 60, ignore_eos=True)
              for i in range(80)]
    compiled: list[str] = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **info: compiled.append(info["repr"])
    try:
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # small batches, one at a time
        for prompt, p in zip(prompts[4:8], params[4:8]):
            llm.generate(prompt, p, use_tqdm=False)
        llm.generate(prompts, params, use_tqdm=False)  # everything at once
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    return compiled
