"""Where a model comes from, and in which precision it runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

from pagedllm import LLM, SamplingParams
from tests.engine.conftest import random_prompts


def test_hub_id_loads_from_the_offline_cache(tiny_model_dir, tmp_path):
    # Lay the checkpoint out as huggingface_hub caches a download of "acme/tiny-llama".
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    script = (
        "from pagedllm import LLM, SamplingParams\n"
        "llm = LLM('acme/tiny-llama', max_model_len=64)\n"
        "out = llm.generate([{'prompt_token_ids': [5, 6, 7]}],"
        " SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)\n"
        "print(out[0].outputs[0].token_ids)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    direct = LLM(str(tiny_model_dir), max_model_len=64).generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False)
    assert result.stdout.strip() == str(direct[0].outputs[0].token_ids)


def test_missing_model_says_it_could_not_be_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    try:
        LLM("acme/does-not-exist")
    except ValueError as exc:
        assert "Could not find model 'acme/does-not-exist'" in str(exc)
    else:
        raise AssertionError("a missing model must raise ValueError")


def test_bfloat16_runs_in_bfloat16_and_tracks_float32(tiny_model_dir):
    prompt = {"prompt_token_ids": random_prompts(1, 24, 24, seed=11)[0]}
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    bf16 = LLM(str(tiny_model_dir), dtype="bfloat16", max_model_len=64)
    assert next(bf16.llm_engine.engine_core.model_runner.model.parameters()).dtype == torch.bfloat16
    fp32 = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    ids = prompt["prompt_token_ids"]

    def prompt_logprobs(llm):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return torch.tensor([e[ids[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e])

    drift = (prompt_logprobs(bf16) - prompt_logprobs(fp32)).abs()
    assert drift.mean() < 0.2, drift
