"""Which projections of a checkpoint are quantized, and how: read from ``config.json``'s
``quantization_config`` (or from ``--quantization`` for an unquantized checkpoint).

Formats read:

* ``compressed-tensors`` as llm-compressor writes it, FP8 schemes (``format``
  ``float-quantized``): 8-bit float weights with ``weight_scale`` per tensor or per output
  channel, and input activations either dynamic per token or static per tensor
  (``input_scale``); or block-wise (``FP8_BLOCK``: ``strategy: block`` weights, a scale per
  ``block_structure`` block, inputs dynamic per token and group of the block's width).
  ``config_groups`` map ``targets`` (``"Linear"``, module names, or ``re:``-prefixed
  regexes over the checkpoint's module names) to a scheme; ``ignore`` names modules left
  unquantized (same matching).
* ``compressed-tensors`` INT8 W8A8 (``format`` ``int-quantized``, llm-compressor's
  ``W8A8``): int8 ``weight`` with ``weight_scale`` per channel (or tensor), inputs int8
  per token (dynamic) or per tensor (static ``input_scale``), symmetric
  (``pagedllm.quantization.int8``).
* ``compressed-tensors`` integer weight-only schemes (``format`` ``pack-quantized``,
  llm-compressor's W4A16, W4A16_ASYM and W8A16, from its GPTQ, AWQ or round-to-nearest
  recipes): ``weight_packed``, ``weight_scale`` per group or channel, ``weight_zero_point``
  when asymmetric, ``weight_g_idx`` with ``actorder: group``.
* The plain ``fp8`` method (``quant_method: "fp8"``): FP8 ``weight`` with ``weight_scale``
  per tensor or per channel, ``activation_scheme`` ``dynamic`` or ``static`` (then an
  ``input_scale`` per projection), ``ignored_layers`` left unquantized; or block-wise with
  ``weight_block_size`` ``[rows, columns]`` (Qwen3's and DeepSeek-V3's FP8 checkpoints: a
  ``weight_scale_inv`` per block, a multiplier despite its name; dynamic activations).
* ``gptq`` (AutoGPTQ / GPTQModel): 4- or 8-bit ``qweight``, ``qzeros``, ``scales``,
  ``g_idx``; ``checkpoint_format`` ``gptq`` (zero points stored minus one) or ``gptq_v2``.
  GPTQModel's ``dynamic`` rules, tried in order before the base scheme: a ``-:REGEX`` key
  leaves the modules it matches unquantized, a ``+:REGEX`` (or bare ``REGEX``) key gives
  them the base scheme with its ``bits``, ``group_size``, ``sym`` and ``desc_act``
  replaced by the rule's (``re.match`` over the checkpoint's module names).
* ``awq`` (AutoAWQ's ``gemm`` version): 4-bit ``qweight``, ``qzeros``, ``scales``.
* ``auto-round`` (Intel AutoRound's own format): GPTQ's or AWQ's tensors as its
  ``packing_format`` says, per-layer fields in ``extra_config`` (``_auto_round``).
* ``bitsandbytes`` 4-bit (``load_in_4bit``: NF4 or FP4 codes, a float32 scale per block of
  64 weights or a multiple, double quantization or not) and 8-bit (``load_in_8bit``:
  LLM.int8, int8 weights with a float32 ``SCB`` per output row, inputs of magnitude
  ``llm_int8_threshold`` or more unquantized), as transformers saves a model quantized by
  bitsandbytes; the projections the file holds quantized are quantized
  (``llm_int8_skip_modules``' are not) (``pagedllm.quantization.bitsandbytes``,
  ``pagedllm.quantization.llm_int8``).
* ``modelopt`` (NVIDIA Model Optimizer's FP8 exports, ``quant_algo`` ``FP8``: per-tensor
  weight and static input scales; ``FP8_PER_CHANNEL_PER_TOKEN``: per-channel weight
  scales, dynamic per-token inputs), from config.json or the older
  ``hf_quant_config.json``; ``exclude_modules`` / ``ignore`` are shell-style wildcards.

The integer layouts are described in ``pagedllm.quantization.int_weights``. Anything else
(another method, an FP8 weight-only scheme, integer activations, other
bit widths or kernel-specific layouts) is refused at start-up with the field and value in
the message. A ``--quantization`` flag must agree with the checkpoint; on a checkpoint
with no ``quantization_config`` it quantizes at load (``fp8``, ``bitsandbytes``: NF4) or, with
``--load-format dummy``, gives the layers random weights in that format (``gptq``,
``awq``: 4-bit, groups of 128).
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, replace
from typing import Iterable

# What --quantization takes: on-load FP8 of an unquantized checkpoint, or the method a
# checkpoint declares.
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "awq", "auto-round", "modelopt",
                        "bitsandbytes")
# Other names of those methods: vLLM's names of a kernel for a format pagedllm reads with
# its own kernels (the same checkpoints), and the spellings of AutoRound's.
QUANTIZATION_ALIASES = {"gptq_marlin": "gptq", "gptq_bitblas": "gptq", "awq_marlin": "awq",
                        "auto_round": "auto-round", "intel/auto-round": "auto-round"}
# vLLM's kernel for the experts of integer-weight checkpoints of several methods: the flag
# takes the checkpoint's method when it is one of them.
KERNEL_FLAGS = {"moe_wna16": ("gptq", "awq", "auto-round", "compressed-tensors")}
# AutoRound's integer packings -> the layout (``INT_LAYOUTS``) they store.
AUTO_ROUND_PACKINGS = {"auto_round:auto_gptq": "gptq", "auto_round": "gptq_v2",
                       "auto_round:gptqmodel": "gptq_v2", "auto_round:auto_awq": "awq"}
# Bit widths of integer weights pagedllm reads.
INT_WEIGHT_BITS = (4, 8)
# bitsandbytes' 4-bit codes, and the columns one stored scale covers (its default block).
BNB_QUANT_TYPES = ("nf4", "fp4")
BNB_GROUP = 64


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 W8A8 of one projection: float8_e4m3fn weights with float32 scales.

    The weight scales are read per tensor or per output channel, as the checkpoint's
    ``weight_scale`` shapes say (a per-tensor scale is expanded to the rows: exact).
    ``static_input``: the input is quantized with the checkpoint's per-tensor
    ``input_scale`` (else per token, with a scale computed in the step).
    ``prequantized``: the checkpoint holds FP8 weights (else they are quantized at load).
    ``block``: block-wise weights, ``(rows, columns)`` a scale (``weight_scale`` is then
    ``[cdiv(out, rows), cdiv(in, columns)]``), and each input row quantized per group of
    ``columns`` (dynamic; ``pagedllm.quantization.fp8.fp8_block_linear``).
    """

    static_input: bool = False
    prequantized: bool = True
    block: tuple[int, int] | None = None

    def __str__(self) -> str:
        return ("fp8" + (f" in blocks of {self.block[0]}x{self.block[1]}" if self.block else "")
                + (", static input scales" if self.static_input else "")
                + ("" if self.prequantized else ", quantized at load"))


