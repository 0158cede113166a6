"""Pre-quantized FP8 checkpoints: made by llm-compressor (compressed-tensors) or written by
the plain ``fp8`` method's layout, per tensor, per channel or per block, detected from
config.json with no flag, and run to the same greedy tokens as HF transformers on the
dequantized weights with the same quantization of every projection's input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from pagedllm.config import resolve_model_path
from pagedllm.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_blocks,
    dequantize_rows,
    quantize_groups,
    quantize_rows,
)
from tests.engine.conftest import hf_greedy, random_prompts
from tests.quantization.int_checkpoints import read_tensors
from tests.quantization.checkpoint_runs import engine_greedy, runner_model, with_quantization_config
from tests.quantization.llm_compressor import make_checkpoints
from tests.utils import make_tiny_checkpoint

pytest.importorskip("llmcompressor")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """llm-compressor's FP8 checkpoints of a tiny llama and qwen3 and of the demo model."""
    root = tmp_path_factory.mktemp("fp8-checkpoints")
    llama = make_tiny_checkpoint(root, "llama", vocab_size=256, max_position_embeddings=128)
    qwen3 = make_tiny_checkpoint(root, "qwen3", vocab_size=256, max_position_embeddings=128)
    demo = resolve_model_path("pagedllm-demo")
    # Projections of whole 128 x 128 blocks (FP8_BLOCK's), fused shards starting on one.
    wide = make_tiny_checkpoint(root, "llama", vocab_size=256, max_position_embeddings=128,
                                hidden_size=256, intermediate_size=384)
    moe = make_tiny_checkpoint(root, "qwen3_moe", vocab_size=256, max_position_embeddings=128)
    wide_moe = make_tiny_checkpoint(root, "qwen3_moe", vocab_size=256, max_position_embeddings=128,
                                    hidden_size=256, head_dim=64, moe_intermediate_size=128)
    jobs = {
        "llama-block": (wide, "FP8_BLOCK", False),
        "qwen3-moe-dynamic": (moe, "FP8_DYNAMIC", False),
        "qwen3-moe-static": (moe, "FP8", False),
        "qwen3-moe-block": (wide_moe, "FP8_BLOCK", False),
        "llama-dynamic": (llama, "FP8_DYNAMIC", False),
        "qwen3-dynamic": (qwen3, "FP8_DYNAMIC", False),
        "llama-static": (llama, "FP8", False),
        "llama-static-kv": (llama, "FP8", True),
        "demo-dynamic": (demo, "FP8_DYNAMIC", False),
    }
    make_checkpoints([(src, root / name, scheme, kv) for name, (src, scheme, kv) in jobs.items()])
    checkpoints = {name: root / name for name in jobs}
    checkpoints.update({"qwen3-moe-source": moe, "qwen3-moe-wide-source": wide_moe})
    return checkpoints


def quantized_input(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                    group: int | None = None) -> torch.Tensor:
    """``x`` as an FP8 product sees it: quantized per token (or with the static
    ``input_scale``), or per token and group of ``group`` inputs, then dequantized."""
    rows = x.reshape(-1, x.shape[-1])
    if group is not None:
        q, scale = quantize_groups(rows, group)
        return dequantize_blocks(q, scale, (1, group)).reshape(x.shape)
    q, scale = quantize_rows(rows, input_scale)
    return dequantize_rows(q, scale).reshape(x.shape)


