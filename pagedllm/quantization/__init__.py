"""Quantized weights and activations: reading a checkpoint's or the flag's quantization
(``checkpoint``) and one module per format (``fp8``)."""

from pagedllm.quantization.checkpoint import (
    QUANTIZATION_METHODS,
    QuantizationConfig,
    check_quantization,
    resolve_quantization,
)

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "check_quantization",
           "resolve_quantization"]
