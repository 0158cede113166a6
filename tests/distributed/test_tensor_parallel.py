"""Tensor and pipeline parallelism on the CPU (gloo): greedy tokens at TP=2, PP=2 and
TP=2 x PP=2 equal HF transformers' in float32 with batching, chunked prefill, prefix-cache
hits and preemption in one run; seeded sampling equals one rank's; pipeline stages keep
steps in flight, and an earlier stage reads the last stage's sampled ids only once they
have arrived; a dead rank fails the engine within seconds."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.executor import WorkerError
from tests.engine.conftest import VOCAB_SIZE, hf_greedy, random_prompts
from tests.tokenizer_utils import make_tiny_tokenizer
from tests.utils import make_tiny_checkpoint

MAX_NEW = 8
# name -> (family, tensor-parallel size, pipeline stages, config overrides)
CASES = {
    "llama_tp2": ("llama", 2, 1, dict(attention_bias=True)),
    "qwen2_moe_tp2_shared_expert": ("qwen2_moe", 2, 1, dict(num_hidden_layers=3,
                                                            mlp_only_layers=[1])),
    "qwen2_pp2": ("qwen2", 1, 2, dict(num_hidden_layers=3)),
    "qwen3_tp2_pp2_tied": ("qwen3", 2, 2, dict(tie_word_embeddings=True)),
}


def _checkpoint(root, family: str, **overrides):
    path = make_tiny_checkpoint(root, family, vocab_size=VOCAB_SIZE, max_position_embeddings=256,
                                **overrides)
    make_tiny_tokenizer(path, vocab_size=VOCAB_SIZE)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_greedy_tokens_equal_hf(case, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    family, tp, pp, overrides = CASES[case]
    path = _checkpoint(tmp_path, family, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stems = random_prompts(2, 17, 24, seed=100)
    prompts = [stems[i % 2][: 9 + 2 * i] + random_prompts(1, 1, 6, seed=200 + i)[0]
               for i in range(6)]
    want = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    # 8 blocks of 8 tokens for six requests of up to 40 tokens: preemption; a budget of 9
    # tokens a step: chunked prefill; shared stems: prefix-cache hits.
    llm = LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, block_size=8,
              num_kv_blocks=8, max_model_len=48, max_num_batched_tokens=9)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        engine = llm.llm_engine
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        done, most_in_flight = {}, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[int(output.request_id)] = output.outputs[0].token_ids
            most_in_flight = max(most_in_flight, len(engine.engine_core._pipeline))
        assert [done[i] for i in range(len(prompts))] == want
        assert most_in_flight == (pp if pp > 1 else 0)  # every stage had a step
        scheduler = llm.llm_engine.engine_core.scheduler
        assert scheduler.num_preemptions_total > 0
        assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
        if case == "llama_tp2":  # seeded sampling draws the same tokens as one rank does
            sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_NEW, seed=7)
            one = LLM(str(path), block_size=8, num_kv_blocks=64, max_model_len=48)
            assert ([o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False)]
                == [o.outputs[0].token_ids for o in one.generate(
                    [{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False)])
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_tensor_parallel_ranks_swap_their_kv_parts_at_preemption(tmp_path) -> None:
    """--swap-space at TP=2: each rank copies its heads' part of a preempted request's
    blocks to its host memory and back; the tokens are HF's."""
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path, "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(6, 17, 30, seed=300)
    want = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), tensor_parallel_size=2, block_size=8, num_kv_blocks=8,
              max_model_len=48, swap_space=0.01)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        core = llm.llm_engine.engine_core
        assert core.scheduler.num_swapped_tokens_total > 0
        assert core.scheduler.num_preempted_tokens_total == 0
        assert core.scheduler.kv_cache_manager.host_pool.num_blocks == core.model_runner.num_host_blocks
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_killed_rank_fails_the_engine_within_seconds(tmp_path) -> None:
    path = _checkpoint(tmp_path, "llama")
    llm = LLM(str(path), tensor_parallel_size=2, max_model_len=256)
    workers = llm.llm_engine.engine_core.model_runner.workers
    victim = workers.processes[1]
    killer = threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL))
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    start = time.monotonic()
    killer.start()
    with pytest.raises(WorkerError, match="rank 1 .*SIGKILL"):
        for _ in range(100):  # far more work than the second before the kill
            llm.generate([{"prompt_token_ids": [5] * 40}] * 4, params, use_tqdm=False)
    assert time.monotonic() - start < 15
    assert not any(p.is_alive() for p in workers.processes)


def test_a_rank_start_up_error_reaches_the_caller(tmp_path) -> None:
    path = _checkpoint(tmp_path, "gpt_neox")
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM's layers cannot be split"):
        LLM(str(path), tensor_parallel_size=2)


def test_sizes_that_do_not_fit_the_model_are_refused_before_any_rank_starts(tmp_path):
    path = _checkpoint(tmp_path, "llama")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(str(path), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline-parallel-size 3 exceeds the model's 2 layers"):
        LLM(str(path), pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="drop --no-async-scheduling"):
        LLM(str(path), pipeline_parallel_size=2, async_scheduling=False)
    with pytest.raises(ValueError, match="--ray-address names a Ray cluster"):
        LLM(str(path), tensor_parallel_size=2, ray_address="10.0.0.1:6379")


@pytest.mark.parametrize("tp, pp, masks_ahead", [(2, 1, "0"), (2, 1, "1"), (1, 2, "0")])
def test_constrained_and_free_requests_with_steps_in_flight(tmp_path, tp, pp, masks_ahead,
                                                            monkeypatch) -> None:
    """The sampling ranks take the constrained rows' grammar answers from the engine while
    steps are in flight (asynchronous scheduling; pipeline stages): constrained outputs are
    members of their choice, free ones equal one rank's. With masks filled ahead
    (``PAGEDLLM_PREFETCH_MASKS=1``, a GPU's default) the ranks sample under the engine's
    masks, nothing checked, and the seeded constrained tokens equal one rank's."""
    from pagedllm.structured import StructuredOutputsParams

    monkeypatch.setenv("PAGEDLLM_PREFETCH_MASKS", masks_ahead)

    path = _checkpoint(tmp_path, "llama")
    prompts = random_prompts(4, 5, 12, seed=9)
    free = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    choices = ["alpha", "beta", "gamma delta"]
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(choice=choices))
    requests = [{"prompt_token_ids": p} for p in prompts for _ in range(2)]
    one = LLM(str(path), max_model_len=128, async_scheduling=True)
    one_rank = [o.outputs[0].token_ids for o in one.generate(
        requests, [free, constrained] * len(prompts), use_tqdm=False)]
    llm = LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, max_model_len=128,
              async_scheduling=True)
    try:
        outputs = llm.generate(requests, [free, constrained] * len(prompts), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs[::2]] == one_rank[::2]
        assert all(o.outputs[0].text in choices for o in outputs[1::2])
        checked = llm.llm_engine.engine_core.structured.num_checked_rows
        assert (checked == 0) == (masks_ahead == "1")
        if masks_ahead == "1":
            assert [o.outputs[0].token_ids for o in outputs[1::2]] == one_rank[1::2]
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("block", [None, (32, 64)])
def test_fp8_checkpoint_at_tp2_equals_hf_on_its_dequantized_weights(tmp_path, block) -> None:
    """Per-channel FP8 weights split with their scales (column-parallel: the rows' scales;
    row-parallel: every scale), a static input scale on every rank; block-wise ones with
    their block scales in whole blocks (column-parallel: rows of blocks of each fused
    shard; row-parallel: columns of blocks), and a split that would cut a block refused at
    start-up with the sizes."""
    from tests.quantization.test_fp8_checkpoints import (
        dequantized_hf_reference,
        write_plain_fp8_checkpoint,
    )

    sizes = {} if block is None else dict(hidden_size=256, intermediate_size=384)
    src = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=128,
                               **sizes)
    fp8_dir = write_plain_fp8_checkpoint(src, tmp_path / "fp8", per_channel=block is None,
                                         static=block is None, block=block)
    prompts = random_prompts(3, 3, 20, seed=4, vocab=256)
    llm = LLM(str(fp8_dir), tensor_parallel_size=2, dtype="float32", block_size=8,
              max_model_len=128)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        assert got == dequantized_hf_reference(fp8_dir, src, prompts, 10, block)
    finally:
        llm.llm_engine.engine_core.shutdown()
    if block is not None:  # down_proj's 320 inputs split in two cut its blocks of 64
        src = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=128,
                                   hidden_size=256, intermediate_size=320)
        cut = write_plain_fp8_checkpoint(src, tmp_path / "cut", False, False, block)
        with pytest.raises(Exception, match=r"columns \[\d+, \d+\) cut the checkpoint's FP8"):
            LLM(str(cut), tensor_parallel_size=2, dtype="float32", max_model_len=128)


