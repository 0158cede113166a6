"""bitsandbytes 4-bit checkpoints, made by the tools operators use: transformers loads a tiny
model with ``BitsAndBytesConfig(load_in_4bit=True)`` (bitsandbytes quantizes it, on the
CPU) and ``save_pretrained`` writes it. pagedllm detects them from config.json and runs to
the greedy tokens of HF transformers on the weights bitsandbytes' own ``dequantize_4bit``
makes of the same file, in float32; and ``--quantization bitsandbytes`` of an unquantized
checkpoint gives the codes bitsandbytes gives."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from pagedllm import LLM
from pagedllm.quantization import bitsandbytes as bnb_format
from tests.engine.conftest import hf_greedy, random_prompts
from tests.quantization.int_checkpoints import _write, hf_on_dequantized, read_tensors
from tests.quantization.checkpoint_runs import engine_greedy, runner_model, with_quantization_config
from tests.utils import make_tiny_checkpoint

bnb = pytest.importorskip("bitsandbytes")

TINY = dict(vocab_size=256, max_position_embeddings=128, hidden_size=128,
            intermediate_size=256)


def write_bnb(src: Path, out: Path, quant_type: str = "nf4", double_quant: bool = True,
              **config) -> Path:
    """``src`` quantized by bitsandbytes as transformers loads it, saved to ``out``."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                      bnb_4bit_use_double_quant=double_quant,
                                      bnb_4bit_compute_dtype=torch.float32, **config)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=quantization,
                                                 device_map="cpu", dtype=torch.float32)
    model.save_pretrained(out)
    return out


def hf_dequantized(model_dir: Path):
    """transformers' model of a bitsandbytes checkpoint, each 4-bit layer replaced
    (``hf_dequantized_model``)."""
    from transformers import AutoModelForCausalLM

    return hf_dequantized_model(AutoModelForCausalLM.from_pretrained(
        model_dir, device_map="cpu", dtype=torch.float32))


def bnb_dequantized(packed: torch.Tensor, state) -> torch.Tensor:
    """bitsandbytes' dequantization of a 4-bit weight, in its portable (torch) form, which
    its CUDA kernels match: blocks over the flattened weight. (Its CPU kernel takes the
    blocks per row, so it does not invert its own quantization where a row's length is not
    a multiple of the block: 2.7 against 0.52 largest round-trip error on 256 x 352 normal
    weights.)"""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    absmax = state.absmax
    if state.nested:
        absmax = bnb.functional.dequantize_blockwise(absmax, state.state2) + state.offset
    return _dequantize_4bit_compute(packed.view(torch.uint8).reshape(-1), absmax.float(),
                                    state.code, state.blocksize, state.shape, torch.float32)


