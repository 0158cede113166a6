"""Weight (and activation) quantization: one module per format, applied to a loaded model.

``QUANTIZATION_METHODS`` lists what ``--quantization`` takes today.
"""

from __future__ import annotations

QUANTIZATION_METHODS = ("fp8",)


def check_quantization(method: str | None) -> str | None:
    """The method, checked; ValueError naming the ones implemented otherwise."""
    if method is None or method in QUANTIZATION_METHODS:
        return method
    raise ValueError(
        f"--quantization {method} (quantization={method!r}) is not supported by pagedllm "
        f"yet: use {' or '.join(QUANTIZATION_METHODS)}, or drop --quantization (the "
        "quantization keyword in Python)."
    )
