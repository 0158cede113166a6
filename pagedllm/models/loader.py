"""Build a model on its device in its dtype and fill its weights.

The model is constructed under ``torch.device(device)`` with the default dtype set, so
every parameter is allocated once, directly where it will live, and never initialised
(the layers allocate with ``torch.empty``). Then either:

* ``load_format`` "auto"/"safetensors": stream ``*.safetensors`` tensors (one file, or the
  shards listed in ``model.safetensors.index.json``) through ``model.load_weights``, one
  tensor in host memory at a time;
* ``load_format`` "dummy": random weights at the real shapes, uniform in [-1e-3, 1e-3]
  with RMSNorm weights 1, drawn on the device from ``model_config.seed`` — for
  benchmarks of large shapes with no checkpoint.

With tensor parallelism each rank builds only its part of every split layer, and the
checkpoint's tensors reach ``load_weights`` unread (``sharding.CheckpointSlice``): each
layer reads the rows or columns it holds, so a rank never holds the whole model in
memory. Dummy weights are the same at every split: each rank draws a split tensor whole
from the tensor's own seed and keeps its part (``fill_dummy_weights``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import get_tp
from pagedllm.distributed.sharding import CheckpointSlice
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import Embedding, FusedLinear, Linear
from pagedllm.models.registry import get_model_class
from pagedllm.quantization import bitsandbytes, int_weights
from pagedllm.quantization.apply import quantize_model
from pagedllm.quantization.checkpoint import for_projections
from pagedllm.quantization.fp8 import FP8_DTYPE, FP8_MAX
from pagedllm.quantization.int8 import INT8_MAX

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DUMMY_WEIGHT_RANGE = 1e-3
logger = logging.getLogger(__name__)


def resolve_dtype(model_config: ModelConfig, device: torch.device | str) -> torch.dtype:
    """The dtype the model runs in.

    An explicit ``dtype`` wins. "auto" is the checkpoint's declared dtype on accelerators;
    on the CPU a bfloat16/float16 checkpoint runs in float32 (half-precision matmuls are
    slow there, and the CPU path is the exactness reference).
    """
    if model_config.dtype != "auto":
        return _TORCH_DTYPES[model_config.dtype]
    declared = _TORCH_DTYPES[model_config.config_dtype]
    if torch.device(device).type == "cpu" and declared in (torch.float16, torch.bfloat16):
        return torch.float32
    return declared


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_config: ModelConfig, device: torch.device | str, dtype: torch.dtype
) -> nn.Module:
    """The checkpoint's model on ``device`` in ``dtype``, weights loaded, in eval mode."""
    model_cls = get_model_class(model_config.architectures)
    device = torch.device(device)
    quant = model_config.quant_config
    weights = None
    if model_config.load_format != "dummy":
        weights = iter_safetensors(model_config.path, lazy=get_tp().size > 1)
        if quant is not None and quant.method == "bitsandbytes" and quant.prequantized:
            # The projections the checkpoint holds quantized, handed over as the layers read
            # them.
            held = bitsandbytes.quantized_prefixes(checkpoint_tensor_names(model_config.path),
                                                   bits=quant.bits)
            names = getattr(model_cls, "projection_names", lambda name: [name])
            quant = for_projections(quant, {p for name in held for p in names(name)})
            weights = bitsandbytes.checkpoint_tensors(weights, held)
    with _default_dtype(dtype), device:
        model = model_cls(model_config.hf_config)
        if quant is not None:
            quantize_model(model, quant, "before_load")
    model.eval()
    model.requires_grad_(False)
    if weights is None:
        fill_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(weights)
    if quant is not None:
        quantize_model(model, quant, "after_load")
        if device.type == "cuda":
            torch.cuda.empty_cache()  # weights replaced at load go back to the pool
    held = weight_memory(model)
    tp = get_tp()
    logger.info("Model weights%s: %s (%s%s)",
                f" of tensor-parallel rank {tp.rank} of {tp.size}" if tp.size > 1 else "",
                f"{held / 2**30:.2f} GiB" if held >= 2**30 else f"{held / 2**20:.2f} MiB",
                str(dtype).replace("torch.", ""),
                f", {quant.method} projections" if quant is not None else "")
    return model


def weight_memory(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they are held (packed, FP8 or not)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint files under ``path``: the shards an index names, else every
    ``*.safetensors``. Raises ValueError when there are none."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names shards that are not in {path}: {absent}.")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"No *.safetensors weights in {path}. Convert the checkpoint to safetensors, or "
            "pass load_format='dummy' (--load-format dummy) for random weights."
        )
    return files


def checkpoint_tensor_names(path: Path) -> list[str]:
    """The names of the checkpoint's tensors (read from the files' headers)."""
    from safetensors import safe_open

    names = []
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names.extend(handle.keys())
    return names


def iter_safetensors(path: Path, lazy: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """``(name, tensor)`` for every tensor of the checkpoint, file by file; with ``lazy``
    each tensor is a ``CheckpointSlice``, read only where the model asks."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, CheckpointSlice(handle, name) if lazy else handle.get_tensor(name)


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Uniform [-1e-3, 1e-3] in every parameter, 1 in RMSNorm weights; deterministic in
    ``seed`` for a given device, and the same at every tensor-parallel size and pipeline
    split. FP8 weights (an FP8 checkpoint's shapes) hold the same range as FP8 values times
    their scales: uniform [-448, 448] with weight scales 1e-3 / 448, and static input
    scales 1 / 448; INT8 W8A8 weights uniform over [-127, 127] with scales 1e-3 / 127 (static
    input scales 1 / 127). Integer weights hold uniform random values around a middle zero point,
    scaled to the same range (``int_weights.fill_dummy``), experts' too.

    Each value is a function of the checkpoint tensor it stands for and ``seed`` only:
    every tensor is drawn from a generator seeded by ``seed`` and the parameter's name
    (plus the shard for the q/k/v and gate/up rows of a fused projection), and a split
    layer's tensor is drawn whole, at its checkpoint shape, one at a time on the device,
    then cut to this rank's part by the layer's ``load`` exactly as a checkpoint's would
    be (vocabulary parts padded with zeros). Names carry the global layer index, so a
    pipeline stage draws its layers' values as the whole model does."""
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    draws = _DummyDraws(seed)
    filled: set[int] = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, Linear) and module.int_scheme is not None:
            int_weights.fill_dummy(module.qweight, module.scales, module.zeros,
                                   module.int_scheme.bits, DUMMY_WEIGHT_RANGE,
                                   draws.generator(prefix + "qweight", None,
                                                   module.qweight.device))
            filled.update(id(p) for p in (module.qweight, module.scales, module.zeros))
        elif isinstance(module, Linear) and module.weight is not None \
                and module.weight.dtype == torch.int8:  # INT8 W8A8: values times row scales
            filled.update(_fill_int8(module.weight, module.weight_scale, module.input_scale,
                                     draws.generator(prefix + "weight", None,
                                                     module.weight.device),
                                     row_max=module.llm_int8_threshold is not None))
        elif isinstance(module, FusedMoE) and module.w13.dtype == torch.int8:  # INT8 W8A8
            for name in ("w13", "w2"):
                weight = getattr(module, name)
                filled.update(_fill_int8(weight, getattr(module, f"{name}_scale"),
                                         getattr(module, f"{name}_input_scale"),
                                         draws.generator(prefix + name, None, weight.device)))
        elif isinstance(module, FusedMoE) and module.int_scheme is not None:
            for name in ("w13", "w2"):
                packed, scales, zeros = (getattr(module, name + suffix)
                                         for suffix in ("", "_scales", "_zeros"))
                int_weights.fill_dummy(packed, scales, zeros, module.int_scheme.bits,
                                       DUMMY_WEIGHT_RANGE,
                                       draws.generator(prefix + name, None, packed.device))
                filled.update(id(p) for p in (packed, scales, zeros))
        elif isinstance(module, (Linear, Embedding)):
            shards = list(module.shard_sizes) if isinstance(module, FusedLinear) else [None]
            for param_name in ("weight", "bias"):
                param = getattr(module, param_name, None)
                if param is None:
                    continue
                for shard in shards:
                    whole = draws.tensor(prefix + param_name, shard,
                                         module.checkpoint_shape(param_name, shard),
                                         param.dtype, param.device)
                    module.load(param_name, whole, shard)
                    del whole
                filled.add(id(param))
    for name, param in model.named_parameters():
        if id(param) in filled:
            continue
        if id(param) in norm_weights:
            param.fill_(1.0)
        elif name.endswith((".weight_scale", ".w13_scale", ".w2_scale")):
            param.fill_(DUMMY_WEIGHT_RANGE / FP8_MAX)
        elif name.endswith(".input_scale"):
            param.fill_(1.0 / FP8_MAX)
        elif param.dtype == FP8_DTYPE:
            param.copy_(draws.tensor(name, None, param.shape, param.dtype, param.device))
        else:
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE,
                           generator=draws.generator(name, None, param.device))


def _fill_int8(weight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None,
               generator: torch.Generator, row_max: bool = False) -> list[int]:
    """Dummy INT8 W8A8 values: int8 weights uniform over [-127, 127] with scales 1e-3 / 127
    (static input scales 1 / 127), so weights within 1e-3; ``row_max``: bitsandbytes'
    8-bit, whose ``weight_scale`` is each row's largest magnitude (1e-3). Returns the ids
    of the tensors filled."""
    weight.random_(-INT8_MAX, INT8_MAX + 1, generator=generator)
    scale.fill_(DUMMY_WEIGHT_RANGE if row_max else DUMMY_WEIGHT_RANGE / INT8_MAX)
    if input_scale is not None:
        input_scale.fill_(1.0 / INT8_MAX)
    return [id(weight), id(scale), id(input_scale)]


class _DummyDraws:
    """Dummy values per checkpoint tensor: one generator per device, seeded again for each
    tensor from the run's seed, the tensor's name and its shard (a stable hash, the same
    in every process)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, name: str, shard: str | None, device: torch.device) -> torch.Generator:
        key = f"{self.seed}/{name}/{shard or ''}".encode()
        tensor_seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device].manual_seed(tensor_seed >> 1)

    def tensor(self, name: str, shard: str | None, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """The values of ``name`` (its ``shard``) at ``shape``: uniform [-1e-3, 1e-3] in
        ``dtype``, or FP8 values uniform [-448, 448]."""
        generator = self.generator(name, shard, device)
        if dtype == FP8_DTYPE:
            values = torch.empty(shape, dtype=torch.float32, device=device)
            return values.uniform_(-FP8_MAX, FP8_MAX, generator=generator).to(FP8_DTYPE)
        values = torch.empty(shape, dtype=dtype, device=device)
        return values.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)