def hf_dequantized_model(model):
    """``model`` with each bitsandbytes 4-bit layer replaced by a float32 ``Linear`` holding
    bitsandbytes' own dequantization of its weight (``bnb_dequantized``)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, bnb.nn.Linear4bit):
            plain = torch.nn.Linear(module.in_features, module.out_features,
                                    bias=module.bias is not None)
            plain.weight.data = bnb_dequantized(module.weight.data, module.weight.quant_state)
            if module.bias is not None:
                plain.bias.data = module.bias.data.float()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, plain)
    return model.eval()


def engine_tokens(model_dir: Path, prompts, **kwargs) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", block_size=8, max_model_len=128, device="cpu",
              **kwargs)
    return engine_greedy(llm, prompts, 10)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bnb-sources")
    return {"llama": make_tiny_checkpoint(root, "llama", **TINY),
            "qwen3": make_tiny_checkpoint(root, "qwen3", head_dim=32, **TINY),
            "phi3": make_tiny_checkpoint(root, "phi3", **TINY),
            # down_proj's rows of 352 inputs: bitsandbytes' blocks of 64 span two rows
            "llama-352": make_tiny_checkpoint(root, "llama", **dict(TINY, intermediate_size=352)),
            "qwen3-moe": make_tiny_checkpoint(root, "qwen3_moe", vocab_size=256,
                                              max_position_embeddings=128, hidden_size=128,
                                              head_dim=32, moe_intermediate_size=128)}


CASES = {
    "llama-nf4-double-quant": ("llama", dict(quant_type="nf4", double_quant=True)),
    "llama-fp4": ("llama", dict(quant_type="fp4", double_quant=False)),
    "qwen3-nf4": ("qwen3", dict(quant_type="nf4", double_quant=False)),
    # Phi-3 stores its q/k/v and gate/up fused: the codes and scales are cut into shards
    "phi3-nf4": ("phi3", dict(quant_type="nf4")),
    "llama-352-nf4-blocks-spanning-rows": ("llama-352", dict(quant_type="nf4")),
    # transformers quantizes the attention and leaves the stacked experts in float32
    "qwen3-moe-nf4": ("qwen3-moe", dict(quant_type="nf4")),
    "qwen3-fp4-double-quant": ("qwen3", dict(quant_type="fp4", double_quant=True)),
    # The packed bytes stored as bfloat16 pairs (FSDP's storage), the down projections left
    # in float32 by the skip list.
    "llama-bf16-storage-skip-down": ("llama", dict(
        bnb_4bit_quant_storage=torch.bfloat16, llm_int8_skip_modules=["down_proj", "lm_head"])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bnb_checkpoint_greedy_equals_hf_on_bitsandbytes_dequantized_weights(sources, tmp_path,
                                                                            case):
    family, options = CASES[case]
    model_dir = write_bnb(sources[family], tmp_path / case, **options)
    prompts = random_prompts(3, 3, 20, seed=5, vocab=256)
    reference = hf_dequantized(model_dir)
    want = [hf_greedy(reference, prompt, 10) for prompt in prompts]
    assert engine_tokens(model_dir, prompts) == want


def test_skipped_modules_stay_unquantized_and_4_bits_change_the_tokens(sources, tmp_path):
    """A projection the checkpoint leaves out (``llm_int8_skip_modules``) keeps its float
    weights, and costs their memory; the 4-bit ones change the greedy tokens (so the
    comparisons with HF discriminate)."""
    def held(model_dir: Path) -> tuple[LLM, int]:
        llm = LLM(str(model_dir), dtype="float32", block_size=8, max_model_len=128,
                  device="cpu")
        return llm, sum(p.numel() * p.element_size() for p in runner_model(llm).parameters())

    llm, skipping = held(write_bnb(sources["llama"], tmp_path / "skip",
                                   llm_int8_skip_modules=["down_proj", "lm_head"]))
    _, every = held(write_bnb(sources["llama"], tmp_path / "every"))
    down = runner_model(llm).model.layers[0].mlp.down_proj.weight
    assert down.dtype == torch.float32
    layers = len(runner_model(llm).model.layers)
    assert skipping - every > layers * down.numel() * 3  # float32 rows, not half a byte a weight
    prompts = random_prompts(3, 3, 20, seed=7, vocab=256)
    assert engine_greedy(llm, prompts, 10) != engine_tokens(sources["llama"], prompts)


@pytest.mark.parametrize("shape", [(96, 256), (7, 352)])  # 7 x 352: blocks span rows, and
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the last is shorter
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_quantizing_at_load_gives_bitsandbytes_own_codes_and_scales(shape, dtype, quant_type):
    rows, columns = shape
    weight = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.05).to(dtype)
    weight[5, :64] = 0.0  # an all-zero block
    codes, scales = bnb_format.quantize(weight, quant_type)
    packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, quant_type=quant_type)
    assert torch.equal(codes, bnb_format.codes_of_bytes(packed.view(rows, columns // 2),
                                                        columns))
    assert torch.equal(scales, bnb_format.row_scales(state.absmax, 64, rows, columns))
    assert torch.equal(bnb_format.code_values(quant_type), state.code)


def test_quantization_at_load_equals_transformers_in_flight_4_bits(sources):
    """``--quantization bitsandbytes`` on an unquantized checkpoint: NF4 in blocks of 64,
    the greedy tokens of the model transformers quantizes with bitsandbytes at load (its
    weights dequantized by bitsandbytes)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32)
    in_flight = AutoModelForCausalLM.from_pretrained(
        sources["qwen3"], quantization_config=quantization, device_map="cpu",
        dtype=torch.float32)
    reference = hf_dequantized_model(in_flight)
    prompts = random_prompts(3, 3, 20, seed=8, vocab=256)
    want = [hf_greedy(reference, prompt, 10) for prompt in prompts]
    assert engine_tokens(sources["qwen3"], prompts, quantization="bitsandbytes") == want


def test_dummy_4bit_weights_generate(sources):
    llm = LLM(str(sources["llama"]), quantization="bitsandbytes", load_format="dummy",
              dtype="float32", block_size=8, max_model_len=64, device="cpu")
    qkv = runner_model(llm).model.layers[0].self_attn.qkv_proj
    assert qkv.int_scheme.codebook == "nf4" and qkv.qweight.dtype == torch.int32
    assert len(engine_greedy(llm, [[1, 2, 3]], 5)[0]) == 5