def test_block_wise_fp8_experts_at_tp2_give_the_tokens_of_one_rank(tmp_path) -> None:
    """Block-wise FP8 experts split over two ranks in whole blocks of rows and columns
    with their scales; each rank quantizes its inputs in the same groups one rank does, so
    the tokens are the same. (Per-channel experts quantize the down projection's input per
    token over each rank's columns, so their tokens may differ from one rank's, as a
    row-parallel dense projection's do.)"""
    from tests.quantization.test_fp8_checkpoints import write_plain_fp8_checkpoint

    src = make_tiny_checkpoint(tmp_path, "qwen3_moe", vocab_size=256, max_position_embeddings=128)
    fp8_dir = write_plain_fp8_checkpoint(src, tmp_path / "fp8", False, False, (8, 8))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 3, 20, seed=7, vocab=256)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(
        str(fp8_dir), dtype="float32", block_size=8, max_model_len=128,
        device="cpu").generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(fp8_dir), tensor_parallel_size=2, dtype="float32", block_size=8,
              max_model_len=128)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_each_rank_reads_only_its_part_of_the_checkpoint(tmp_path, monkeypatch) -> None:
    """Rank 1 of 2, built in this process: its layers hold its heads, columns and
    vocabulary rows of the checkpoint's tensors, and no projection, embedding or head
    tensor is read whole."""
    from safetensors import safe_open

    from pagedllm.config import ModelConfig
    from pagedllm.distributed import parallel_state, sharding
    from pagedllm.models.loader import load_model

    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=251, num_key_value_heads=2)
    read_whole = []
    full = sharding.CheckpointSlice.full
    monkeypatch.setattr(sharding.CheckpointSlice, "full",
                        lambda self: read_whole.append(self.shape) or full(self))
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelGroup(1, 2))
    model = load_model(ModelConfig(str(path)), "cpu", torch.float32)
    assert all(len(shape) == 1 for shape in read_whole)  # the norms alone
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        w = {name: f.get_tensor(name) for name in f.keys()}
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_proj.weight
    head = 16  # 64 hidden / 4 heads: rank 1 holds q heads 2-3 and KV head 1
    assert torch.equal(qkv[:32], w["model.layers.0.self_attn.q_proj.weight"][32:64])
    assert torch.equal(qkv[32:48], w["model.layers.0.self_attn.k_proj.weight"][head:2 * head])
    assert torch.equal(qkv[48:], w["model.layers.0.self_attn.v_proj.weight"][head:2 * head])
    assert torch.equal(layer.self_attn.o_proj.weight,
                       w["model.layers.0.self_attn.o_proj.weight"][:, 32:64])
    assert torch.equal(layer.mlp.down_proj.weight, w["model.layers.0.mlp.down_proj.weight"][:, 64:])
    # 251 rows in parts of 126: rank 1 holds rows 126-250 and one zero row.
    embed = model.model.embed_tokens.weight
    assert embed.shape[0] == 126 and torch.equal(embed[:125], w["model.embed_tokens.weight"][126:])
    assert not embed[125].any()
    assert torch.equal(model.lm_head.weight[:125], w["lm_head.weight"][126:])


