"""4- and 8-bit integer weight checkpoints (W4A16, W8A16): compressed-tensors made by
llm-compressor, GPTQ and AWQ written from their layouts' descriptions
(``tests/quantization/int_checkpoints.py``). Each is detected from config.json with no
flag and runs to the same greedy tokens as HF transformers on the same dequantized
weights, in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers import int_matmul
from pagedllm.worker import kv_allocator
from tests.engine.conftest import hf_greedy, random_prompts
from tests.quantization.int_checkpoints import hf_on_dequantized, read_tensors, write_awq, write_gptq
from tests.quantization.teacher_forced import assert_engine_picks, full_pass_logprobs
from tests.quantization.checkpoint_runs import engine_greedy, runner_model, with_quantization_config
from tests.utils import make_tiny_checkpoint

# Inputs of 128 and 256 columns: groups of 32, 64 and 128 all fit.
TINY = dict(vocab_size=256, max_position_embeddings=128, hidden_size=128,
            intermediate_size=256)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int-sources")
    return {"llama": make_tiny_checkpoint(root, "llama", **TINY),
            "qwen2": make_tiny_checkpoint(root, "qwen2", **TINY),
            "qwen3": make_tiny_checkpoint(root, "qwen3", head_dim=32, **TINY)}


@pytest.fixture(scope="module")
def llm_compressor_checkpoints(sources, tmp_path_factory) -> dict[str, Path]:
    """llm-compressor's pack-quantized checkpoints: round to nearest W4A16 (symmetric, groups
    of 128), W4A16_ASYM (zero points), W8A16, and GPTQ W4A16 with activation ordering."""
    pytest.importorskip("llmcompressor")
    from tests.quantization.llm_compressor import make_checkpoints

    root = tmp_path_factory.mktemp("int-checkpoints")
    jobs = {
        "llama-w4a16": (sources["llama"], "W4A16", "quantization"),
        "llama-w4a16-asym": (sources["llama"], "W4A16_ASYM", "quantization"),
        "qwen3-w8a16": (sources["qwen3"], "W8A16", "quantization"),
        "llama-gptq-w4a16": (sources["llama"], "W4A16", "gptq"),
    }
    make_checkpoints([(src, root / name, scheme, False, modifier)
                      for name, (src, scheme, modifier) in jobs.items()])
    return {name: root / name for name in jobs}


def engine_tokens(model_dir: Path, prompts, **kwargs) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", block_size=8, max_model_len=128, device="cpu",
              **kwargs)
    return engine_greedy(llm, prompts, 10)


@pytest.mark.parametrize("name", ["llama-w4a16", "llama-w4a16-asym", "qwen3-w8a16",
                                  "llama-gptq-w4a16"])
def test_llm_compressor_int_checkpoint_greedy_equals_hf_with_compressed_tensors(
        llm_compressor_checkpoints, name):
    """The reference decompresses with compressed-tensors itself (a third-party reading of
    the packed weights, scales and zero points)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model_dir = llm_compressor_checkpoints[name]
    prompts = random_prompts(3, 3, 20, seed=5, vocab=256)
    reference = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    want = [hf_greedy(reference, prompt, 10) for prompt in prompts]
    assert engine_tokens(model_dir, prompts) == want


