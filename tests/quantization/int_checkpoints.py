"""GPTQ and AWQ checkpoints written from the formats' published descriptions (and a
compressed-tensors one with act-order, packed by compressed-tensors itself).

AutoGPTQ, GPTQModel and AutoAWQ need CUDA (or pin old torch and transformers) to
quantize, so these tests write their layouts directly, with code of their own: a
round-to-nearest quantization of each decoder projection of an unquantized checkpoint,
packed bit by bit as the formats describe:

* GPTQ: ``qweight [K / P, N]`` int32, input row ``k`` in word ``k // P`` at bits
  ``bits * (k % P)`` (``P = 32 // bits``); ``qzeros [groups, N / P]`` int32 packed the same
  way along the outputs, holding ``zero - 1`` in the historical ``gptq`` checkpoint format
  and ``zero`` in ``gptq_v2``; ``scales [groups, N]`` float16; ``g_idx [K]`` int32, the
  group of each input (act-order, ``desc_act``: the inputs taken in a shuffled order,
  ``group_size`` at a time).
* AWQ (AutoAWQ ``gemm``): ``qweight [K, N / 8]`` int32, output columns ``8c .. 8c + 7``
  in word ``c`` with nibble ``i`` holding column ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``;
  ``qzeros [groups, N / 8]`` in the same order; ``scales [groups, N]`` float16.

``write_gptq`` / ``write_awq`` return the integer codes, zero points, scales and groups of
every projection as well, so a test can build the reference weights ``(q - zero[g]) *
scale[g]`` from them rather than from the packed words.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Projections that read the same input share act-order's g_idx (Mixtral's experts call
# their gate, down and up w1, w2 and w3).
_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
                 "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down",
                 "w1": "gate_up", "w3": "gate_up", "w2": "down",
                 "qkv_proj": "qkv", "gate_up_proj": "gate_up"}  # Phi-3's fused ones
_PROJECTION = re.compile(r".*\.layers\..*\.(\w+_proj|experts\.\d+\.w[123])\.weight$")


@dataclass
class Quantized:
    """One projection: ``codes [N, K]`` unsigned, ``zeros`` and ``scales`` ``[N, groups]``
    (scales as stored, float16), ``g_idx [K]``."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.codes - self.zeros[:, g]).float() * self.scales.float()[:, g]


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def _groups(in_features: int, group_size: int, act_order: bool, seed: int) -> torch.Tensor:
    size = in_features if group_size == -1 else group_size
    if not act_order:
        return torch.arange(in_features, dtype=torch.int32) // size
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // size).to(torch.int32)
    return g_idx