ON_LOAD_FP8 = Fp8Scheme(static_input=False, prequantized=False)

# Where an integer-weight checkpoint keeps its tensors (``int_weights`` converts each).
INT_LAYOUTS = ("compressed-tensors", "gptq", "gptq_v2", "awq", "bitsandbytes")


@dataclass(frozen=True)
class IntWeightScheme:
    """Integer weight-only quantization of one projection (W4A16, W8A16): activations stay
    in the model's dtype, each weight is ``(q - zero) * scale`` with ``q`` an unsigned
    ``bits``-bit integer, or ``codebook[q] * scale`` when ``codebook`` names one
    (bitsandbytes' ``nf4`` or ``fp4`` code, whose 16 values a checkpoint's ``quant_map``
    repeats; float32 scales, no zero points).

    ``group_size``: input columns sharing one scale and zero point per output row (-1: the
    whole row, per channel). ``symmetric``: every zero point is ``2 ** (bits - 1)``, and
    compressed-tensors stores none. ``act_order``: the checkpoint may assign input columns
    to groups out of order (``g_idx``). ``layout``: how the checkpoint stores the tensors,
    one of ``INT_LAYOUTS``.
    """

    layout: str
    bits: int
    group_size: int
    symmetric: bool = True
    act_order: bool = False
    prequantized: bool = True
    codebook: str | None = None

    def __str__(self) -> str:
        groups = "per channel" if self.group_size == -1 else f"groups of {self.group_size}"
        return (f"{self.layout} {self.codebook or f'{self.bits}-bit'}, {groups}"
                + ("" if self.symmetric else ", zero points")
                + (", act-order" if self.act_order else ""))


@dataclass(frozen=True)
class Int8Scheme:
    """INT8 W8A8 of one projection (``pagedllm.quantization.int8``): int8 weights with a
    float32 scale per output channel; ``static_input``: inputs quantized with the
    checkpoint's per-tensor ``input_scale`` (else per token, in the step).

    ``outlier_threshold`` (not None): bitsandbytes' LLM.int8 instead
    (``pagedllm.quantization.llm_int8``): inputs quantized per token as bitsandbytes does,
    and where the threshold is above 0 a token's inputs of at least that magnitude
    multiplied unquantized."""

    static_input: bool = False
    outlier_threshold: float | None = None

    def __str__(self) -> str:
        if self.outlier_threshold is not None:
            return f"bitsandbytes llm.int8, outlier threshold {self.outlier_threshold:g}"
        return "int8 w8a8" + (", static input scales" if self.static_input else "")


