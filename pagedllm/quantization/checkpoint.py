"""Which projections of a checkpoint are quantized, and how: read from ``config.json``'s
``quantization_config`` (or from ``--quantization`` for an unquantized checkpoint).

Formats read:

* ``compressed-tensors`` as llm-compressor writes it, FP8 schemes (``format``
  ``float-quantized``): 8-bit float weights with ``weight_scale`` per tensor or per output
  channel, and input activations either dynamic per token or static per tensor
  (``input_scale``). ``config_groups`` map ``targets`` (``"Linear"``, module names, or
  ``re:``-prefixed regexes over the checkpoint's module names) to a scheme; ``ignore``
  names modules left unquantized (same matching).
* The plain ``fp8`` method (``quant_method: "fp8"``): FP8 ``weight`` with ``weight_scale``
  per tensor or per channel, ``activation_scheme`` ``dynamic`` or ``static`` (then an
  ``input_scale`` per projection), ``ignored_layers`` left unquantized.

Anything else (another method, a block-wise or weight-only scheme, integer weights) is
refused at start-up with the field and value in the message. A ``--quantization`` flag
must agree with the checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

# What --quantization takes: on-load FP8 of an unquantized checkpoint, or the method a
# checkpoint declares.
QUANTIZATION_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 W8A8 of one projection: float8_e4m3fn weights with float32 scales.

    The weight scales are read per tensor or per output channel, as the checkpoint's
    ``weight_scale`` shapes say (a per-tensor scale is expanded to the rows: exact).
    ``static_input``: the input is quantized with the checkpoint's per-tensor
    ``input_scale`` (else per token, with a scale computed in the step).
    ``prequantized``: the checkpoint holds FP8 weights (else they are quantized at load).
    """

    static_input: bool = False
    prequantized: bool = True


ON_LOAD_FP8 = Fp8Scheme(static_input=False, prequantized=False)


@dataclass(frozen=True)
class _Group:
    targets: tuple[str, ...]
    scheme: Fp8Scheme


@dataclass(frozen=True)
class QuantizationConfig:
    """The quantization of a model's decoder projections.

    ``method``: the name ``--quantization`` takes for it ("fp8", "compressed-tensors").
    ``scheme_for(checkpoint_names)`` gives a projection's scheme, or None to keep it in the
    model's dtype; the embedding, the LM head and the norms are never quantized.
    """

    method: str
    groups: tuple[_Group, ...]
    ignore: tuple[str, ...] = ()

    def scheme_for(self, checkpoint_names: Iterable[str]) -> Fp8Scheme | None:
        """The scheme of the projection that fuses ``checkpoint_names`` (one name for a
        plain projection; q/k/v or gate/up for a fused one). Raises ValueError when they
        disagree: a fused product needs one scheme."""
        names = list(checkpoint_names)
        schemes = {name: self._scheme_of(name) for name in names}
        if len(set(schemes.values())) > 1:
            listed = ", ".join(f"{n}: {s or 'unquantized'}" for n, s in schemes.items())
            raise ValueError(
                f"The checkpoint's quantization_config gives the projections pagedllm fuses "
                f"into one product different schemes ({listed}); pagedllm needs one scheme "
                "for all of them."
            )
        return schemes[names[0]]

    def _scheme_of(self, name: str) -> Fp8Scheme | None:
        if any(_matches(pattern, name) for pattern in self.ignore):
            return None
        for group in self.groups:
            if any(_matches(target, name) for target in group.targets):
                return group.scheme
        return None


