"""Checkpoints made by llm-compressor, the tool operators quantize with.

``make_checkpoints(jobs)`` runs ``llmcompressor.oneshot`` in a child process (the library
is heavy to import and sets up its own logging) once for all the jobs: each job is
``(source_dir, output_dir, scheme, kv_cache)`` or ``(..., modifier)`` with ``scheme`` a
preset name (``FP8_DYNAMIC``: per-channel weights, dynamic per-token activations; ``FP8``:
per-tensor weights and static per-tensor activations, calibrated; ``W4A16``,
``W4A16_ASYM``, ``W8A16``: integer weights in groups of 128, written pack-quantized;
``W8A8``: int8 weights per channel and int8 inputs per token, written int-quantized; or a
dict, one config group's ``weights`` and ``input_activations``),
``kv_cache`` adding the static per-tensor FP8 KV-cache scales, and ``modifier``
``"quantization"`` (round to nearest, the default) or ``"gptq"`` (GPTQ with activation
ordering ``weight``, the ordering llm-compressor writes without a ``g_idx``). The LM head
is left unquantized, as llm-compressor's examples do. Calibration uses random token ids
(the scales only need to exist), fixed and in a fixed order, so a job makes the same
checkpoint every time.
"""

from __future__ import annotations

from pathlib import Path

from tests.quantization.child_jobs import main, run_jobs

Job = tuple[Path, Path, str | dict, bool] | tuple[Path, Path, str | dict, bool, str]


def make_checkpoints(jobs: list[Job]) -> None:
    run_jobs(__name__, jobs)


def _oneshot(source: str, output: str, scheme: str, kv_cache: bool,
             modifier: str = "quantization") -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    kv_scheme = None
    if kv_cache:
        kv_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                     "symmetric": True}
    if modifier == "gptq":
        recipe = GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"],
                              actorder="weight")
    elif isinstance(scheme, dict):
        recipe = QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"],
                                                                 **scheme}},
                                      ignore=["lm_head"], kv_cache_scheme=kv_scheme)
    else:
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"],
                                      kv_cache_scheme=kv_scheme)
    calibrate = scheme != "FP8_DYNAMIC" or kv_cache
    if calibrate:
        generator = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        ids = [torch.randint(8, vocab, (48,), generator=generator).tolist() for _ in range(8)]
        dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 48] * 8})
        # Tokenized already; oneshot still wants a processor: the demo model's tokenizer.
        from pagedllm.config import resolve_model_path

        tokenizer_dir = source if (Path(source) / "tokenizer.json").is_file() else \
            resolve_model_path("pagedllm-demo")
        # In order: the observers' running averages depend on it, and a shuffle would make
        # another checkpoint every run.
        oneshot(model=model, recipe=recipe, dataset=dataset, num_calibration_samples=8,
                max_seq_length=48, processor=AutoTokenizer.from_pretrained(tokenizer_dir),
                shuffle_calibration_samples=False)
    else:
        oneshot(model=model, recipe=recipe)
    model.save_pretrained(output, save_compressed=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(source) / name).is_file() and not (Path(output) / name).is_file():
            (Path(output) / name).write_bytes((Path(source) / name).read_bytes())


if __name__ == "__main__":
    main(_oneshot)
