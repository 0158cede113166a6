"""Mixture-of-experts checkpoints with 4- and 8-bit integer experts (GPTQ, AWQ and
compressed-tensors; Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral): detected from
config.json, every expert's packed weights converted at load, and run to the same greedy
tokens as HF transformers with the same dequantized weights, in float32. The routers stay
unquantized, as the tools that make these checkpoints leave them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM
from pagedllm.worker import kv_allocator
from tests.engine.conftest import hf_greedy, random_prompts
from tests.quantization.int_checkpoints import (
    hf_on_dequantized,
    read_tensors,
    write_awq,
    write_compressed_tensors,
    write_gptq,
)
from tests.quantization.checkpoint_runs import engine_greedy, runner_model
from tests.utils import make_tiny_checkpoint

TINY = dict(vocab_size=256, max_position_embeddings=128)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Experts of 64 inputs and 128 intermediate columns (Qwen3-MoE: groups of 32 and 64
    tile both products), of 64 and 48 (Qwen2-MoE: a last group of 16 columns in the down
    projection, and a dense shared expert), Mixtral's (64 and 128, named w1/w3/w2), and a
    Qwen3-MoE of 128 and 128."""
    root = tmp_path_factory.mktemp("int-moe-sources")
    return {"qwen3_moe": make_tiny_checkpoint(root, "qwen3_moe", moe_intermediate_size=128,
                                              **TINY),
            "qwen2_moe": make_tiny_checkpoint(root, "qwen2_moe", **TINY),
            "mixtral": make_tiny_checkpoint(root, "mixtral", **TINY),
            # llm-compressor's W4A16 groups 128 inputs: 128 of them in both products.
            "qwen3_moe_wide": make_tiny_checkpoint(root, "qwen3_moe", hidden_size=128,
                                                   head_dim=32, moe_intermediate_size=128,
                                                   **TINY)}


def engine_tokens(model_dir: Path, prompts, **kwargs) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", block_size=8, max_model_len=128, device="cpu",
              **kwargs)
    return engine_greedy(llm, prompts, 10)


def hf_tokens(src: Path, quantized, prompts) -> list[list[int]]:
    reference = hf_on_dequantized(src, quantized)
    return [hf_greedy(reference, prompt, 10) for prompt in prompts]


GPTQ_CASES = {
    "qwen3_moe-4bit-g32-act-order": ("qwen3_moe", dict(bits=4, group_size=32, desc_act=True)),
    "qwen3_moe-8bit-per-channel-v2": ("qwen3_moe", dict(bits=8, group_size=-1,
                                                        checkpoint_format="gptq_v2")),
    "qwen2_moe-4bit-g32-asym": ("qwen2_moe", dict(bits=4, group_size=32, sym=False)),
    "mixtral-4bit-g64-act-order": ("mixtral", dict(bits=4, group_size=64, desc_act=True)),
}


@pytest.mark.parametrize("case", sorted(GPTQ_CASES))
def test_gptq_experts_greedy_equal_hf_on_their_dequantized_weights(sources, tmp_path, case):
    family, options = GPTQ_CASES[case]
    quantized = write_gptq(sources[family], tmp_path / "gptq", **options)
    prompts = random_prompts(3, 3, 20, seed=11, vocab=256)
    assert engine_tokens(tmp_path / "gptq", prompts) == hf_tokens(sources[family], quantized,
                                                                  prompts)


def test_awq_mixtral_greedy_equals_hf_on_its_dequantized_weights(sources, tmp_path):
    quantized = write_awq(sources["mixtral"], tmp_path / "awq", group_size=32)
    prompts = random_prompts(3, 3, 20, seed=12, vocab=256)
    assert engine_tokens(tmp_path / "awq", prompts, quantization="awq") == hf_tokens(
        sources["mixtral"], quantized, prompts)


def test_compressed_tensors_act_order_experts_greedy_equal_hf(sources, tmp_path):
    """Packed by compressed-tensors' own packer, with zero points and each expert's
    ``weight_g_idx``."""
    pytest.importorskip("compressed_tensors")
    quantized = write_compressed_tensors(sources["qwen3_moe"], tmp_path / "ct", group_size=32,
                                         symmetric=False)
    prompts = random_prompts(3, 3, 20, seed=13, vocab=256)
    assert engine_tokens(tmp_path / "ct", prompts) == hf_tokens(sources["qwen3_moe"],
                                                                quantized, prompts)


