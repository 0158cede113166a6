"""Checkpoints made by Intel's AutoRound (``tests/quantization/auto_round.py``): its own
format (``quant_method: auto-round``, symmetric and asymmetric packings, per-layer bits in
``extra_config``) and its GPTQ and AWQ exports (per-layer bits as GPTQ ``dynamic``
rules), of a Llama and of a Qwen3-MoE, packed by the tool operators use. Each runs to the
greedy tokens of HF transformers holding every layer's weight as AutoRound's own
``QuantLinear`` dequantizes it from the ``auto_round`` export of the same rounding, or as
the GPTQ export unpacks by the format's description (asymmetric roundings, and the
mixture's experts); all the packings of one rounding must agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm import LLM
from tests.engine.conftest import hf_greedy, random_prompts
from tests.quantization.checkpoint_runs import engine_greedy, runner_model
from tests.utils import make_tiny_checkpoint

pytest.importorskip("auto_round")

# Layer 0's down projection in 8 bits, layer 1's o_proj left unquantized.
MIXED = {"model.layers.0.mlp.down_proj": {"bits": 8},
         "model.layers.1.self_attn.o_proj": {"bits": 16}}
JOBS = {  # name: (export format, symmetric, layer config)
    "sym-auto_round": ("auto_round", True, {}),
    "sym-auto_gptq": ("auto_gptq", True, {}),
    # Asymmetric, AutoRound's format packs like AWQ by default; GPTQ's packing on request.
    "asym-auto_round": ("auto_round", False, {}),
    "asym-auto_round_gptq_packing": ("auto_round:auto_gptq", False, {}),
    "asym-auto_gptq": ("auto_gptq", False, {}),
    "asym-auto_awq": ("auto_awq", False, {}),
    "mixed-auto_round": ("auto_round", True, MIXED),
    "mixed-auto_gptq": ("auto_gptq", True, MIXED),
    # A Qwen3-MoE: every expert quantized, the routers left as they are.
    "moe-auto_round": ("auto_round", True, {}),
    "moe-auto_gptq": ("auto_gptq", True, {}),
}
# The export each setting's reference weights come from: AutoRound's own dequantization
# (its torch QuantLinear, through transformers) reads symmetric GPTQ packings of dense
# models on the CPU; asymmetric ones need its binary kernels and transformers stacks the
# experts of a mixture, so those references unpack the GPTQ export as the format
# describes (``unpacked_gptq``).
REFERENCE = {"sym": "sym-auto_round", "asym": "asym-auto_gptq", "mixed": "mixed-auto_round",
             "moe": "moe-auto_gptq"}


def unpacked_gptq(model_dir: Path) -> dict[str, torch.Tensor]:
    """``{module: float32 weight}`` of a 4-bit GPTQ checkpoint (zero points stored minus
    one), unpacked bit by bit: input ``k`` of output ``n`` in ``qweight[k // 8, n]`` at bits
    ``4 * (k % 8)``, zero points the same way along the outputs of ``qzeros``."""
    from tests.quantization.int_checkpoints import read_tensors

    tensors = read_tensors(model_dir)
    weights = {}
    for name in tensors:
        if not name.endswith(".qweight"):
            continue
        module = name[: -len(".qweight")]
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        codes = (tensors[name][:, None, :] >> shifts[None, :, None]) & 15  # [K / 8, 8, N]
        codes = codes.reshape(-1, codes.shape[-1])  # [K, N]
        zeros = (tensors[f"{module}.qzeros"][:, :, None] >> shifts) & 15  # [G, N / 8, 8]
        zeros = zeros.reshape(zeros.shape[0], -1) + 1  # [G, N]
        group = torch.arange(codes.shape[0]) // (codes.shape[0] // zeros.shape[0])
        scales = tensors[f"{module}.scales"].float()
        weights[module] = ((codes - zeros[group]).float() * scales[group]).t().contiguous()
    return weights


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from tests.quantization.auto_round import make_checkpoints

    root = tmp_path_factory.mktemp("auto-round")
    src = make_tiny_checkpoint(root, "llama", vocab_size=256, max_position_embeddings=128,
                               hidden_size=128, intermediate_size=256)
    moe = make_tiny_checkpoint(root, "qwen3_moe", vocab_size=256, max_position_embeddings=128,
                               moe_intermediate_size=128)
    make_checkpoints([(moe if name.startswith("moe") else src, root / name, *job)
                      for name, job in JOBS.items()])
    return {"source": src, "moe-source": moe, **{name: root / name for name in JOBS}}


def reference_tokens(source: Path, export: Path, prompts) -> list[list[int]]:
    """HF's model of ``source`` in float32 holding the export's tensors: the ones AutoRound
    left unquantized as it stored them (in bfloat16), and in every layer it quantized the
    weight its ``QuantLinear`` dequantizes (a GPTQ export: ``unpacked_gptq``'s)."""
    from tests.quantization.auto_round import dequantized_weights
    from tests.quantization.int_checkpoints import hf_on_dequantized, read_tensors

    method = json.loads((export / "config.json").read_text())["quantization_config"][
        "quant_method"]
    weights = unpacked_gptq(export) if method == "gptq" else dequantized_weights(export)
    assert weights
    model = hf_on_dequantized(source, weights, read_tensors(export))
    return [hf_greedy(model, prompt, 10) for prompt in prompts]


@pytest.mark.parametrize("name", sorted(JOBS))
def test_auto_round_checkpoints_greedy_equal_hf_on_autorounds_dequantized_weights(
        checkpoints, name):
    settings, export = name.split("-", 1)
    model_dir = checkpoints[name]
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == {"auto_gptq": "gptq", "auto_awq": "awq"}.get(
        export, "auto-round")
    prompts = random_prompts(3, 3, 20, seed=17, vocab=256)
    llm = LLM(str(model_dir), dtype="float32", block_size=8, max_model_len=128, device="cpu")
    if settings == "mixed":
        layers = runner_model(llm).model.layers
        assert layers[0].mlp.down_proj.int_scheme.bits == 8
        assert layers[0].mlp.gate_up_proj.int_scheme.bits == 4
        assert layers[1].self_attn.o_proj.int_scheme is None
    if settings == "moe":
        block = runner_model(llm).model.layers[0].mlp
        assert block.experts.int_scheme.bits == 4 and block.gate.int_scheme is None
    source = checkpoints["moe-source" if settings == "moe" else "source"]
    want = reference_tokens(source, checkpoints[REFERENCE[settings]], prompts)
    assert engine_greedy(llm, prompts, 10) == want


@pytest.mark.parametrize("edit, message", [
    (lambda q: q.update(packing_format="auto_round:llm_compressor"),
     "packing_format='auto_round:llm_compressor' is not supported"),
    (lambda q: q.update(data_type="nv_fp"), r"data_type='nv_fp' is not supported"),
    (lambda q: q.update(act_bits=8), r"act_bits=8 \(quantized activations\)"),
    (lambda q: q.update(bits=3), "bits=3 is not supported"),
    (lambda q: q.update(extra_config={"model.layers.0.mlp.up_proj": {"bits": 2}}),
     r"extra_config\['model\.layers\.0\.mlp\.up_proj'\]\.bits=2"),
])
def test_an_auto_round_variant_pagedllm_does_not_read_is_refused_naming_it(
        checkpoints, tmp_path, edit, message):
    from tests.quantization.checkpoint_runs import with_quantization_config

    model_dir = with_quantization_config(checkpoints["sym-auto_round"], tmp_path / "edited",
                                         edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), device="cpu")
