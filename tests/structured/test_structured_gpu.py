"""On a GPU: constrained rows sampled under the masks filled ahead (the default there, with
asynchronous scheduling and CUDA graphs) give the tokens of masking first, seeded, with
logprobs and penalties riding along, and every output keeps its schema."""

from __future__ import annotations

import gc
import json

import jsonschema
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.structured import StructuredOutputsParams
from tests.structured.schemas import SCHEMAS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the masks-ahead path runs where a device computes")

NUM_REQUESTS = 24


def run(model_dir, prefetch: str, monkeypatch) -> tuple[list, int]:
    """The outputs of the same seeded constrained requests, and the tokens checked. Without
    masks filled ahead every request asks logprobs, which masks its rows first."""
    monkeypatch.setenv("PAGEDLLM_PREFETCH_MASKS", prefetch)
    llm = LLM(str(model_dir), device="cuda", dtype="float32", block_size=16, max_model_len=256,
              max_num_seqs=16)
    assert llm.llm_engine.engine_core.async_scheduling
    schema = SCHEMAS["person"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(json=schema),
                             logprobs=2 if i % 3 == 1 else (1 if prefetch == "0" else None),
                             presence_penalty=0.5 if i % 3 == 2 else 0.0)
              for i in range(NUM_REQUESTS)]
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 5 for j in range(3 + i)]}
               for i in range(NUM_REQUESTS)]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    checked = llm.llm_engine.engine_core.structured.num_checked_rows
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outputs, checked


def test_masks_ahead_give_the_tokens_of_masking_first(tiny_model_dir, monkeypatch):
    ahead, checked = run(tiny_model_dir, "1", monkeypatch)
    masked_first, _ = run(tiny_model_dir, "0", monkeypatch)
    assert checked == 0
    assert [o.token_ids for o in ahead] == [o.token_ids for o in masked_first]
    for first, second in zip(ahead, masked_first):
        if first.finish_reason == "stop":
            jsonschema.validate(json.loads(first.text), SCHEMAS["person"])
        for step_a, step_b in zip(first.logprobs or [], second.logprobs or []):
            assert step_a.keys() == step_b.keys()
            for token in step_a:
                assert step_a[token].logprob == pytest.approx(step_b[token].logprob, abs=1e-4)
    assert any(o.finish_reason == "stop" for o in ahead)