def test_replicated_kv_heads_and_pipeline_stages_hold_their_parts(tmp_path, monkeypatch) -> None:
    """Rank 3 of 4 over 2 KV heads holds query head 3 and KV head 1 (which query heads 2
    and 3 read); stage 1 of 2 holds the second layer, the final norm and the LM head, and
    nothing of the first layer or the embedding."""
    from safetensors import safe_open

    from pagedllm.config import ModelConfig
    from pagedllm.distributed import parallel_state
    from pagedllm.models.loader import load_model

    path = make_tiny_checkpoint(tmp_path, "llama", num_key_value_heads=2)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        w = {name: f.get_tensor(name) for name in f.keys()}
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelGroup(3, 4))
    qkv = load_model(ModelConfig(str(path)), "cpu", torch.float32).model.layers[1] \
        .self_attn.qkv_proj.weight
    assert torch.equal(qkv[:16], w["model.layers.1.self_attn.q_proj.weight"][48:64])
    assert torch.equal(qkv[16:32], w["model.layers.1.self_attn.k_proj.weight"][16:32])
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelGroup())
    monkeypatch.setattr(parallel_state, "_PP", parallel_state.PipelineStage(1, 2, 1, 1))
    model = load_model(ModelConfig(str(path)), "cpu", torch.float32)
    names = {name for name, _ in model.named_parameters()}
    assert model.model.embed_tokens is None and not any(".layers.0." in n for n in names)
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight,
                       w["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(model.lm_head.weight, w["lm_head.weight"])
    assert torch.equal(model.model.norm.weight, w["model.norm.weight"])


@pytest.mark.parametrize("family, sizes", [
    ("llama", dict(hidden_size=128, intermediate_size=256)),
    ("phi3", dict(hidden_size=128, intermediate_size=256)),  # fused qkv_proj, gate_up_proj
    ("qwen3_moe", dict(hidden_size=128, head_dim=32, moe_intermediate_size=128)),
])
def test_gptq_checkpoint_at_tp2_equals_hf_on_its_dequantized_weights(tmp_path, family,
                                                                      sizes) -> None:
    """4-bit weights split after conversion: column-parallel rows, row-parallel whole
    packed words and groups of 32; each expert's gate/up rows and down inputs likewise."""
    from tests.quantization.int_checkpoints import hf_on_dequantized, write_gptq

    src = make_tiny_checkpoint(tmp_path, family, vocab_size=256, max_position_embeddings=128,
                               **sizes)
    quantized = write_gptq(src, tmp_path / "gptq", bits=4, group_size=32)
    prompts = random_prompts(3, 3, 20, seed=6, vocab=256)
    reference = hf_on_dequantized(src, quantized)
    assert _greedy_at_tp2(tmp_path / "gptq", prompts) == [hf_greedy(reference, p, 10)
                                                          for p in prompts]


def _greedy_at_tp2(model_dir, prompts) -> list[list[int]]:
    """Ten greedy tokens of each prompt from ``model_dir`` on two tensor-parallel ranks."""
    llm = LLM(str(model_dir), tensor_parallel_size=2, dtype="float32", block_size=8,
              max_model_len=128)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()



def test_bnb_checkpoint_at_tp2_equals_hf_on_its_dequantized_weights(tmp_path) -> None:
    """bitsandbytes' NF4 codes and float32 block scales split after conversion, as integer
    weights are: column-parallel rows, row-parallel whole words and blocks of 64."""
    pytest.importorskip("bitsandbytes")
    from tests.quantization.test_bnb_checkpoints import hf_dequantized, write_bnb

    src = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=128,
                               hidden_size=256, intermediate_size=512)
    model_dir = write_bnb(src, tmp_path / "bnb")
    prompts = random_prompts(3, 3, 20, seed=6, vocab=256)
    reference = hf_dequantized(model_dir)
    assert _greedy_at_tp2(model_dir, prompts) == [hf_greedy(reference, p, 10) for p in prompts]


