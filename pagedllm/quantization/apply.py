"""Giving a model's projections the quantization its checkpoint or flag asks for."""

from __future__ import annotations

from torch import nn

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.quantization.checkpoint import Int8Scheme, IntWeightScheme, QuantizationConfig


def quantize_model(model: nn.Module, config: QuantizationConfig, when: str) -> int:
    """Apply ``config`` to the projections inside the decoder layers of ``model``; returns
    how many are quantized.

    ``when="before_load"`` gives the projections a quantized checkpoint fills their
    parameters: FP8 weights and scales (``Linear.make_fp8``, ``FusedMoE.make_fp8``), INT8
    W8A8 ones (``Linear.make_int8``, bitsandbytes' 8-bit too) or packed integer weights
    (``make_int``).
    ``when="after_load"`` quantizes the loaded weights of the projections an unquantized
    checkpoint is quantized at load (``quantize_fp8``, ``quantize_int``: bitsandbytes' NF4)
    and sorts act-order integer weights (``finish_int_load``). A projection's checkpoint
    names (q/k/v for a fused qkv, every expert's gate, up and down) pick its scheme; all of
    a layer's experts must take one.
    """
    count = 0
    for module, checkpoint_names in model.projections():
        scheme = config.scheme_for(checkpoint_names)
        if scheme is None:
            continue
        count += 1
        if isinstance(module, FusedMoE):
            _quantize_experts(module, scheme, checkpoint_names[0], when)
        elif isinstance(scheme, IntWeightScheme) and not scheme.prequantized:
            if when == "after_load":
                module.quantize_int(scheme)
        elif isinstance(scheme, IntWeightScheme):
            if when == "before_load":
                module.make_int(scheme)
            else:
                try:
                    module.finish_int_load()
                except ValueError as exc:
                    raise ValueError(f"{checkpoint_names[0]}: {exc}") from exc
        elif isinstance(scheme, Int8Scheme):
            if when == "before_load":
                module.make_int8(static_input=scheme.static_input,
                                 outlier_threshold=scheme.outlier_threshold)
        elif when == "before_load" and scheme.prequantized:
            module.make_fp8(static_input=scheme.static_input, block=scheme.block)
        elif when == "after_load" and not scheme.prequantized:
            module.quantize_fp8()
    if count == 0:
        raise ValueError(f"quantization {config.method!r} found no projection to quantize "
                         "in this model.")
    return count


def _quantize_experts(experts: FusedMoE, scheme, name: str, when: str) -> None:
    try:
        if isinstance(scheme, Int8Scheme) and scheme.outlier_threshold is not None:
            raise ValueError("bitsandbytes 8-bit experts (LLM.int8) are not supported by "
                             "pagedllm: it reads 8-bit attention and dense MLP projections, "
                             "and 4-bit (load_in_4bit) experts.")
        if isinstance(scheme, Int8Scheme):
            if when == "before_load":
                experts.make_int8(static_input=scheme.static_input)
        elif isinstance(scheme, IntWeightScheme) and not scheme.prequantized:
            if when == "after_load":
                experts.quantize_int(scheme)
        elif isinstance(scheme, IntWeightScheme):
            if when == "before_load":
                experts.make_int(scheme)
            else:
                experts.finish_int_load()
        elif when == "before_load" and scheme.prequantized:
            experts.make_fp8(scheme.block, static_input=scheme.static_input)
        elif when == "after_load" and not scheme.prequantized:
            experts.quantize_fp8()
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