@pytest.mark.parametrize("edit, message", [
    # 4-bit tensors under an 8-bit config
    (dict(load_in_4bit=False, _load_in_4bit=False, load_in_8bit=True, _load_in_8bit=True),
     r"_proj is stored in 4-bit bitsandbytes tensors, but .* says load_in_8bit"),
    (dict(bnb_4bit_quant_type="int4"), "bnb_4bit_quant_type='int4'"),
])
def test_unsupported_bitsandbytes_variants_are_refused_by_name(sources, tmp_path, edit, message):
    model_dir = with_quantization_config(write_bnb(sources["llama"], tmp_path / "bnb"),
                                         tmp_path / "edited", lambda q: q.update(edit))
    with pytest.raises(ValueError, match=message):
        engine_tokens(model_dir, [[1, 2]])


def test_blocks_that_are_not_a_multiple_of_64_are_refused(sources, tmp_path):
    """bitsandbytes allows blocks of 32; the stored layout takes multiples of 64."""
    model_dir = write_bnb(sources["llama"], tmp_path / "bnb", double_quant=False)
    tensors = read_tensors(model_dir)
    name = "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4"
    state = json.loads(bytes(tensors[name].tolist()).decode())
    state["blocksize"] = 32
    tensors[name] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    from safetensors.torch import save_file

    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="blocks of 32"):
        engine_tokens(model_dir, [[1, 2]])


