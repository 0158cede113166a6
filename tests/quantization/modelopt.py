"""Checkpoints made by NVIDIA Model Optimizer (``nvidia-modelopt``), the tool behind
NVIDIA's published FP8 checkpoints.

``make_checkpoints(jobs)`` quantizes and exports in a child process (a heavy import that
warns about versions): each job is ``(source_dir, output_dir, algorithm, kv_cache,
disabled)``, ``algorithm`` one of ModelOpt's configs by name without ``_CFG``
(``FP8_DEFAULT``: per-tensor weights and static per-tensor inputs;
``FP8_PER_CHANNEL_PER_TOKEN``: per-channel weights, dynamic per-token inputs), ``kv_cache``
adding its FP8 KV-cache scales, ``disabled`` quantizer-name wildcards left unquantized
(ModelOpt writes them into the checkpoint's ignore list). Calibration runs random token
ids: the scales only need to exist.
"""

from __future__ import annotations

from pathlib import Path

from tests.quantization.child_jobs import main, run_jobs

Job = tuple[Path, Path, str, bool, list[str]]


def make_checkpoints(jobs: list[Job]) -> None:
    run_jobs(__name__, jobs)


def _quantize(source: str, output: str, algorithm: str, kv_cache: bool,
              disabled: list[str]) -> None:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = getattr(mtq, f"{algorithm}_CFG")
    rules = list(config["quant_cfg"])
    if kv_cache:
        rules += list(mtq.FP8_KV_CFG["quant_cfg"])
    rules += [{"quantizer_name": name, "enable": False} for name in disabled]
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def calibrate(module):
        for _ in range(4):
            module(torch.randint(0, vocab, (1, 16), generator=generator))

    mtq.quantize(model, {**config, "quant_cfg": rules}, calibrate)
    export_hf_checkpoint(model, export_dir=output)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(source) / name).is_file():
            (Path(output) / name).write_bytes((Path(source) / name).read_bytes())


if __name__ == "__main__":
    main(_quantize)