def test_llm_compressor_w4a16_experts_greedy_equal_hf_on_its_decompressed_weights(
        sources, tmp_path):
    """llm-compressor's W4A16 of a Qwen3-MoE (every expert quantized, the routers in its
    ignore list), against HF with each expert's weight decompressed by compressed-tensors'
    own unpacking."""
    pytest.importorskip("llmcompressor")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from tests.quantization.int_checkpoints import Quantized
    from tests.quantization.llm_compressor import make_checkpoints

    out = tmp_path / "w4a16"
    make_checkpoints([(sources["qwen3_moe_wide"], out, "W4A16", False)])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"
    tensors = read_tensors(out)
    assert "model.layers.0.mlp.experts.3.down_proj.weight_packed" in tensors
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    quantized = {}
    for name in tensors:
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            shape = torch.Size(tensors[f"{module}.weight_shape"].tolist())
            codes = unpack_from_int32(tensors[name], 4, shape).to(torch.int64) + 8
            scales = tensors[f"{module}.weight_scale"]
            g_idx = torch.arange(shape[1]) // (shape[1] // scales.shape[1])
            quantized[module] = Quantized(codes, torch.full_like(scales, 8, dtype=torch.int64),
                                          scales, g_idx)
    prompts = random_prompts(3, 3, 20, seed=14, vocab=256)
    assert engine_tokens(out, prompts) == hf_tokens(sources["qwen3_moe_wide"], quantized,
                                                    prompts)