def test_bnb_8bit_checkpoint_at_tp2_picks_hfs_tokens_one_row_at_a_time(tmp_path) -> None:
    """bitsandbytes' LLM.int8 split over two ranks: a row-parallel projection's rank holds
    part of each input row and quantizes it by the whole row's largest magnitude (a max
    over the ranks, ``test_llm_int8``), so the engine picks HF's tokens (a row at a time,
    teacher-forced; outlier threshold 1.5: many outliers in these tiny models)."""
    pytest.importorskip("bitsandbytes")
    from tests.quantization.teacher_forced import assert_engine_picks
    from tests.quantization.test_bnb_int8_checkpoints import (
        TIE,
        hf_greedy_row_by_row,
        hf_int8,
        write_int8,
    )

    src = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=128,
                               hidden_size=256, intermediate_size=512)
    model_dir = write_int8(src, tmp_path / "int8", llm_int8_threshold=1.5)
    model = hf_int8(model_dir)
    llm = LLM(str(model_dir), tensor_parallel_size=2, dtype="float32", block_size=8,
              max_model_len=128)
    try:
        for prompt in random_prompts(3, 3, 20, seed=6, vocab=256):
            assert_engine_picks(llm, prompt, *hf_greedy_row_by_row(model, prompt, 10), TIE)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_act_order_4bit_weights_are_refused_along_their_inputs(tmp_path, monkeypatch) -> None:
    from pagedllm.config import ModelConfig
    from pagedllm.distributed import parallel_state
    from pagedllm.models.loader import load_model
    from tests.quantization.int_checkpoints import write_gptq

    src = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=128,
                               hidden_size=128, intermediate_size=256)
    write_gptq(src, tmp_path / "act-order", bits=4, group_size=32, desc_act=True)
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelGroup(1, 2))
    with pytest.raises(ValueError, match="act-order .* cannot be split over tensor-parallel"):
        load_model(ModelConfig(str(tmp_path / "act-order"), dtype="float32"), "cpu",
                   torch.float32)


def test_a_draft_model_speculates_on_every_rank_beside_steps_in_flight(tmp_path) -> None:
    """Each rank runs its share of the draft: a draft that is the target itself has every
    proposal accepted, also after steps without speculation kept in flight (above the
    batch limit); greedy tokens equal HF's."""
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path, "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(4, 5, 16, seed=21)
    lengths = [3, 6, 9, 14]
    want = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    llm = LLM(str(path), tensor_parallel_size=2, max_model_len=64, async_scheduling=True,
              speculative_model=str(path), num_speculative_tokens=3,
              speculative_disable_by_batch_size=2)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == want
        stats = llm.llm_engine.engine_core.scheduler.spec_decoding_stats
        assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_an_earlier_stage_reads_sampled_ids_only_once_they_have_arrived(tmp_path, monkeypatch):
    """A first pipeline stage launches a step whose input is a token the last stage sampled
    in the step before, still on its way (the receive completes when waited for): the step
    reads it only after the receive, never the buffer's earlier contents."""
    from pagedllm.core.outputs import ModelRunnerOutput
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.distributed.parallel_state import PipelineStage
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.worker import model_runner

    sampled = 5  # what the last stage sampled for the prompt's next token

    def receive_later(count: int, device):
        ids = torch.zeros(count, dtype=torch.int64, device=device)

        def wait() -> None:
            with torch.inference_mode():
                ids.fill_(sampled)

        return ids, wait

    monkeypatch.setattr(model_runner, "get_pp", lambda: PipelineStage(stage=0, num_stages=2))
    monkeypatch.setattr(model_runner, "recv_sampled_ids", receive_later)
    # On the CPU: every step runs the model's forward (no graph replay hides it from the hook).
    config = EngineArgs(model=str(_checkpoint(tmp_path, "llama")), device="cpu", block_size=8,
                        num_kv_blocks=16, max_model_len=48).create_engine_config()
    runner = model_runner.ModelRunner(config)
    scheduler = Scheduler(config.scheduler_config, config.cache_config,
                          runner.initialize_kv_cache())
    inputs: list[list[int]] = []
    runner.model.register_forward_pre_hook(lambda _, args: inputs.append(args[0].tolist()))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    scheduler.add_request(Request("0", [7, 8, 9], params, max_model_len=48))
    prompt_step = scheduler.schedule()
    first = runner.execute_model_async(prompt_step)
    # The engine has the last stage's output; this stage has not read its own yet.
    scheduler.update_from_output(prompt_step, ModelRunnerOutput(["0"], [[sampled]]))
    second = runner.execute_model_async(scheduler.schedule())
    assert inputs == [[7, 8, 9], [sampled]]
    assert first.get().sampled_token_ids == [[sampled]]
    second.get()