# ``--quantization bitsandbytes`` of an unquantized checkpoint (vLLM's in-flight 4-bit):
# NF4 in blocks of 64, quantized at load.
ON_LOAD_NF4 = IntWeightScheme("bitsandbytes", bits=4, group_size=BNB_GROUP, prequantized=False,
                              codebook="nf4")
# ``--quantization gptq|awq --load-format dummy`` on a checkpoint with no
# quantization_config: random weights in the format's usual shape.
DUMMY_INT_SCHEMES = {
    "gptq": IntWeightScheme("gptq", bits=4, group_size=128, symmetric=True),
    "awq": IntWeightScheme("awq", bits=4, group_size=128, symmetric=False),
}
Scheme = Fp8Scheme | IntWeightScheme | Int8Scheme


@dataclass(frozen=True)
class _Group:
    """Modules matching one of ``targets`` take ``scheme`` (None: left unquantized)."""

    targets: tuple[str, ...]
    scheme: Scheme | None


@dataclass(frozen=True)
class QuantizationConfig:
    """The quantization of a model's decoder projections.

    ``method``: the name ``--quantization`` takes for it (one of ``QUANTIZATION_METHODS``).
    ``scheme_for(checkpoint_names)`` gives a projection's scheme, or None to keep it in the
    model's dtype: modules named in ``ignore`` are not quantized, the others take the scheme
    of the first group with a matching target (none: not quantized). The embedding, the LM
    head and the norms are never quantized.
    """

    method: str
    groups: tuple[_Group, ...]
    ignore: tuple[str, ...] = ()

    def scheme_for(self, checkpoint_names: Iterable[str]) -> Scheme | None:
        """The scheme of the projection that fuses ``checkpoint_names`` (one name for a
        plain projection; q/k/v or gate/up for a fused one). Raises ValueError when they
        disagree: a fused product needs one scheme."""
        names = list(checkpoint_names)
        schemes = {name: self._scheme_of(name) for name in names}
        if len(set(schemes.values())) > 1:
            by_scheme: dict[Scheme | None, list[str]] = {}
            for name, scheme in schemes.items():
                by_scheme.setdefault(scheme, []).append(name)
            listed = "; ".join(
                f"{scheme or 'unquantized'}: {', '.join(held[:3])}"
                + (f" and {len(held) - 3} more" if len(held) > 3 else "")
                for scheme, held in by_scheme.items())
            raise ValueError(
                f"The checkpoint's quantization_config gives the projections pagedllm fuses "
                f"into one product different schemes ({listed}); pagedllm needs one scheme "
                "for all of them."
            )
        return schemes[names[0]]

    def storage(self) -> tuple[str, int]:
        """How the quantized projections are stored, for memory accounting
        (``kv_allocator.weight_bytes``): ``("fp8", -1)`` (FP8 and INT8 W8A8: a byte a
        weight, a float32 scale a channel), or ``("int4", group_size)`` /
        ``("int8", group_size)`` (weight-only), ``("nf4", group_size)`` (bitsandbytes' 4-bit
        codes: float32 scales, no zero points); ``base_scheme`` stands for all."""
        scheme = self.base_scheme
        if isinstance(scheme, IntWeightScheme) and scheme.codebook is not None:
            return "nf4", scheme.group_size
        if isinstance(scheme, IntWeightScheme):
            return f"int{scheme.bits}", scheme.group_size
        return "fp8", -1

    @property
    def base_scheme(self) -> Scheme:
        """The last group's scheme: the checkpoint's base scheme, after any per-module
        rules."""
        return next(g.scheme for g in reversed(self.groups) if g.scheme is not None)

    @property
    def bits(self) -> int:
        """The weights' bits (``base_scheme``'s): 8 for FP8 and INT8 W8A8, bitsandbytes'
        LLM.int8 too, else the integer weights'."""
        scheme = self.base_scheme
        return scheme.bits if isinstance(scheme, IntWeightScheme) else 8

    @property
    def prequantized(self) -> bool:
        """Whether the checkpoint holds the quantized weights (else they are quantized at
        load)."""
        return all(getattr(group.scheme, "prequantized", True) for group in self.groups)

    def _scheme_of(self, name: str) -> Scheme | None:
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
    """The ``--quantization`` value, checked, with vLLM's kernel names read as their
    format's method (``QUANTIZATION_ALIASES``: ``awq_marlin`` is ``awq``); ValueError naming
    the ones implemented."""
    method = QUANTIZATION_ALIASES.get(method, method)
    if method is None or method in QUANTIZATION_METHODS or method in KERNEL_FLAGS:
        return method
    names = ", ".join(QUANTIZATION_METHODS[:-1]) + " or " + QUANTIZATION_METHODS[-1]
    raise ValueError(
        f"--quantization {method} (quantization={method!r}) is not supported by pagedllm "
        f"yet: use {names}, or drop --quantization (the quantization keyword in Python)."
    )