def hf_fp8_reference(model_dir: Path, prompts, max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy tokens on the checkpoint through compressed-tensors: the
    weights it decompresses, and each quantized projection's input quantized by its own
    forward pass as the checkpoint says (per token, per token and group, or with the
    projection's static ``input_scale``)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    return [hf_greedy(model, prompt, max_new_tokens) for prompt in prompts]


@pytest.mark.parametrize("name", ["llama-dynamic", "qwen3-dynamic", "llama-static", "llama-block"])
def test_llm_compressor_fp8_checkpoint_greedy_equals_hf(checkpoints, name):
    model_dir = checkpoints[name]
    prompts = random_prompts(4, 3, 20, seed=3, vocab=256)
    llm = LLM(str(model_dir), dtype="float32", block_size=8, max_model_len=128, device="cpu")
    assert llm.llm_engine.config.model_config.quantization == "compressed-tensors"
    assert engine_greedy(llm, prompts, 10) == hf_fp8_reference(model_dir, prompts, 10)


def test_fp8_weights_load_as_stored_with_per_tensor_scales_on_their_rows(checkpoints):
    """The FP8 bytes are used as the checkpoint holds them (no requantization); the fused
    qkv keeps q's, k's and v's own per-tensor scales on their rows, and one input scale."""
    model_dir = checkpoints["llama-static"]
    tensors = read_tensors(model_dir)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, device="cpu")
    attention = runner_model(llm).model.layers[1].self_attn
    qkv = attention.qkv_proj
    prefix = "model.layers.1.self_attn"
    assert qkv.weight.dtype == FP8_DTYPE
    stored = torch.cat([tensors[f"{prefix}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.weight.view(torch.uint8), stored.view(torch.uint8))
    rows = torch.cat([tensors[f"{prefix}.{p}_proj.weight_scale"].expand(
        tensors[f"{prefix}.{p}_proj.weight"].shape[0]) for p in "qkv"])
    assert torch.equal(qkv.weight_scale.flatten(), rows)
    input_scales = [tensors[f"{prefix}.{p}_proj.input_scale"] for p in "qkv"]
    assert torch.equal(qkv.input_scale, torch.stack(input_scales).amax(0))
    assert runner_model(llm).lm_head.weight.dtype == torch.float32  # ignored: lm_head


def test_kv_cache_scales_of_the_checkpoint_reach_each_layers_attention(checkpoints):
    model_dir = checkpoints["llama-static-kv"]
    tensors = read_tensors(model_dir)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, device="cpu")
    for index, layer in enumerate(runner_model(llm).model.layers):
        for which in ("k_scale", "v_scale"):
            stored = tensors[f"model.layers.{index}.self_attn.{which}"]
            assert getattr(layer.self_attn.attn, which) == pytest.approx(float(stored))


def test_demo_model_fp8_checkpoint_runs_as_the_model_quantized_at_load(checkpoints):
    """llm-compressor's FP8_DYNAMIC is the scheme ``--quantization fp8`` applies at load
    (per-channel absmax weight scales, per-token inputs): the demo model's checkpoint,
    loaded with no flag, writes the same text as the original quantized at load."""
    prompts = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    fp8 = LLM(str(checkpoints["demo-dynamic"]), device="cpu")
    on_load = LLM(quantization="fp8", device="cpu")
    got = [o.outputs[0].text for o in fp8.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].text for o in on_load.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(text.strip() for text in got)


def test_a_contradicting_flag_is_refused(checkpoints):
    with pytest.raises(ValueError, match="contradicts the checkpoint.*compressed-tensors"):
        LLM(str(checkpoints["llama-dynamic"]), quantization="fp8", device="cpu")


@pytest.mark.parametrize("edit, message", [
    (lambda q: q.update(quant_method="aqlm"), "quant_method='aqlm' is not"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations=None),
     "input_activations is null"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group"),
     "weights.strategy='group'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int"),
     "4-bit 'int'"),
    (lambda q: q["config_groups"]["group_0"].update(format="marlin-24"),
     "format='marlin-24'"),
    (lambda q: q["config_groups"]["group_0"].update(format="pack-quantized"),
     "weights.type='float' is not supported in a pack-quantized group"),
])
def test_a_scheme_pagedllm_does_not_read_is_refused_by_name(checkpoints, tmp_path, edit, message):
    model_dir = with_quantization_config(checkpoints["llama-dynamic"], tmp_path / "edited", edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), device="cpu")


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]):
    """``weight`` in float8_e4m3fn with one float32 scale per ``block`` (its largest
    magnitude to 448), as DeepSeek-V3's and Qwen3's FP8 checkpoints store them."""
    rows, columns = weight.shape
    scale = torch.empty(-(-rows // block[0]), -(-columns // block[1]))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = tile.abs().amax().float().clamp(min=1e-12) / FP8_MAX
    expanded = dequantize_blocks(torch.ones(rows, columns), scale, block)
    return (weight.float() / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def write_plain_fp8_checkpoint(src: Path, dst: Path, per_channel: bool, static: bool,
                               block: tuple[int, int] | None = None) -> Path:
    """The plain ``fp8`` method's layout (AutoFP8 and vLLM's FP8 export): each decoder
    projection's ``weight`` in float8_e4m3fn with ``weight_scale`` (one value, or one per
    output channel), ``input_scale`` (one value) when static, and
    ``quantization_config: {"quant_method": "fp8", "activation_scheme": ...}``. With
    ``block``, Qwen3's and DeepSeek-V3's: ``weight_scale_inv`` per block and
    ``weight_block_size``."""
    dst.mkdir()
    tensors = read_tensors(src)
    out = {}
    for name, tensor in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            scale_name = name.replace(".weight", ".weight_scale")
            if block is not None:
                quantized, scale = quantize_blocks(tensor, block)
                scale_name += "_inv"
            elif per_channel:
                quantized, scale = quantize_rows(tensor)
            else:
                scale = tensor.abs().amax().float().reshape(()) / FP8_MAX
                quantized = (tensor / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out[name] = quantized
            out[scale_name] = scale
            if static:  # a calibrated-looking scale: a bound on the inputs / 448
                out[name.replace(".weight", ".input_scale")] = torch.tensor([4.0 / FP8_MAX])
        else:
            out[name] = tensor
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8",
                                     "activation_scheme": "static" if static else "dynamic"}
    if block is not None:
        config["quantization_config"].update(fmt="e4m3", weight_block_size=list(block))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def dequantized_hf_reference(fp8_dir: Path, src: Path, prompts, max_new_tokens: int,
                             block: tuple[int, int] | None = None):
    """HF with each projection's weight replaced by its dequantized FP8 weight and its input
    quantized like the checkpoint says: block-wise checkpoints dequantized by transformers'
    own FP8 integration (``FineGrainedFP8Config(dequantize=True)``), the others on the
    unquantized checkpoint by the scales."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    tensors = read_tensors(fp8_dir)
    if block is not None:
        model = AutoModelForCausalLM.from_pretrained(
            fp8_dir, dtype=torch.float32,
            quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.model.layers.named_modules(prefix="model.layers"):
            if f"{name}.weight_scale_inv" in tensors:
                module.register_forward_pre_hook(
                    lambda module, args: (quantized_input(args[0], group=block[1]),))
            elif f"{name}.weight_scale" in tensors:
                scale = tensors[f"{name}.weight_scale"].reshape(-1, 1)
                module.weight.copy_(tensors[f"{name}.weight"].float() * scale)
                input_scale = tensors.get(f"{name}.input_scale")
                module.register_forward_pre_hook(
                    lambda module, args, s=input_scale: (quantized_input(args[0], s),))
    return [hf_greedy(model, prompt, max_new_tokens) for prompt in prompts]


@pytest.mark.parametrize("per_channel, static", [(False, True), (True, False), (False, False)])
def test_plain_fp8_checkpoint_greedy_equals_hf_on_its_dequantized_weights(tmp_path, per_channel,
                                                                          static):
    src = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=128)
    fp8_dir = write_plain_fp8_checkpoint(src, tmp_path / "fp8", per_channel, static)
    prompts = random_prompts(3, 3, 20, seed=4, vocab=256)
    llm = LLM(str(fp8_dir), dtype="float32", block_size=8, max_model_len=128, device="cpu")
    assert llm.llm_engine.config.model_config.quantization == "fp8"
    assert engine_greedy(llm, prompts, 10) == dequantized_hf_reference(fp8_dir, src, prompts, 10)


@pytest.mark.parametrize("family, block, intermediate", [
    ("qwen3", (128, 128), 384),
    ("llama", (32, 64), 320),
])
def test_block_wise_plain_fp8_checkpoint_greedy_equals_hf_on_its_dequantized_weights(
        tmp_path, family, block, intermediate):
    """Qwen3's and DeepSeek-V3's FP8 layout: the stored bytes and block scales are used as
    they are (fused q/k/v and gate/up each keep their own blocks' rows), the inputs
    quantized per token and group of the block's width."""
    src = make_tiny_checkpoint(tmp_path, family, vocab_size=256, max_position_embeddings=128,
                               hidden_size=256, intermediate_size=intermediate, head_dim=64)
    fp8_dir = write_plain_fp8_checkpoint(src, tmp_path / "fp8", False, False, block)
    prompts = random_prompts(3, 3, 20, seed=5, vocab=256)
    llm = LLM(str(fp8_dir), dtype="float32", block_size=8, max_model_len=128, device="cpu")
    qkv = runner_model(llm).model.layers[0].self_attn.qkv_proj
    tensors = read_tensors(fp8_dir)
    prefix = "model.layers.0.self_attn"
    assert qkv.fp8_block == block and qkv.weight.dtype == FP8_DTYPE
    assert torch.equal(qkv.weight_scale, torch.cat(
        [tensors[f"{prefix}.{p}_proj.weight_scale_inv"] for p in "qkv"]))
    assert engine_greedy(llm, prompts, 10) == dequantized_hf_reference(fp8_dir, src, prompts, 10,
                                                                       block)


@pytest.mark.parametrize("declared, message", [
    ({"activation_scheme": "static", "weight_block_size": [128, 128]},
     "static.*weight_block_size"),
    ({"activation_scheme": "dynamic", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
    ({"activation_scheme": "dynamic", "fmt": "e5m2"}, "fmt='e5m2'"),
])
def test_plain_fp8_schemes_pagedllm_does_not_read_are_refused(tmp_path, declared,
                                                                          message):
    src = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=128)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", **declared}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(src), device="cpu")


def test_blocks_that_cut_a_fused_shard_are_refused(tmp_path):
    """up's rows start after gate's 320 (k's after q's 256), inside a block of 96: one
    scale would straddle two projections that pagedllm multiplies as one."""
    src = make_tiny_checkpoint(tmp_path, "llama", vocab_size=256, max_position_embeddings=128,
                               hidden_size=256, intermediate_size=320)
    fp8_dir = write_plain_fp8_checkpoint(src, tmp_path / "fp8", False, False, (96, 128))
    with pytest.raises(ValueError, match=r"shard '(up|k)' starts at row (320|256), inside a block"):
        LLM(str(fp8_dir), device="cpu")


def hf_moe_fp8_reference(fp8_dir: Path, src: Path, prompts, max_new_tokens: int,
                         block: tuple[int, int] | None = None,
                         scale_name: str | None = None):
    """HF's Qwen3-MoE with every quantized projection's weight dequantized from the FP8
    checkpoint (its experts' too, into HF's stacked expert weights) and each product's input
    quantized per token (per token and group with blocks; with static input scales, the
    projection's own, and for the experts the largest of theirs); the routers stay as they
    are. ``scale_name``: the block scales' tensor name (default ``weight_scale_inv``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tensors = read_tensors(fp8_dir)
    group = None if block is None else block[1]

    def dequantized(name: str) -> torch.Tensor:
        if block is not None:
            return dequantize_blocks(tensors[f"{name}.weight"],
                                     tensors[f"{name}.{scale_name or 'weight_scale_inv'}"],
                                     block)
        scale = tensors[f"{name}.weight_scale"].reshape(-1, 1)
        return tensors[f"{name}.weight"].float() * scale

    def static_scale(names: list[str]) -> torch.Tensor | None:
        scales = [tensors[f"{n}.input_scale"] for n in names if f"{n}.input_scale" in tensors]
        return torch.stack(scales).amax(0) if scales else None

    def experts_forward(experts, prefix, hidden_states, top_k_index, top_k_weights):
        names = range(experts.num_experts)
        in13 = static_scale([f"{prefix}.{e}.{p}" for e in names for p in ("gate_proj", "up_proj")])
        in2 = static_scale([f"{prefix}.{e}.down_proj" for e in names])
        out = torch.zeros_like(hidden_states)
        for expert in range(experts.num_experts):
            token_idx, top_k_pos = torch.where(top_k_index == expert)
            if token_idx.numel() == 0:
                continue
            state = quantized_input(hidden_states[token_idx], in13, group)
            gate, up = torch.nn.functional.linear(state, experts.gate_up_proj[expert]).chunk(2, -1)
            hidden = quantized_input(experts.act_fn(gate) * up, in2, group)
            hidden = torch.nn.functional.linear(hidden, experts.down_proj[expert])
            out.index_add_(0, token_idx, hidden * top_k_weights[token_idx, top_k_pos, None])
        return out

    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{index}"
            attention = f"{prefix}.self_attn"
            qkv_scale = static_scale([f"{attention}.{p}_proj" for p in "qkv"])
            for name, module in layer.self_attn.named_children():
                if f"{attention}.{name}.weight" in tensors and name.endswith("_proj"):
                    module.weight.copy_(dequantized(f"{attention}.{name}"))
                    scale = static_scale([f"{attention}.{name}"]) if name == "o_proj" \
                        else qkv_scale
                    module.register_forward_pre_hook(
                        lambda module, args, s=scale: (quantized_input(args[0], s, group),))
            experts = layer.mlp.experts
            for e in range(experts.num_experts):
                name = f"{prefix}.mlp.experts.{e}"
                experts.gate_up_proj[e].copy_(torch.cat(
                    [dequantized(f"{name}.gate_proj"), dequantized(f"{name}.up_proj")]))
                experts.down_proj[e].copy_(dequantized(f"{name}.down_proj"))
            experts.forward = lambda *args, experts=experts, p=f"{prefix}.mlp.experts": (
                experts_forward(experts, p, *args))
    return [hf_greedy(model, prompt, max_new_tokens) for prompt in prompts]


@pytest.mark.parametrize("block", [None, (16, 16)])
def test_mixture_of_experts_fp8_greedy_equals_hf_on_its_dequantized_weights(tmp_path, block):
    """Qwen3-MoE's experts in FP8 from a checkpoint, per channel or per block (its routers
    left unquantized), and per channel at load (``--quantization fp8``): the tokens of HF
    with the dequantized experts and every product's input quantized the same way."""
    src = make_tiny_checkpoint(tmp_path, "qwen3_moe", vocab_size=256, max_position_embeddings=128)
    fp8_dir = write_plain_fp8_checkpoint(src, tmp_path / "fp8", block is None, False, block)
    prompts = random_prompts(3, 3, 20, seed=6, vocab=256)
    llm = LLM(str(fp8_dir), dtype="float32", block_size=8, max_model_len=128, device="cpu")
    layer = runner_model(llm).model.layers[0].mlp
    assert layer.experts.w13.dtype == FP8_DTYPE and layer.gate.weight.dtype == torch.float32
    got = engine_greedy(llm, prompts, 10)
    assert got == hf_moe_fp8_reference(fp8_dir, src, prompts, 10, block)
    if block is None:  # the same per-channel scales as quantizing at load gives
        on_load = LLM(str(src), quantization="fp8", dtype="float32", block_size=8,
                      max_model_len=128, device="cpu")
        assert engine_greedy(on_load, prompts, 10) == got


def test_expert_tensors_the_scheme_does_not_take_are_named(tmp_path):
    """A scale the experts' scheme has no place for, and an expert weight that is not FP8
    in an FP8 checkpoint (it would be cast to FP8 with no scale)."""
    src = make_tiny_checkpoint(tmp_path, "qwen3_moe", vocab_size=256, max_position_embeddings=128)
    fp8_dir = write_plain_fp8_checkpoint(src, tmp_path / "fp8", True, False)
    tensors = read_tensors(fp8_dir)
    extra = dict(tensors, **{"model.layers.0.mlp.experts.1.up_proj.weight_scale_inv":
                             torch.ones(1, 1)})
    save_file(extra, str(fp8_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.1\.up_proj\.weight_scale_inv.*takes weight, "
                                         r"weight_scale\)"):
        LLM(str(fp8_dir), device="cpu")
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    save_file(dict(tensors, **{name: tensors[name].float()}), str(fp8_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.2\.down_proj\.weight.*FP8 \(float8_e4m3fn\)"
                                         r".*got torch\.float32"):
        LLM(str(fp8_dir), device="cpu")


@pytest.mark.parametrize("name, source, block", [
    ("qwen3-moe-dynamic", "qwen3-moe-source", None),
    ("qwen3-moe-static", "qwen3-moe-source", None),
    ("qwen3-moe-block", "qwen3-moe-wide-source", (128, 128)),
])
def test_llm_compressor_fp8_mixture_of_experts_greedy_equals_hf(checkpoints, name, source, block):
    """llm-compressor's FP8 checkpoints of a Qwen3-MoE (per-expert tensors, the routers in
    its ignore list; dynamic, static per-tensor and block-wise) against HF with the same
    dequantized experts and input quantization."""
    prompts = random_prompts(3, 3, 20, seed=8, vocab=256)
    llm = LLM(str(checkpoints[name]), dtype="float32", block_size=8, max_model_len=128,
              device="cpu")
    assert runner_model(llm).model.layers[0].mlp.experts.fp8_block == block
    want = hf_moe_fp8_reference(checkpoints[name], checkpoints[source], prompts, 10, block,
                                scale_name="weight_scale")
    assert engine_greedy(llm, prompts, 10) == want