GPTQ_CASES = {
    "4bit-g128": dict(bits=4, group_size=128),
    "4bit-g32-act-order": dict(bits=4, group_size=32, desc_act=True),
    "4bit-g64-act-order-asym": dict(bits=4, group_size=64, desc_act=True, sym=False),
    "4bit-per-channel-v2": dict(bits=4, group_size=-1, checkpoint_format="gptq_v2"),
    "4bit-g32-v2-asym": dict(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2"),
    "8bit-g64-act-order": dict(bits=8, group_size=64, desc_act=True),
    "8bit-g32": dict(bits=8, group_size=32, sym=False),
}


@pytest.mark.parametrize("case", sorted(GPTQ_CASES))
def test_gptq_checkpoint_greedy_equals_hf_on_its_dequantized_weights(sources, tmp_path, case):
    quantized = write_gptq(sources["llama"], tmp_path / "gptq", **GPTQ_CASES[case])
    prompts = random_prompts(3, 3, 20, seed=6, vocab=256)
    reference = hf_on_dequantized(sources["llama"], quantized)
    want = [hf_greedy(reference, prompt, 10) for prompt in prompts]
    assert engine_tokens(tmp_path / "gptq", prompts) == want


def test_gptq_dynamic_rules_give_modules_their_own_bits_or_none(sources, tmp_path):
    """GPTQModel's ``dynamic``: the first matching rule wins; ``-:`` keeps layer 1's MLP in
    the model's dtype, ``+:`` makes layer 0's attention 8-bit in groups of 32 without
    act-order, the rest keeps the base 4-bit act-order scheme in groups of 64."""
    dynamic = {r"-:model\.layers\.1\.mlp\..*": {},
               r"+:model\.layers\.0\.self_attn\..*": {"bits": 8, "group_size": 32,
                                                         "desc_act": False},
               r"model\.layers\.1\..*": {"sym": False}}
    quantized = write_gptq(sources["llama"], tmp_path / "gptq", bits=4, group_size=64,
                           desc_act=True, dynamic=dynamic)
    assert "model.layers.1.mlp.up_proj" not in quantized
    llm = LLM(str(tmp_path / "gptq"), dtype="float32", block_size=8, max_model_len=128,
              device="cpu")
    layers = runner_model(llm).model.layers
    assert layers[1].mlp.gate_up_proj.int_scheme is None
    assert layers[1].mlp.gate_up_proj.weight.dtype == torch.float32
    first, second = layers[0].self_attn.qkv_proj, layers[1].self_attn.qkv_proj
    assert (first.int_scheme.bits, first.int_scheme.group_size, first.act_perm) == (8, 32, None)
    assert (second.int_scheme.bits, second.int_scheme.group_size) == (4, 64)
    assert not second.int_scheme.symmetric and second.act_perm is not None
    prompts = random_prompts(3, 3, 20, seed=10, vocab=256)
    reference = hf_on_dequantized(sources["llama"], quantized)
    assert engine_greedy(llm, prompts, 10) == [hf_greedy(reference, p, 10) for p in prompts]


def test_gptq_checkpoint_with_qkv_biases(sources, tmp_path):
    """Qwen2's q/k/v biases stay in the model's dtype beside the packed weights."""
    quantized = write_gptq(sources["qwen2"], tmp_path / "gptq", bits=4, group_size=64,
                           desc_act=True)
    prompts = random_prompts(3, 3, 20, seed=7, vocab=256)
    reference = hf_on_dequantized(sources["qwen2"], quantized)
    assert engine_tokens(tmp_path / "gptq", prompts) == [
        hf_greedy(reference, prompt, 10) for prompt in prompts]


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_act_order_checkpoint_greedy_equals_hf(sources, tmp_path, symmetric):
    """``weight_g_idx`` (``actorder: group``) and packed zero points, written by
    compressed-tensors' own packer."""
    pytest.importorskip("compressed_tensors")
    from tests.quantization.int_checkpoints import write_compressed_tensors

    quantized = write_compressed_tensors(sources["llama"], tmp_path / "ct", group_size=32,
                                         symmetric=symmetric)
    prompts = random_prompts(3, 3, 20, seed=9, vocab=256)
    reference = hf_on_dequantized(sources["llama"], quantized)
    assert engine_tokens(tmp_path / "ct", prompts) == [
        hf_greedy(reference, prompt, 10) for prompt in prompts]


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_checkpoint_greedy_equals_hf_on_its_dequantized_weights(sources, tmp_path,
                                                                    group_size):
    quantized = write_awq(sources["llama"], tmp_path / "awq", group_size=group_size)
    prompts = random_prompts(3, 3, 20, seed=8, vocab=256)
    reference = hf_on_dequantized(sources["llama"], quantized)
    assert engine_tokens(tmp_path / "awq", prompts, quantization="awq") == [
        hf_greedy(reference, prompt, 10) for prompt in prompts]


def test_packed_weights_are_kept_packed_and_the_lm_head_in_the_model_dtype(sources, tmp_path):
    """4-bit weights stay packed (a quarter of the bytes of the float16 weights they
    replace, eight values per int32); the fused qkv holds q, k and v as row blocks; the
    embedding and the LM head stay float32."""
    quantized = write_gptq(sources["llama"], tmp_path / "gptq", bits=4, group_size=32)
    llm = LLM(str(tmp_path / "gptq"), dtype="float32", max_model_len=128, device="cpu")
    model = runner_model(llm)
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.weight is None and qkv.qweight.dtype == torch.int32
    assert qkv.qweight.shape == (128 + 64 + 64, 128 // 8)
    prefix = "model.layers.1.self_attn"
    codes = torch.cat([quantized[f"{prefix}.{p}_proj"].codes for p in "qkv"])
    # The stored slots of a word's eight values: 0 2 4 6 1 3 5 7 (int_weights.stored_slots).
    slots = (qkv.qweight.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF
    unpacked = slots[..., [0, 4, 1, 5, 2, 6, 3, 7]]
    assert torch.equal(unpacked.reshape(256, 128).long(), codes)
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_weight_memory_is_reported_at_start_up(sources, tmp_path, caplog):
    write_gptq(sources["llama"], tmp_path / "gptq", bits=4, group_size=32)
    with caplog.at_level("INFO", logger="pagedllm.models.loader"):
        llm = LLM(str(tmp_path / "gptq"), dtype="float32", max_model_len=128, device="cpu")
    model = runner_model(llm)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert f"Model weights: {held / 2**20:.2f} MiB (float32, gptq projections)" in caplog.text


def test_weight_bytes_counts_packed_weights_as_the_engine_stores_them(sources):
    """``pagedllm doctor`` and ``plan`` size the KV cache from ``weight_bytes``: for a 4-bit
    model it must count what the loaded model holds, to the byte."""
    for method, group_size in (("gptq", 128), ("awq", 128)):
        llm = LLM(str(sources["llama"]), load_format="dummy", quantization=method,
                  dtype="float32", max_model_len=128, device="cpu")
        model = runner_model(llm)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        config = llm.llm_engine.config.model_config
        assert config.quant_config.storage() == ("int4", group_size)
        assert kv_allocator.weight_bytes(config.hf_config, 4, "int4", group_size) == held
    unquantized = json.loads((sources["llama"] / "config.json").read_text())
    assert kv_allocator.weight_bytes(unquantized, 2, "int4", 128) < \
        kv_allocator.weight_bytes(unquantized, 2) / 2


def test_dummy_4bit_weights_are_random_in_the_dummy_range_and_generate(sources):
    llm = LLM(str(sources["llama"]), load_format="dummy", quantization="gptq",
              dtype="float32", max_model_len=128, device="cpu")
    down = runner_model(llm).model.layers[0].mlp.down_proj
    from pagedllm.quantization.int_weights import dequantize

    weight = dequantize(down.qweight, down.scales, down.zeros, 4, 128, 256, torch.float32)
    assert weight.abs().max() <= 1e-3 and weight.std() > 3e-4
    assert len(engine_greedy(llm, [[5, 6, 7]], 4)[0]) == 4


@pytest.mark.parametrize("writer, edit, message", [
    ("awq", lambda q: q.update(version="gemv"), "version='gemv' is not supported"),
    ("awq", lambda q: q.update(version="exllama"), "version='exllama' is not supported"),
    ("awq", lambda q: q.update(bits=3), "bits=3 is not supported"),
    ("gptq", lambda q: q.update(bits=3), "bits=3 is not supported"),
    ("gptq", lambda q: q.update(checkpoint_format="marlin"), "checkpoint_format='marlin'"),
    ("gptq", lambda q: q.update(lm_head=True), "lm_head=true"),
    ("gptq", lambda q: q.update(group_size=0), "group_size=0"),
    ("gptq", lambda q: q.update(dynamic={r"+:.*\.mlp\..*": {"pack_dtype": "int64"}}),
     r"dynamic rule .* overrides \['pack_dtype'\], which pagedllm does not read"),
    ("gptq", lambda q: q.update(dynamic={r".*": {"bits": 2}}), r"dynamic\['\.\*'\]\.bits=2"),
    ("gptq", lambda q: q.update(dynamic={"-:(": {}}), r"rule '-:\(' is not a valid regex"),
])
def test_an_unsupported_variant_is_refused_naming_the_field(sources, tmp_path, writer, edit,
                                                            message):
    write = write_awq if writer == "awq" else write_gptq
    write(sources["llama"], tmp_path / "written", group_size=64)
    model_dir = with_quantization_config(tmp_path / "written", tmp_path / "edited", edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), device="cpu")


def test_compressed_tensors_integer_activations_are_refused_by_name(sources, tmp_path):
    """An int8 (asymmetric) activation scheme over 4-bit weights: W4A8 is not read."""
    write_gptq(sources["llama"], tmp_path / "written", group_size=64)
    config = json.loads((tmp_path / "written" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64,
                        "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                  "symmetric": False, "dynamic": True}}}}
    (tmp_path / "written" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"group_0\.input_activations are 8-bit 'int' "
                                         r"\(symmetric=False\)"):
        LLM(str(tmp_path / "written"), device="cpu")


def test_vllm_kernel_names_read_their_formats_checkpoints(sources, tmp_path):
    """``--quantization gptq_marlin`` / ``awq_marlin`` / ``moe_wna16``, as vLLM deployments
    pass them: the same checkpoints as gptq / awq, the same tokens."""
    write_gptq(sources["llama"], tmp_path / "gptq", group_size=64)
    write_awq(sources["llama"], tmp_path / "awq", group_size=64)
    prompts = random_prompts(2, 3, 20, seed=12, vocab=256)
    for path, alias in ((tmp_path / "gptq", "gptq_marlin"), (tmp_path / "awq", "awq_marlin")):
        assert engine_tokens(path, prompts, quantization=alias) == engine_tokens(path, prompts)
    with pytest.raises(ValueError, match="--quantization awq contradicts.*'gptq'"):
        LLM(str(tmp_path / "gptq"), quantization="awq_marlin", device="cpu")
    # moe_wna16: vLLM's kernel for experts of any integer-weight method.
    assert engine_tokens(tmp_path / "awq", prompts, quantization="moe_wna16") == \
        engine_tokens(tmp_path / "awq", prompts)
    with pytest.raises(ValueError, match="--quantization moe_wna16 names vLLM.s kernel for "
                                         "integer-weight checkpoints of gptq, awq.*declares no "
                                         "quantization_config"):
        LLM(str(sources["llama"]), quantization="moe_wna16", device="cpu")


def test_a_contradicting_or_formatless_flag_is_refused(sources, tmp_path):
    write_gptq(sources["llama"], tmp_path / "gptq", group_size=64)
    with pytest.raises(ValueError, match="--quantization awq contradicts.*'gptq'"):
        LLM(str(tmp_path / "gptq"), quantization="awq", device="cpu")
    with pytest.raises(ValueError, match="--quantization gptq needs a checkpoint"):
        LLM(str(sources["llama"]), quantization="gptq", device="cpu")


def test_fused_shards_with_different_act_orders_are_refused(sources, tmp_path):
    """q, k and v read one input, so one input order; a checkpoint whose k_proj was
    ordered differently cannot be fused."""
    write_gptq(sources["llama"], tmp_path / "gptq", group_size=32, desc_act=True)
    from safetensors.torch import save_file

    tensors = read_tensors(tmp_path / "gptq")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(tmp_path / "gptq" / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj: .*different g_idx"):
        LLM(str(tmp_path / "gptq"), device="cpu")


@pytest.mark.parametrize("writer, file, fields", [
    ("gptq", "quantize_config.json",
     lambda q: {k: v for k, v in q.items() if k != "quant_method"}),
    ("awq", "quant_config.json", lambda q: {"zero_point": True, "q_group_size": q["group_size"],
                                             "w_bit": 4, "version": "GEMM"}),
])
def test_an_older_exports_quantization_file_stands_for_quantization_config(sources, tmp_path,
                                                                          writer, file, fields):
    """AutoGPTQ's ``quantize_config.json`` and AutoAWQ's ``quant_config.json`` (with their
    own field names), beside a config.json without ``quantization_config``."""
    write = write_awq if writer == "awq" else write_gptq
    write(sources["llama"], tmp_path / "new", group_size=64)
    old = tmp_path / "old"
    old.mkdir()
    for path in (tmp_path / "new").iterdir():
        (old / path.name).write_bytes(path.read_bytes())
    config = json.loads((old / "config.json").read_text())
    (old / file).write_text(json.dumps(fields(config.pop("quantization_config"))))
    (old / "config.json").write_text(json.dumps(config))
    prompts = random_prompts(2, 3, 20, seed=22, vocab=256)
    llm = LLM(str(old), dtype="float32", block_size=8, max_model_len=128, device="cpu")
    assert llm.llm_engine.config.model_config.quantization == writer
    assert engine_greedy(llm, prompts, 10) == engine_tokens(tmp_path / "new", prompts)


@pytest.mark.parametrize("family, overrides", [
    ("gemma2", dict(attn_logit_softcapping=3.0, final_logit_softcapping=5.0, sliding_window=6)),
    ("gemma3", dict(sliding_window=5)),
    ("mistral", dict(sliding_window=8)),
])
def test_gptq_checkpoints_of_other_families_greedy_equal_hf(tmp_path, family, overrides):
    """Gemma 2's soft caps and (1 + weight) norms, Gemma 3's q/k norms, Mistral's window:
    4-bit projections in each, against HF on the same dequantized weights (eager attention,
    the one HF implementation that soft-caps scores)."""
    src = make_tiny_checkpoint(tmp_path, family, **TINY, **overrides)
    quantized = write_gptq(src, tmp_path / "gptq", bits=4, group_size=32)
    reference = hf_on_dequantized(src, quantized)
    reference.set_attn_implementation("eager")
    prompts = random_prompts(3, 3, 20, seed=14, vocab=256)
    want = [hf_greedy(reference, prompt, 10) for prompt in prompts]
    assert engine_tokens(tmp_path / "gptq", prompts) == want


HOPPER = torch.cuda.is_available() and int_matmul.is_hopper(torch.device("cuda"))
# nats: bfloat16 activations against float32 ones
BF16_TIE = 0.1


def _wgmma_engine(sources, tmp_path, monkeypatch, max_num_seqs: int):
    """A 4-bit act-order GPTQ checkpoint served in bfloat16 on the GPU, HF on its
    dequantized weights, and the row counts of every ``int4_wgmma`` launch from then on."""
    quantized = write_gptq(sources["llama"], tmp_path / "gptq", bits=4, group_size=64,
                           desc_act=True)
    reference = hf_on_dequantized(sources["llama"], quantized)
    rows = []
    real = int_matmul.int4_wgmma
    monkeypatch.setattr(int_matmul, "int4_wgmma",
                        lambda x, *a, **kw: rows.append(x.shape[0]) or real(x, *a, **kw))
    llm = LLM(str(tmp_path / "gptq"), dtype="bfloat16", block_size=16, max_model_len=128,
              max_num_seqs=max_num_seqs, device="cuda")
    return llm, reference, rows


def _assert_decodes_pick_hfs_tokens(llm, reference, prompts) -> None:
    """Six greedy tokens of every prompt at once: each HF's most likely on the dequantized
    weights, or within ``BF16_TIE`` of it."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        tokens = list(output.outputs[0].token_ids)
        logprobs = full_pass_logprobs(reference, prompt, tokens)
        for step, token in enumerate(tokens):
            assert logprobs[step].max() - logprobs[step, token] <= BF16_TIE, (prompt, tokens,
                                                                               step)


@pytest.mark.skipif(not HOPPER, reason="the 4-bit wgmma kernel runs on Hopper GPUs")
@pytest.mark.parametrize("sequences, batch_rows", [(1, range(1, 2)), (3, range(2, 9)),
                                                  (12, range(9, 17))])
def test_hopper_4bit_decode_of_1_to_16_sequences_on_the_wgmma_kernel_picks_hfs_tokens(
        sources, tmp_path, monkeypatch, sequences, batch_rows):
    """Decode batches of 1 to 16 sequences take the wgmma kernel with ``K`` split (not the
    small-batch product, nor its norm and SiLU), and pick HF's tokens
    (``_assert_decodes_pick_hfs_tokens``)."""
    llm, reference, rows = _wgmma_engine(sources, tmp_path, monkeypatch, max_num_seqs=16)
    _assert_decodes_pick_hfs_tokens(llm, reference, random_prompts(sequences, 4, 12, seed=21,
                                                                   vocab=256))
    assert any(r in batch_rows for r in rows), rows  # the decode batches, graphed or not


@pytest.mark.skipif(not HOPPER, reason="the 4-bit wgmma kernel runs on Hopper GPUs")
def test_hopper_4bit_steps_of_65_to_256_rows_pick_hfs_tokens(sources, tmp_path, monkeypatch):
    """In bfloat16 on a Hopper GPU, a 4-bit act-order GPTQ checkpoint's prompt of 100 tokens
    and its decode batches of 80 sequences run on the wgmma kernel, and every token the
    engine picks is HF's most likely on the same dequantized weights in float32, or a near
    tie of it (bfloat16's rounding)."""
    llm, reference, rows = _wgmma_engine(sources, tmp_path, monkeypatch, max_num_seqs=96)
    prompt = random_prompts(1, 90, 91, seed=11, vocab=256)[0]
    want = hf_greedy(reference, prompt, 10)
    assert_engine_picks(llm, prompt, want, full_pass_logprobs(reference, prompt, want),
                        BF16_TIE)
    _assert_decodes_pick_hfs_tokens(llm, reference, random_prompts(80, 4, 12, seed=12,
                                                                   vocab=256))
    # The prompt step and the decode batches, run as captured or not (a replayed graph
    # calls no Python: its launches are the capture's).
    assert any(65 <= r <= 128 for r in rows), rows