def quantize(weight: torch.Tensor, bits: int, g_idx: torch.Tensor, symmetric: bool) -> Quantized:
    """Round to nearest per group: symmetric (zero ``2**(bits-1)``, scale ``max|w| /
    (2**(bits-1) - 1)``) or min-max asymmetric."""
    maxq = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    rows = weight.shape[0]
    scales = torch.empty(rows, groups)
    zeros = torch.empty(rows, groups, dtype=torch.int64)
    for g in range(groups):
        w = weight[:, g_idx == g].float()
        if symmetric:
            scale = w.abs().amax(1).clamp(min=1e-8) / ((maxq + 1) // 2 - 1)
            zero = torch.full((rows,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            low, high = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
            scale = ((high - low) / maxq).clamp(min=1e-8)
            zero = torch.round(-low / scale).to(torch.int64)
        scales[:, g], zeros[:, g] = scale, zero
    scales = scales.half()
    g = g_idx.long()
    codes = torch.round(weight.float() / scales.float()[:, g]) + zeros[:, g]
    return Quantized(codes.clamp(0, maxq).to(torch.int64), zeros, scales, g_idx)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _pack_gptq_dim0(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values [R, C]`` -> ``[ceil(R / P), C]``: row ``r`` into word row ``r // P``."""
    per_word = 32 // bits
    rows, columns = values.shape
    words = torch.zeros(-(-rows // per_word), columns, dtype=torch.int64)
    for r in range(rows):
        words[r // per_word] |= (values[r].to(torch.int64) & ((1 << bits) - 1)) << (bits * (r % per_word))
    return _to_int32(words)


def _pack_awq_dim1(values: torch.Tensor) -> torch.Tensor:
    """``values [R, C]`` (4-bit) -> ``[R, C / 8]``, AutoAWQ's interleaved order."""
    rows, columns = values.shape
    words = torch.zeros(rows, columns // 8, dtype=torch.int64)
    for c in range(columns // 8):
        for i, column in enumerate(AWQ_PACK_ORDER):
            words[:, c] |= (values[:, 8 * c + column].to(torch.int64) & 0xF) << (4 * i)
    return _to_int32(words)


def _projections(tensors: dict[str, torch.Tensor]):
    for name, tensor in tensors.items():
        if _PROJECTION.match(name):
            yield name[: -len(".weight")], tensor


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quant_config: dict) -> None:
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def _module_settings(module: str, base: dict, dynamic: dict | None) -> dict | None:
    """GPTQModel's ``dynamic`` rules for ``module``, the first that matches (``re.match``):
    None for a ``-:`` rule (left unquantized), else ``base`` with the rule's overrides."""
    for key, overrides in (dynamic or {}).items():
        if re.match(key[2:] if key[:2] in ("-:", "+:") else key, module):
            return None if key.startswith("-:") else {**base, **overrides}
    return base


def _quantized(src: Path, bits: int, group_size: int, act_order: bool, sym: bool, seed: int,
               dynamic: dict | None = None):
    """``src``'s tensors other than the quantized decoder projections, and ``(module,
    weight, Quantized, bits)`` for each quantized projection (``dynamic``: GPTQModel's
    per-module rules over the base settings); projections reading one input (q/k/v,
    gate/up) share one group assignment, as a fused product needs (each expert its own)."""
    tensors = read_tensors(src)
    out = {n: t for n, t in tensors.items() if not _PROJECTION.match(n)}
    shared: dict[tuple, torch.Tensor] = {}
    projections = []
    base = dict(bits=bits, group_size=group_size, desc_act=act_order, sym=sym)
    for module, weight in _projections(tensors):
        settings = _module_settings(module, base, dynamic)
        if settings is None:
            out[f"{module}.weight"] = weight
            continue
        parent, _, proj = module.rpartition(".")
        key = (parent, _SHARED_INPUT[proj], settings["group_size"], settings["desc_act"])
        if key not in shared:
            shared[key] = _groups(weight.shape[1], settings["group_size"],
                                  settings["desc_act"], seed + len(shared))
        projections.append((module, weight, quantize(weight, settings["bits"], shared[key],
                                                     settings["sym"]), settings["bits"]))
    return out, projections


def write_gptq(src: Path, dst: Path, *, bits: int = 4, group_size: int = 128,
               desc_act: bool = False, sym: bool = True, checkpoint_format: str = "gptq",
               seed: int = 0, dynamic: dict | None = None) -> dict[str, Quantized]:
    """``src`` quantized into the GPTQ layout at ``dst`` (``dynamic``: GPTQModel's
    per-module rules, written into the config too); returns each quantized projection's
    ``Quantized``."""
    out, projections = _quantized(src, bits, group_size, desc_act, sym, seed, dynamic)
    result = {}
    for module, _, q, module_bits in projections:
        stored_zeros = q.zeros - 1 if checkpoint_format == "gptq" else q.zeros
        out[f"{module}.qweight"] = _pack_gptq_dim0(q.codes.t(), module_bits)
        out[f"{module}.qzeros"] = _pack_gptq_dim0(stored_zeros, module_bits).t().contiguous()
        out[f"{module}.scales"] = q.scales.t().contiguous()
        out[f"{module}.g_idx"] = q.g_idx.clone()
        result[module] = q
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
              "desc_act": desc_act, "sym": sym, "checkpoint_format": checkpoint_format,
              "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
              "lm_head": False}
    if dynamic:
        config["dynamic"] = dynamic
    _write(src, dst, out, config)
    return result


def write_awq(src: Path, dst: Path, *, group_size: int = 128) -> dict[str, Quantized]:
    """``src`` quantized into AutoAWQ's gemm layout (4-bit, zero points) at ``dst``."""
    out, projections = _quantized(src, 4, group_size, False, False, 0)
    result = {}
    for module, _, q, _ in projections:
        out[f"{module}.qweight"] = _pack_awq_dim1(q.codes.t())
        out[f"{module}.qzeros"] = _pack_awq_dim1(q.zeros.t())
        out[f"{module}.scales"] = q.scales.t().contiguous()
        result[module] = q
    _write(src, dst, out, {"quant_method": "awq", "bits": 4, "group_size": group_size,
                           "zero_point": True, "version": "gemm",
                           "modules_to_not_convert": None})
    return result


def write_compressed_tensors(src: Path, dst: Path, *, group_size: int = 32,
                             symmetric: bool = True, act_order: bool = True,
                             seed: int = 0) -> dict[str, Quantized]:
    """``src`` in compressed-tensors' pack-quantized layout, packed by compressed-tensors'
    own ``pack_to_int32`` (signed values, offset by 8 for packing): ``weight_packed``,
    ``weight_scale``, ``weight_zero_point`` (packed along the outputs) when asymmetric,
    ``weight_shape``, and with ``act_order`` a shuffled ``weight_g_idx`` (``actorder:
    group``, which llm-compressor 0.14 no longer writes but earlier versions did)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out, projections = _quantized(src, 4, group_size, act_order, symmetric, seed)
    result = {}
    for module, weight, q, _ in projections:
        q.scales = q.scales.float()  # compressed-tensors stores scales in the model's dtype
        out[f"{module}.weight_packed"] = pack_to_int32((q.codes - 8).to(torch.int8), 4)
        out[f"{module}.weight_scale"] = q.scales.contiguous()
        out[f"{module}.weight_shape"] = torch.tensor(list(weight.shape))
        if not symmetric:
            out[f"{module}.weight_zero_point"] = pack_to_int32(
                (q.zeros - 8).to(torch.int8), 4, packed_dim=0).contiguous()
        if act_order:
            out[f"{module}.weight_g_idx"] = q.g_idx.clone()
        result[module] = q
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
               "group_size": group_size, "dynamic": False,
               "actorder": "group" if act_order else None}
    _write(src, dst, out, {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "format": "pack-quantized"}}})
    return result


_EXPERT = re.compile(r"(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)$")


def hf_on_dequantized(src: Path, quantized: dict[str, Quantized | torch.Tensor],
                      tensors: dict[str, torch.Tensor] | None = None):
    """HF transformers' model of ``src`` in float32 with each quantized projection's weight
    replaced by its dequantized weight (a ``Quantized``'s, or the tensor given); an
    expert's into its rows of HF's stacked expert weights (``gate_up_proj [E, 2I, H]``:
    gate rows then up rows; ``down_proj``). ``tensors``: checkpoint tensors that replace
    the source's parameters of the same names first (a tool's rounded copies)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in (tensors or {}).items():
            if name in params:
                params[name].copy_(tensor.float())
        for module, q in quantized.items():
            weight = q if isinstance(q, torch.Tensor) else q.dequantized()
            expert = _EXPERT.match(module)
            if expert is None:
                model.get_submodule(module).weight.copy_(weight)
                continue
            experts = model.get_submodule(f"{expert.group(1)}.mlp.experts")
            index, proj = int(expert.group(2)), expert.group(3)
            if proj in ("down_proj", "w2"):
                experts.down_proj[index].copy_(weight)
            else:
                rows = experts.gate_up_proj[index].chunk(2)[proj in ("up_proj", "w3")]
                rows.copy_(weight)
    return model
