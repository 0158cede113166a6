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
memory. (Dummy weights are drawn per rank at the rank's shapes.)
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import get_tp
from pagedllm.distributed.sharding import CheckpointSlice
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import Linear
from pagedllm.models.registry import get_model_class
from pagedllm.quantization import int_weights
from pagedllm.quantization.apply import quantize_model
from pagedllm.quantization.fp8 import FP8_DTYPE, FP8_MAX

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
    with _default_dtype(dtype), device:
        model = model_cls(model_config.hf_config)
        quant = model_config.quant_config
        if quant is not None:
            quantize_model(model, quant, "before_load")
    model.eval()
    model.requires_grad_(False)
    if model_config.load_format == "dummy":
        fill_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(iter_safetensors(model_config.path, lazy=get_tp().size > 1))
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
    ``seed`` for a given device. FP8 weights (an FP8 checkpoint's shapes) hold the same
    range as FP8 values times their scales: uniform [-448, 448] with weight scales
    1e-3 / 448, and static input scales 1 / 448. Integer weights hold uniform random
    values around a middle zero point, scaled to the same range
    (``int_weights.fill_dummy``)."""
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}

    def generator_for(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        return generators[device]

    packed = set()
    for module in model.modules():
        if isinstance(module, Linear) and module.int_scheme is not None:
            int_weights.fill_dummy(module.qweight, module.scales, module.zeros,
                                   module.int_scheme.bits, DUMMY_WEIGHT_RANGE,
                                   generator_for(module.qweight.device))
            packed.update(id(p) for p in (module.qweight, module.scales, module.zeros))
    for name, param in model.named_parameters():
        if id(param) in packed:
            continue
        if id(param) in norm_weights:
            param.fill_(1.0)
            continue
        if name.endswith(".weight_scale"):
            param.fill_(DUMMY_WEIGHT_RANGE / FP8_MAX)
            continue
        if name.endswith(".input_scale"):
            param.fill_(1.0 / FP8_MAX)
            continue
        generator = generator_for(param.device)
        if param.dtype == FP8_DTYPE:
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            param.copy_(values.uniform_(-FP8_MAX, FP8_MAX, generator=generator))
        else:
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)
