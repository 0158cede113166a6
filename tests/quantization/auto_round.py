"""Checkpoints made by Intel's AutoRound, and its own reading of them.

``make_checkpoints(jobs)`` runs AutoRound in a child process (a heavy import with logging
of its own) for all the jobs: each job is ``(source_dir, output_dir, export_format, sym,
layer_config)``, the export format one of AutoRound's: ``auto_round`` (its own format,
``quant_method: auto-round``; GPTQ's packing, with zero - 1 stored when symmetric),
``auto_gptq`` (``quant_method: gptq``; per-layer bits become ``dynamic`` rules) or
``auto_awq`` (asymmetric only). Weights are rounded to nearest (``iters=0``, no
calibration), 4 bits in groups of 32, so two exports of one source and settings hold the
same integers. The LM head is left unquantized.

``dequantized_weights(model_dir)`` loads an ``auto_round`` export through transformers'
AutoRound integration and returns each quantized layer's weight as AutoRound's own
``QuantLinear`` dequantizes it (in float32).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.quantization.child_jobs import main, run_jobs

Job = tuple[Path, Path, str, bool, dict]
GROUP_SIZE = 32


def make_checkpoints(jobs: list[Job]) -> None:
    run_jobs(__name__, jobs, HF_HUB_OFFLINE="1")


def _quantize(source: str, output: str, export_format: str, sym: bool,
              layer_config: dict) -> None:
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.config import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("pagedllm-demo"))
    rounder = AutoRound(model, tokenizer, bits=4, group_size=GROUP_SIZE, sym=sym, iters=0,
                        disable_opt_rtn=True, layer_config=layer_config or None,
                        device_map="cpu", dataset=["a b c d e f g h " * 8] * 4, nsamples=4,
                        seqlen=16)
    staging = Path(output + ".staging")
    rounder.quantize_and_save(str(staging), format=export_format)
    # AutoRound writes into a subfolder named after the model and the scheme.
    next(path.parent for path in staging.rglob("config.json")).rename(output)
    shutil.rmtree(staging)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(source) / name).is_file() and not (Path(output) / name).is_file():
            (Path(output) / name).write_bytes((Path(source) / name).read_bytes())


def dequantized_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """``{module name: float32 weight}`` of every AutoRound ``QuantLinear`` in the model
    transformers loads from ``model_dir`` (an ``auto_round`` export), each weight as the
    layer's own forward pass dequantizes it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 device_map="cpu")
    weights = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__ != "QuantLinear":
                continue
            module.scales.data = module.scales.data.float()
            identity = torch.eye(module.infeatures, dtype=torch.float32)
            weights[name] = module(identity).t().contiguous()
    return weights


if __name__ == "__main__":
    main(_quantize)