def resolve_quantization(flag: str | None, hf_config: dict,
                         load_format: str = "auto") -> QuantizationConfig | None:
    """The model's quantization from ``--quantization`` and config.json.

    A checkpoint that declares ``quantization_config`` is read as it says (the flag may
    repeat its method, or be absent); an unquantized one is quantized at load when the
    flag asks for fp8, and given random weights in the flag's format with
    ``load_format="dummy"`` (gptq, awq). Raises ValueError on a flag that contradicts the
    checkpoint and on a format or scheme pagedllm does not read, naming it.
    """
    flag = check_quantization(flag)
    if flag in KERNEL_FLAGS:
        config = resolve_quantization(None, hf_config, load_format)
        if config is None or config.method not in KERNEL_FLAGS[flag] or not any(
                isinstance(group.scheme, IntWeightScheme) for group in config.groups):
            declared = config.method if config else "no quantization_config"
            raise ValueError(
                f"--quantization {flag} names vLLM's kernel for integer-weight checkpoints of "
                f"{', '.join(KERNEL_FLAGS[flag])}, and this checkpoint's config.json declares "
                f"{declared}: drop --quantization.")
        return config
    declared = hf_config.get("quantization_config")
    if declared is None:
        if flag == "fp8":
            return QuantizationConfig("fp8", (_Group(("Linear",), ON_LOAD_FP8),))
        if flag == "bitsandbytes":
            return QuantizationConfig("bitsandbytes", (_Group(("Linear",), ON_LOAD_NF4),))
        if flag in DUMMY_INT_SCHEMES and load_format == "dummy":
            return QuantizationConfig(flag, (_Group(("Linear",), DUMMY_INT_SCHEMES[flag]),))
        if flag is not None:
            raise ValueError(
                f"--quantization {flag} needs a checkpoint written in that format (config.json "
                "has no quantization_config): drop the flag, use --quantization fp8 to "
                "quantize this checkpoint at load, or quantize it first (README: Quantized "
                "checkpoints)."
                + (" With --load-format dummy the layers get random weights in that format."
                   if flag in DUMMY_INT_SCHEMES else "")
            )
        return None
    method = str(declared.get("quant_method", "")).lower()
    method = QUANTIZATION_ALIASES.get(method, method)
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
    if method == "gptq":
        return _gptq(declared)
    if method == "auto-round":
        return _auto_round(declared)
    if method == "modelopt":
        return _modelopt(declared)
    if method == "awq":
        return _awq(declared)
    if method == "bitsandbytes":
        return _bitsandbytes(declared)
    raise ValueError(
        f"The checkpoint's quantization_config.quant_method={method!r} is not supported by "
        f"pagedllm yet: it reads {', '.join(QUANTIZATION_METHODS)} checkpoints. Use an "
        "unquantized checkpoint or one of those."
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
        if fmt == "float-quantized":
            scheme = _ct_fp8_scheme(group, where)
        elif fmt == "pack-quantized":
            scheme = _ct_int_scheme(group, where)
        elif fmt == "int-quantized":
            scheme = _ct_int8_scheme(group, where)
        else:
            raise ValueError(
                f"The checkpoint's {where}.format={fmt!r} is not supported by pagedllm: it "
                "reads compressed-tensors 'float-quantized' (FP8), 'int-quantized' (INT8 "
                "W8A8) and 'pack-quantized' (integer weight-only) checkpoints."
            )
        groups.append(_Group(tuple(group.get("targets") or ()), scheme))
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
    if strategy not in ("channel", "tensor", "block") or weights.get("dynamic"):
        raise ValueError(
            f"The checkpoint's {where}.weights.strategy={strategy!r} is not supported by "
            "pagedllm: FP8 weights with a scale per tensor, per channel or per block are "
            "(not group-wise)."
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
    if strategy == "block":
        block = _fp8_block(weights.get("block_structure"), f"{where}.weights.block_structure")
        if not (activations.get("dynamic") and act_strategy == "group"
                and activations.get("group_size") == block[1]):
            raise ValueError(
                f"The checkpoint's {where}.input_activations (strategy={act_strategy!r}, "
                f"group_size={activations.get('group_size')!r}, dynamic="
                f"{activations.get('dynamic')!r}) is not supported by pagedllm with block-wise "
                f"FP8 weights: dynamic groups of the block's {block[1]} columns are."
            )
        return Fp8Scheme(block=block)
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


def _ct_int8_scheme(group: dict, where: str) -> Int8Scheme:
    """compressed-tensors' ``int-quantized`` W8A8: 8-bit symmetric integer weights per
    channel (or tensor) and 8-bit symmetric integer inputs, dynamic per token or static
    per tensor."""
    weights = group.get("weights") or {}
    activations = group.get("input_activations")
    if (weights.get("type"), weights.get("num_bits")) != ("int", 8) or weights.get(
            "strategy") not in ("channel", "tensor") or not weights.get("symmetric", True):
        raise ValueError(
            f"The checkpoint's {where}.weights (type={weights.get('type')!r}, num_bits="
            f"{weights.get('num_bits')!r}, strategy={weights.get('strategy')!r}, symmetric="
            f"{weights.get('symmetric')!r}) is not supported by pagedllm in 'int-quantized': "
            "8-bit symmetric integers per channel or per tensor are.")
    if activations is None:
        raise ValueError(f"The checkpoint's {where}.input_activations is null (INT8 "
                         "weight-only in 'int-quantized'); pagedllm reads INT8 W8A8.")
    kind = (activations.get("type"), activations.get("num_bits"),
            activations.get("symmetric", True))
    static = (activations.get("strategy"), bool(activations.get("dynamic"))) == ("tensor", False)
    dynamic = (activations.get("strategy"), bool(activations.get("dynamic"))) == ("token", True)
    if kind != ("int", 8, True) or not (static or dynamic):
        raise ValueError(
            f"The checkpoint's {where}.input_activations are {activations.get('num_bits')}-bit "
            f"{activations.get('type')!r} (symmetric={activations.get('symmetric')!r}, "
            f"strategy={activations.get('strategy')!r}, dynamic={activations.get('dynamic')!r})"
            "; pagedllm reads symmetric 8-bit integer inputs, dynamic per token or static "
            "per tensor.")
    return Int8Scheme(static_input=static)


def _fp8_block(value, field: str) -> tuple[int, int]:
    """A block-wise FP8 checkpoint's ``[rows, columns]`` a weight scale covers."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"The checkpoint's {field}={value!r} is not supported by pagedllm: "
                         "block-wise FP8 needs [rows, columns], two positive integers.")
    return int(value[0]), int(value[1])


def _plain_fp8(declared: dict) -> QuantizationConfig:
    if declared.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"The checkpoint's quantization_config.fmt={declared['fmt']!r} is not "
                         "supported by pagedllm: it reads e4m3 (float8_e4m3fn) weights.")
    activation_scheme = declared.get("activation_scheme", "dynamic")
    if activation_scheme not in ("dynamic", "static"):
        raise ValueError(f"The checkpoint's quantization_config.activation_scheme="
                         f"{activation_scheme!r} is not supported: dynamic or static.")
    if declared.get("weight_block_size") is not None:
        block = _fp8_block(declared["weight_block_size"], "quantization_config.weight_block_size")
        if activation_scheme != "dynamic":
            raise ValueError("The checkpoint's quantization_config.activation_scheme='static' "
                             "with weight_block_size is not supported by pagedllm: block-wise "
                             "FP8 weights take dynamic activations.")
        scheme = Fp8Scheme(block=block)
    else:
        scheme = Fp8Scheme(static_input=activation_scheme == "static")
    ignored = tuple(declared.get("ignored_layers") or declared.get("modules_to_not_convert") or ())
    return QuantizationConfig("fp8", (_Group(("Linear",), scheme),), ignored)


def _ct_int_scheme(group: dict, where: str) -> IntWeightScheme:
    weights = group.get("weights") or {}
    if weights.get("type") != "int":
        raise ValueError(f"The checkpoint's {where}.weights.type={weights.get('type')!r} is not "
                         "supported in a pack-quantized group: pagedllm reads integer weights.")
    bits = _int_bits(weights.get("num_bits"), f"{where}.weights.num_bits")
    strategy = weights.get("strategy")
    group_size = weights.get("group_size")
    if strategy == "channel":
        group_size = -1
    elif strategy != "group" or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(
            f"The checkpoint's {where}.weights (strategy={strategy!r}, group_size="
            f"{group_size!r}) is not supported by pagedllm: integer weights with a scale per "
            "group or per channel are."
        )
    if weights.get("dynamic"):
        raise ValueError(f"The checkpoint's {where}.weights.dynamic=true is not supported: "
                         "pagedllm reads static integer weights.")
    activations = group.get("input_activations")
    if activations is not None:
        raise ValueError(
            f"The checkpoint's {where}.input_activations are {activations.get('num_bits')}-bit "
            f"{activations.get('type')!r} (symmetric={activations.get('symmetric', True)}); "
            "pagedllm reads integer weight-only checkpoints (W4A16, W8A16), whose "
            "input_activations are null."
        )
    actorder = weights.get("actorder")
    if actorder not in (None, "weight", "static", "group", "dynamic"):
        raise ValueError(f"The checkpoint's {where}.weights.actorder={actorder!r} is not "
                         "supported: null, weight or group.")
    return IntWeightScheme("compressed-tensors", bits=bits, group_size=group_size,
                           symmetric=bool(weights.get("symmetric", True)),
                           act_order=actorder in ("group", "dynamic"))


def _int_bits(bits, field: str) -> int:
    if bits not in INT_WEIGHT_BITS:
        raise ValueError(f"The checkpoint's {field}={bits!r} is not supported by pagedllm: it "
                         f"reads {' or '.join(map(str, INT_WEIGHT_BITS))}-bit integer weights.")
    return bits


def _group_size(value, field: str) -> int:
    if value == -1 or (isinstance(value, int) and value > 0):
        return value
    raise ValueError(f"The checkpoint's {field}={value!r} is not supported: a positive group "
                     "size, or -1 (one group per output channel).")


def _gptq(declared: dict) -> QuantizationConfig:
    """AutoGPTQ's and GPTQModel's ``quantization_config`` (or ``quantize_config.json``)."""
    where = "quantization_config"
    bits = _int_bits(declared.get("bits"), f"{where}.bits")
    group_size = _group_size(declared.get("group_size", 128), f"{where}.group_size")
    layout = str(declared.get("checkpoint_format") or declared.get("format") or "gptq").lower()
    if declared.get("is_marlin_format"):
        layout = "marlin"
    if layout not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"The checkpoint's {where}.checkpoint_format={layout!r} is not supported by "
            "pagedllm: it reads the gptq and gptq_v2 layouts (qweight, qzeros, scales, g_idx), "
            "not kernel-specific repackings (marlin, bitblas, exllama)."
        )
    if declared.get("lm_head"):
        raise ValueError(f"The checkpoint's {where}.lm_head=true (a quantized LM head) is not "
                         "supported: pagedllm keeps the LM head in the model's dtype.")
    scheme = IntWeightScheme(layout, bits=bits, group_size=group_size,
                             symmetric=bool(declared.get("sym", True)),
                             act_order=bool(declared.get("desc_act", False)))
    blocks = declared.get("modules_in_block_to_quantize")
    targets = tuple(name for names in blocks for name in names) if blocks else ("Linear",)
    ignored = tuple(declared.get("modules_to_not_convert") or ())
    rules = _gptq_dynamic(declared.get("dynamic") or {}, scheme, f"{where}.dynamic")
    return QuantizationConfig("gptq", (*rules, _Group(targets, scheme)), ignored)


# GPTQModel's per-module override fields -> IntWeightScheme's.
_DYNAMIC_FIELDS = {"bits": "bits", "group_size": "group_size", "sym": "symmetric",
                   "desc_act": "act_order"}


def _gptq_dynamic(rules: dict, base: IntWeightScheme, where: str) -> list[_Group]:
    """GPTQModel's ``dynamic`` rules as groups tried in order (see the module docstring).
    Raises ValueError naming a rule whose regex does not compile or that overrides a field
    pagedllm does not read."""
    if not isinstance(rules, dict):
        raise ValueError(f"The checkpoint's {where} must map module regexes to overrides, "
                         f"got {type(rules).__name__}.")
    groups = []
    for key, overrides in rules.items():
        negative = key.startswith("-:")
        pattern = key[2:] if key.startswith(("-:", "+:")) else key
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"The checkpoint's {where} rule {key!r} is not a valid regex: "
                             f"{exc}.") from None
        if negative:
            groups.append(_Group((f"re:{pattern}",), None))
            continue
        unknown = sorted(set(overrides or {}) - set(_DYNAMIC_FIELDS))
        if unknown:
            raise ValueError(f"The checkpoint's {where} rule {key!r} overrides {unknown}, "
                             f"which pagedllm does not read: it reads "
                             f"{', '.join(_DYNAMIC_FIELDS)}.")
        fields = {_DYNAMIC_FIELDS[name]: value for name, value in (overrides or {}).items()}
        if "bits" in fields:
            _int_bits(fields["bits"], f"{where}[{key!r}].bits")
        if "group_size" in fields:
            _group_size(fields["group_size"], f"{where}[{key!r}].group_size")
        groups.append(_Group((f"re:{pattern}",), replace(base, **fields)))
    return groups


def _auto_round(declared: dict) -> QuantizationConfig:
    """Intel AutoRound's own format (``quant_method: auto-round``): integer weights packed
    as ``packing_format`` says (``AUTO_ROUND_PACKINGS``: GPTQ's layout with or without the
    stored zero - 1, or AWQ's), ``bits``, ``group_size``, ``sym``; ``extra_config`` gives
    layers (by name, or by a regex) their own fields, ``bits`` 16 leaving them
    unquantized."""
    where = "quantization_config"
    packing = str(declared.get("packing_format") or "auto_round:auto_gptq").lower()
    if packing not in AUTO_ROUND_PACKINGS:
        raise ValueError(
            f"The checkpoint's {where}.packing_format={packing!r} is not supported by "
            f"pagedllm: it reads AutoRound's integer packings {sorted(AUTO_ROUND_PACKINGS)}.")
    fields = {"bits": declared.get("bits"), "group_size": declared.get("group_size", 128),
              "sym": declared.get("sym", True), "data_type": declared.get("data_type", "int"),
              "act_bits": declared.get("act_bits", 16)}
    base = _auto_round_scheme(AUTO_ROUND_PACKINGS[packing], fields, where)
    if base is None:
        raise ValueError(f"The checkpoint's {where}.bits={fields['bits']!r} leaves every "
                         "layer unquantized: drop quantization_config.")
    exact, patterns = [], []
    for name, overrides in (declared.get("extra_config") or {}).items():
        scheme = _auto_round_scheme(base.layout, {**fields, **(overrides or {})},
                                    f"{where}.extra_config[{name!r}]")
        if any(token in name for token in _REGEX_TOKENS):
            patterns.append(_Group((f"re:{name}",), scheme))
        else:
            exact.append(_Group((name,), scheme))
    return QuantizationConfig("auto-round", (*exact, *patterns, _Group(("Linear",), base)))


# Characters that make an AutoRound extra_config key a regex rather than a layer's name.
_REGEX_TOKENS = (".*", "^", "$", "[", "(", "|", "\\", "+", "?")


def _auto_round_scheme(layout: str, fields: dict, where: str) -> IntWeightScheme | None:
    """One AutoRound layer scheme (None: ``bits`` 16 or more, unquantized); ValueError
    naming a data type, activation width or bit width pagedllm does not read."""
    bits = fields["bits"]
    if isinstance(bits, int) and bits >= 16:
        return None
    if str(fields["data_type"]).lower() != "int":
        raise ValueError(f"The checkpoint's {where}.data_type={fields['data_type']!r} is not "
                         "supported by pagedllm: it reads AutoRound's integer weights (int).")
    if fields["act_bits"] is not None and fields["act_bits"] < 16:
        raise ValueError(f"The checkpoint's {where}.act_bits={fields['act_bits']!r} (quantized "
                         "activations) is not supported by pagedllm: it reads weight-only "
                         "schemes (act_bits 16).")
    if layout == "awq" and bits != 4:
        raise ValueError(f"The checkpoint's {where}.bits={bits!r} is not supported in AWQ's "
                         "packing (auto_round:auto_awq): 4 bits.")
    return IntWeightScheme(layout, bits=_int_bits(bits, f"{where}.bits"),
                           group_size=_group_size(fields["group_size"], f"{where}.group_size"),
                           symmetric=bool(fields["sym"]) and layout != "awq")


# ModelOpt's FP8 algorithms pagedllm reads -> whether the input scale is static.
MODELOPT_FP8 = {"FP8": True, "FP8_PER_CHANNEL_PER_TOKEN": False}


def _modelopt(declared: dict) -> QuantizationConfig:
    """NVIDIA Model Optimizer's ``quantization_config`` (``quant_method: modelopt``; the
    older ``hf_quant_config.json`` nests the same fields under ``quantization``)."""
    where = "quantization_config"
    fields = declared.get("quantization") if isinstance(declared.get("quantization"),
                                                        dict) else declared
    algo = str(fields.get("quant_algo") or "").upper()
    if algo not in MODELOPT_FP8:
        raise ValueError(
            f"The checkpoint's {where}.quant_algo={fields.get('quant_algo')!r} is not "
            f"supported by pagedllm: it reads ModelOpt's {' and '.join(MODELOPT_FP8)} "
            "checkpoints.")
    kv_algo = fields.get("kv_cache_quant_algo")
    scheme = fields.get("kv_cache_scheme")
    if isinstance(scheme, dict):
        kv_algo = "FP8" if (scheme.get("type"), scheme.get("num_bits")) == ("float", 8) \
            else f"{scheme.get('type')}{scheme.get('num_bits')}"
    if kv_algo is not None and str(kv_algo).upper() != "FP8":
        raise ValueError(f"The checkpoint's {where} KV-cache quantization {kv_algo!r} is not "
                         "supported by pagedllm: it reads FP8 KV-cache scales.")
    excluded = fields.get("exclude_modules") or fields.get("ignore") or ()
    ignored = tuple(f"re:{fnmatch.translate(p)}" if any(c in p for c in "*?[") else p
                    for p in excluded)
    return QuantizationConfig("modelopt", (_Group(("Linear",), Fp8Scheme(
        static_input=MODELOPT_FP8[algo])),), ignored)


def _bitsandbytes(declared: dict) -> QuantizationConfig:
    """transformers' ``BitsAndBytesConfig`` of a 4-bit checkpoint, or of an 8-bit one
    (LLM.int8: int8 weights, ``llm_int8_threshold`` for the outliers, 6.0 when absent as
    in transformers). Which projections are quantized is read from the
    checkpoint's tensors at load (``for_projections``), not from
    ``llm_int8_skip_modules``: the tensors are what the file holds."""
    where = "quantization_config"
    if declared.get("load_in_8bit") or declared.get("_load_in_8bit"):
        if declared.get("llm_int8_has_fp16_weight"):
            raise ValueError(
                f"The checkpoint's {where}.llm_int8_has_fp16_weight=true (bitsandbytes keeps "
                "16-bit weights for training) is not supported by pagedllm: it reads 8-bit "
                "checkpoints saved with int8 weights.")
        threshold = declared.get("llm_int8_threshold", 6.0)
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) \
                or not math.isfinite(threshold) or threshold < 0:
            raise ValueError(f"The checkpoint's {where}.llm_int8_threshold={threshold!r} must "
                             "be a number >= 0 (0: no outliers).")
        scheme = Int8Scheme(outlier_threshold=float(threshold))
        return QuantizationConfig("bitsandbytes", (_Group(("Linear",), scheme),))
    if not (declared.get("load_in_4bit") or declared.get("_load_in_4bit")):
        raise ValueError(f"The checkpoint's bitsandbytes {where} sets neither "
                         "load_in_4bit nor load_in_8bit.")
    quant_type = str(declared.get("bnb_4bit_quant_type", "fp4")).lower()  # transformers' default
    if quant_type not in BNB_QUANT_TYPES:
        raise ValueError(f"The checkpoint's {where}.bnb_4bit_quant_type="
                         f"{quant_type!r} is not supported by pagedllm: it reads "
                         f"{' and '.join(BNB_QUANT_TYPES)}.")
    scheme = IntWeightScheme("bitsandbytes", bits=4, group_size=BNB_GROUP, codebook=quant_type)
    return QuantizationConfig("bitsandbytes", (_Group(("Linear",), scheme),))


def for_projections(config: QuantizationConfig, names: Iterable[str]) -> QuantizationConfig:
    """``config`` (one scheme for every projection) given only to the projections
    ``names`` (checkpoint module names); the others stay unquantized."""
    return replace(config, groups=(_Group(tuple(sorted(names)), config.base_scheme),))


def _awq(declared: dict) -> QuantizationConfig:
    """AutoAWQ's ``quantization_config``: ``bits`` (``w_bit``), ``group_size``
    (``q_group_size``), ``zero_point``, ``version``."""
    where = "quantization_config"
    bits = declared.get("bits", declared.get("w_bit"))
    if bits != 4:
        raise ValueError(f"The checkpoint's {where}.bits={bits!r} is not supported by pagedllm: "
                         "AWQ checkpoints hold 4-bit weights.")
    version = str(declared.get("version") or declared.get("backend") or "gemm").lower()
    if version != "gemm":
        raise ValueError(
            f"The checkpoint's {where}.version={version!r} is not supported by pagedllm: it "
            "reads AutoAWQ's gemm layout (gemv, gemv_fast, exllama, marlin and ipex are "
            "kernel-specific packings; re-export the model with version gemm)."
        )
    if not declared.get("zero_point", True):
        raise ValueError(f"The checkpoint's {where}.zero_point=false is not supported by "
                         "pagedllm: AWQ gemm checkpoints with zero points are.")
    group_size = _group_size(declared.get("group_size", declared.get("q_group_size", 128)),
                             f"{where}.group_size")
    scheme = IntWeightScheme("awq", bits=4, group_size=group_size, symmetric=False)
    ignored = tuple(declared.get("modules_to_not_convert") or ())
    return QuantizationConfig("awq", (_Group(("Linear",), scheme),), ignored)