def test_experts_stay_packed_with_their_own_input_orders_and_the_router_unquantized(
        sources, tmp_path):
    quantized = write_gptq(sources["qwen3_moe"], tmp_path / "gptq", bits=4, group_size=32,
                           desc_act=True)
    llm = LLM(str(tmp_path / "gptq"), dtype="float32", max_model_len=128, device="cpu")
    block = runner_model(llm).model.layers[1].mlp
    experts = block.experts
    assert block.gate.weight.dtype == torch.float32 and block.gate.int_scheme is None
    assert experts.w13.dtype == torch.int32 and experts.w13.shape == (4, 2 * 128, 64 // 8)
    assert experts.w2.shape == (4, 64, 128 // 8) and experts.w2_scales.shape == (4, 64, 4)
    assert "int4 groups of 32, act-order" in repr(experts)
    # Expert 2's gate/up input order is its checkpoint's g_idx sorted by group.
    g_idx = quantized["model.layers.1.mlp.experts.2.gate_proj"].g_idx
    assert torch.equal(g_idx[experts.w13_perm[2].long()], torch.arange(64) // 32)
    assert not torch.equal(experts.w13_perm[2], experts.w13_perm[3])


def test_weight_bytes_counts_packed_experts_as_the_engine_stores_them(sources):
    """The KV sizing of ``doctor`` and ``plan`` (``weight_bytes``) for 4-bit experts: what
    the loaded model holds, to the byte, the routers unquantized; and the dummy weights
    generate."""
    for family in ("qwen3_moe", "qwen2_moe"):
        for method in ("gptq", "awq"):
            llm = LLM(str(sources[family]), load_format="dummy", quantization=method,
                      dtype="float32", max_model_len=128, device="cpu")
            model = runner_model(llm)
            held = sum(p.numel() * p.element_size() for p in model.parameters())
            config = llm.llm_engine.config.model_config
            assert kv_allocator.weight_bytes(config.hf_config, 4, "int4", 128) == held
            assert len(engine_greedy(llm, [[5, 6, 7]], 4)[0]) == 4
    unquantized = json.loads((sources["qwen3_moe"] / "config.json").read_text())
    assert kv_allocator.weight_bytes(unquantized, 2, "int4", 128) < \
        kv_allocator.weight_bytes(unquantized, 2) / 2


def test_an_experts_gate_and_up_with_different_input_orders_are_refused(sources, tmp_path):
    write_gptq(sources["qwen3_moe"], tmp_path / "gptq", bits=4, group_size=32, desc_act=True)
    tensors = read_tensors(tmp_path / "gptq")
    name = "model.layers.0.mlp.experts.1.up_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(tmp_path / "gptq" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj: "
                                         r"expert 1's gate and up projections hold different"):
        LLM(str(tmp_path / "gptq"), device="cpu")


def test_an_expert_tensor_of_another_format_is_named(sources, tmp_path):
    """An unquantized expert weight in a GPTQ checkpoint has no place: its name and the
    tensors the experts take are in the error."""
    write_gptq(sources["mixtral"], tmp_path / "gptq", bits=4, group_size=32)
    tensors = read_tensors(tmp_path / "gptq")
    prefix = "model.layers.1.block_sparse_moe.experts.2.w3"
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"{prefix}.{suffix}"]
    tensors[f"{prefix}.weight"] = torch.zeros(128, 64)
    save_file(tensors, str(tmp_path / "gptq" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.2\.w3\.weight.*4-bit integers in the gptq "
                                         r"layout.*qweight, scales, qzeros, g_idx"):
        LLM(str(tmp_path / "gptq"), device="cpu")


def test_experts_an_ignore_list_names_as_the_checkpoint_does_stay_unquantized(sources,
                                                                             tmp_path):
    """Mixtral's checkpoints call the sparse block ``block_sparse_moe`` and its experts'
    projections w1/w3/w2: a compressed-tensors ignore list written with those names keeps
    the experts in the model's dtype while the attention is 4-bit."""
    pytest.importorskip("compressed_tensors")
    src = sources["mixtral"]
    quantized = write_compressed_tensors(src, tmp_path / "ct", group_size=32, act_order=False)
    tensors, original = read_tensors(tmp_path / "ct"), read_tensors(src)
    experts = [name for name in quantized if ".experts." in name]
    for module in experts:
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            del tensors[f"{module}.{suffix}"]
        tensors[f"{module}.weight"] = original[f"{module}.weight"]
        del quantized[module]
    save_file(tensors, str(tmp_path / "ct" / "model.safetensors"))
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*block_sparse_moe\\.experts\\..*"]
    (tmp_path / "ct" / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path / "ct"), dtype="float32", block_size=8, max_model_len=128,
              device="cpu")
    layer = runner_model(llm).model.layers[0]
    assert layer.mlp.experts.int_scheme is None and layer.mlp.experts.w13.dtype == torch.float32
    assert layer.self_attn.qkv_proj.int_scheme is not None
    prompts = random_prompts(3, 3, 20, seed=15, vocab=256)
    assert engine_greedy(llm, prompts, 10) == hf_tokens(src, quantized, prompts)


def test_gptq_dynamic_rules_over_experts(sources, tmp_path):
    """A ``dynamic`` rule over all of a layer's experts gives them its scheme (here 8-bit
    in layer 1); one that splits a layer's experts is refused naming both halves, as one
    grouped product takes one scheme."""
    src = sources["qwen3_moe"]
    rules = {r"+:.*layers\.1\.mlp\.experts\..*": {"bits": 8}}
    quantized = write_gptq(src, tmp_path / "gptq", bits=4, group_size=32, dynamic=rules)
    llm = LLM(str(tmp_path / "gptq"), dtype="float32", block_size=8, max_model_len=128,
              device="cpu")
    layers = runner_model(llm).model.layers
    assert [layer.mlp.experts.int_scheme.bits for layer in layers] == [4, 8]
    prompts = random_prompts(3, 3, 20, seed=16, vocab=256)
    assert engine_greedy(llm, prompts, 10) == hf_tokens(src, quantized, prompts)

    split = {r"-:.*layers\.0\.mlp\.experts\.[01]\..*": {}}
    write_gptq(src, tmp_path / "split", bits=4, group_size=32, dynamic=split)
    with pytest.raises(ValueError, match=r"different schemes \(unquantized: model\.layers\.0\."
                                         r"mlp\.experts\.0\.gate_proj, .* and 3 more; "
                                         r"gptq 4-bit, groups of 32: .* and 3 more\)"):
        LLM(str(tmp_path / "split"), device="cpu")