def _matches(pattern: str, module_name: str) -> bool:
    """compressed-tensors' target matching over checkpoint module names: a class name
    (every projection here is a ``Linear``), ``re:REGEX`` (``re.match``), or a name (exact,
    or the end of the name after a dot)."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module_name) is not None
    return module_name == pattern or module_name.endswith("." + pattern)


def check_quantization(method: str | None) -> str | None:
    """The ``--quantization`` value, checked; ValueError naming the ones implemented."""
    if method is None or method in QUANTIZATION_METHODS:
        return method
    raise ValueError(
        f"--quantization {method} (quantization={method!r}) is not supported by pagedllm "
        f"yet: use {' or '.join(QUANTIZATION_METHODS)}, or drop --quantization (the "
        "quantization keyword in Python)."
    )


def resolve_quantization(flag: str | None, hf_config: dict) -> QuantizationConfig | None:
    """The model's quantization from ``--quantization`` and config.json.

    A checkpoint that declares ``quantization_config`` is read as it says (the flag may
    repeat its method, or be absent); an unquantized one is quantized at load when the
    flag asks for fp8. Raises ValueError on a flag that contradicts the checkpoint and on
    a format or scheme pagedllm does not read, naming it.
    """
    flag = check_quantization(flag)
    declared = hf_config.get("quantization_config")
    if declared is None:
        if flag == "compressed-tensors":
            raise ValueError(
                "--quantization compressed-tensors needs a checkpoint written in that format "
                "(config.json has no quantization_config): drop the flag, or use "
                "--quantization fp8 to quantize this checkpoint at load."
            )
        if flag == "fp8":
            return QuantizationConfig("fp8", (_Group(("Linear",), ON_LOAD_FP8),))
        return None
    method = str(declared.get("quant_method", "")).lower()
    if flag is not None and flag != method:
        raise ValueError(
            f"--quantization {flag} contradicts the checkpoint, whose config.json declares "
            f"quantization_config.quant_method={method!r}: drop --quantization (the "
            "checkpoint's own quantization is used)."
        )
    if method == "compressed-tensors":
        return _compressed_tensors(declared)
    if method == "fp8":
        return _plain_fp8(declared)
    raise ValueError(
        f"The checkpoint's quantization_config.quant_method={method!r} is not supported by "
        f"pagedllm yet: it reads {' and '.join(QUANTIZATION_METHODS)} checkpoints. Use an "
        "unquantized or FP8 checkpoint."
    )


def _compressed_tensors(declared: dict) -> QuantizationConfig:
    if declared.get("sparsity_config"):
        raise ValueError(
            "The checkpoint's compressed-tensors quantization_config has a sparsity_config "
            f"({declared['sparsity_config'].get('format', 'sparse')}); pagedllm does not read "
            "sparse checkpoints."
        )
    if declared.get("transform_config"):
        raise ValueError(
            "The checkpoint's compressed-tensors quantization_config has a transform_config "
            "(rotations); pagedllm does not apply transforms."
        )
    groups = []
    for group_name, group in (declared.get("config_groups") or {}).items():
        where = f"quantization_config.config_groups.{group_name}"
        fmt = group.get("format") or declared.get("format")
        if fmt != "float-quantized":
            raise ValueError(
                f"The checkpoint's {where}.format={fmt!r} is not supported by pagedllm: it "
                "reads compressed-tensors 'float-quantized' (FP8) checkpoints."
            )
        groups.append(_Group(tuple(group.get("targets") or ()), _ct_fp8_scheme(group, where)))
    if not groups:
        raise ValueError("The checkpoint's compressed-tensors quantization_config has no "
                         "config_groups: nothing says which projections are quantized.")
    return QuantizationConfig("compressed-tensors", tuple(groups),
                              tuple(declared.get("ignore") or ()))


def _ct_fp8_scheme(group: dict, where: str) -> Fp8Scheme:
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(
            f"The checkpoint's {where}.weights is {weights.get('num_bits')}-bit "
            f"{weights.get('type')!r}; pagedllm reads 8-bit float (FP8) compressed-tensors weights."
        )
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor") or weights.get("dynamic"):
        raise ValueError(
            f"The checkpoint's {where}.weights.strategy={strategy!r} is not supported by "
            "pagedllm: FP8 weights with a scale per tensor or per channel are (not block- "
            "or group-wise)."
        )
    if not weights.get("symmetric", True):
        raise ValueError(f"The checkpoint's {where}.weights.symmetric=false (zero points) is "
                         "not supported by pagedllm for FP8.")
    activations = group.get("input_activations")
    if activations is None:
        raise ValueError(
            f"The checkpoint's {where}.input_activations is null (FP8 weight-only, W8A16); "
            "pagedllm reads FP8 W8A8 checkpoints (dynamic per-token or static per-tensor "
            "activations)."
        )
    if activations.get("type") != "float" or activations.get("num_bits") != 8:
        raise ValueError(f"The checkpoint's {where}.input_activations are "
                         f"{activations.get('num_bits')}-bit {activations.get('type')!r}; "
                         "pagedllm reads FP8 activations.")
    act_strategy = activations.get("strategy")
    if activations.get("dynamic") and act_strategy == "token":
        static = False
    elif not activations.get("dynamic") and act_strategy == "tensor":
        static = True
    else:
        raise ValueError(
            f"The checkpoint's {where}.input_activations (strategy={act_strategy!r}, "
            f"dynamic={activations.get('dynamic')!r}) is not supported by pagedllm: dynamic "
            "per-token or static per-tensor FP8 activations are."
        )
    return Fp8Scheme(static_input=static)


def _plain_fp8(declared: dict) -> QuantizationConfig:
    if declared.get("weight_block_size"):
        raise ValueError(
            f"The checkpoint's quantization_config.weight_block_size="
            f"{declared['weight_block_size']} (block-wise FP8) is not supported by pagedllm: "
            "FP8 weights with a scale per tensor or per channel are."
        )
    activation_scheme = declared.get("activation_scheme", "dynamic")
    if activation_scheme not in ("dynamic", "static"):
        raise ValueError(f"The checkpoint's quantization_config.activation_scheme="
                         f"{activation_scheme!r} is not supported: dynamic or static.")
    scheme = Fp8Scheme(static_input=activation_scheme == "static")
    ignored = tuple(declared.get("ignored_layers") or declared.get("modules_to_not_convert") or ())
    return QuantizationConfig("fp8", (_Group(("Linear",), scheme),), ignored)