def write_bnb_per_expert(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """``src``'s decoder projections, each expert's included, quantized by bitsandbytes
    (NF4, double quantization) and saved one projection at a time, as transformers saved a
    mixture of experts whose experts were ``Linear`` layers (``experts.N.gate_proj``, ...);
    returns each projection's weight as bitsandbytes dequantizes it."""
    tensors, dequantized = {}, {}
    for name, tensor in read_tensors(src).items():
        module = re.match(r"(.*\.layers\.\d+\..*_proj)\.weight$", name)
        if module is None:
            tensors[name] = tensor
            continue
        packed, state = bnb.functional.quantize_4bit(tensor, blocksize=64, quant_type="nf4",
                                                     compress_statistics=True)
        tensors[name] = packed
        tensors.update({f"{name}.{key}": value
                        for key, value in state.as_dict(packed=True).items()})
        dequantized[module.group(1)] = bnb_dequantized(packed, state)
    _write(src, out, tensors, {"quant_method": "bitsandbytes", "load_in_4bit": True,
                               "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                               "bnb_4bit_compute_dtype": "float32"})
    return dequantized


def test_4bit_experts_of_a_per_expert_checkpoint(sources, tmp_path):
    """Every expert's gate, up and down in 4 bits: greedy tokens of HF's model on the
    weights bitsandbytes dequantizes, the experts kept packed."""
    dequantized = write_bnb_per_expert(sources["qwen3-moe"], tmp_path / "bnb")
    assert any(".experts." in name for name in dequantized)
    prompts = random_prompts(3, 3, 20, seed=9, vocab=256)
    reference = hf_on_dequantized(sources["qwen3-moe"], dequantized)
    want = [hf_greedy(reference, prompt, 10) for prompt in prompts]
    llm = LLM(str(tmp_path / "bnb"), dtype="float32", block_size=8, max_model_len=128,
              device="cpu")
    experts = runner_model(llm).model.layers[0].mlp.experts
    assert experts.int_scheme.codebook == "nf4" and experts.w13.dtype == torch.int32
    assert engine_greedy(llm, prompts, 10) == want


def test_quantizing_experts_at_load_gives_bitsandbytes_own_codes(sources):
    """``--quantization bitsandbytes`` on a mixture of experts: each expert's gate, up and
    down quantized as bitsandbytes quantizes a projection (the greedy tokens of HF's model
    on bitsandbytes' quantize-then-dequantize of every projection)."""
    from transformers import AutoModelForCausalLM

    src = sources["qwen3-moe"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    layers = [name for name, _ in model.named_modules()
              if re.match(r".*\.layers\.\d+\..*_proj$", name)]
    roundtrip = {}
    for name in layers:
        weight = model.get_submodule(name).weight.data
        roundtrip[name] = bnb_dequantized(*bnb.functional.quantize_4bit(
            weight, blocksize=64, quant_type="nf4"))
    for layer, block in enumerate(model.model.layers):
        experts = block.mlp.experts
        for expert in range(experts.gate_up_proj.shape[0]):
            gate, up = experts.gate_up_proj.data[expert].chunk(2)
            prefix = f"model.layers.{layer}.mlp.experts.{expert}"
            for proj, weight in (("gate_proj", gate), ("up_proj", up),
                                 ("down_proj", experts.down_proj.data[expert])):
                roundtrip[f"{prefix}.{proj}"] = bnb_dequantized(*bnb.functional.quantize_4bit(
                    weight.contiguous(), blocksize=64, quant_type="nf4"))
    prompts = random_prompts(3, 3, 20, seed=10, vocab=256)
    reference = hf_on_dequantized(src, roundtrip)
    want = [hf_greedy(reference, prompt, 10) for prompt in prompts]
    llm = LLM(str(src), quantization="bitsandbytes", dtype="float32", block_size=8,
              max_model_len=128, device="cpu")
    assert runner_model(llm).model.layers[1].mlp.experts.int_scheme.codebook == "nf4"
    assert engine_greedy(llm, prompts, 10) == want


def test_a_4bit_checkpoints_shapes_with_dummy_weights_generate(sources, tmp_path):
    """``--load-format dummy`` on a bitsandbytes checkpoint: random codes in its layout."""
    model_dir = write_bnb(sources["qwen3"], tmp_path / "bnb")
    llm = LLM(str(model_dir), load_format="dummy", dtype="float32", block_size=8,
              max_model_len=64, device="cpu")
    qkv = runner_model(llm).model.layers[0].self_attn.qkv_proj
    assert qkv.int_scheme.prequantized and qkv.qweight.unique().numel() > 100
    assert len(engine_greedy(llm, [[1, 2, 3]], 5)[0]) == 5


def test_a_vision_language_checkpoints_text_decoder_in_4_bits(tmp_path):
    """Gemma 3's nested text decoder (``model.language_model.*``, renamed at load): the
    projections bitsandbytes quantized are found under their loaded names, and the text
    logits equal HF's model on bitsandbytes' dequantized weights."""
    from pagedllm.config import ModelConfig
    from pagedllm.layers.attention.backend import set_forward_context
    from pagedllm.models.loader import load_model
    from tests.models.test_gemma3_vision_checkpoint import tiny_gemma3_vision

    tiny_gemma3_vision().save_pretrained(tmp_path / "src")
    model_dir = write_bnb(tmp_path / "src", tmp_path / "bnb")
    ours = load_model(ModelConfig(model=str(model_dir)), "cpu", torch.float32)
    assert ours.model.layers[0].self_attn.qkv_proj.int_scheme.codebook == "nf4"
    prompt = torch.randint(1, 290, (19,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf_dequantized(model_dir)(input_ids=prompt[None]).logits[0]
    with torch.inference_mode(), set_forward_context(None, []):
        got = ours.compute_logits(ours(prompt, torch.arange(len(prompt))))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_vllms_bitsandbytes_load_format_is_taken_with_bitsandbytes_weights(sources, tmp_path):
    """``--load-format bitsandbytes`` (vLLM's guides pass it with ``--quantization
    bitsandbytes``): the same tokens as without it; refused with unquantized weights."""
    model_dir = write_bnb(sources["llama"], tmp_path / "bnb")
    prompts = random_prompts(2, 3, 20, seed=11, vocab=256)
    assert engine_tokens(model_dir, prompts, load_format="bitsandbytes") == engine_tokens(
        model_dir, prompts)
    assert engine_tokens(sources["llama"], prompts, quantization="bitsandbytes",
                         load_format="bitsandbytes") == engine_tokens(
        sources["llama"], prompts, quantization="bitsandbytes")
    with pytest.raises(ValueError, match="--load-format bitsandbytes .* loads bitsandbytes"):
        engine_tokens(sources["llama"], prompts, load_format="bitsandbytes")


def test_weight_bytes_counts_4bit_codes_as_the_engine_stores_them(sources):
    """``pagedllm doctor`` and ``plan`` size the KV cache from ``weight_bytes``: the packed
    codes and float32 block scales of every projection, to the byte."""
    from pagedllm.worker import kv_allocator

    llm = LLM(str(sources["llama"]), quantization="bitsandbytes", dtype="float32",
              max_model_len=128, device="cpu")
    held = sum(p.numel() * p.element_size() for p in runner_model(llm).parameters())
    config = llm.llm_engine.config.model_config
    assert config.quant_config.storage() == ("nf4", 64)
    assert kv_allocator.weight_bytes(config.hf_config, 4, "nf4", 64) == held
