"""Engine runs and checkpoint edits the quantized-checkpoint tests share (no test module
imports another: one that skips without its tool would take the importer with it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pagedllm import LLM, SamplingParams


def engine_greedy(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def runner_model(llm: LLM):
    return llm.llm_engine.engine_core.model_runner.model


def with_quantization_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst
