"""A request with an output constraint decodes token by token in a speculative engine (its
grammar cannot roll back rejected proposals yet): its output is the one the engine gives
without speculation, while the requests beside it still speculate."""

from __future__ import annotations

import re

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.structured import StructuredOutputsParams
from tests.spec_decode.conftest import repetitive_prompts

REGEX = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"


def test_constrained_requests_never_speculate_and_keep_their_output(target_dir, draft_dir,
                                                                     monkeypatch):
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts(3, seed=2)]
    constrained = SamplingParams(temperature=0.0, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(regex=REGEX))
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [constrained, free, free]
    engine = dict(block_size=8, max_model_len=128, max_num_seqs=4)
    want = [o.outputs[0] for o in LLM(str(target_dir), **engine).generate(
        prompts, params, use_tqdm=False)]
    verified: list[set[str]] = []
    schedule = Scheduler.schedule

    def recording(self):
        so = schedule(self)
        verified.append(set(so.spec_token_ids))
        return so

    monkeypatch.setattr(Scheduler, "schedule", recording)
    llm = LLM(str(target_dir), speculative_model=str(draft_dir), num_speculative_tokens=4,
              **engine)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0] for o in outputs]
    assert [(g.token_ids, g.text) for g in got] == [(w.token_ids, w.text) for w in want]
    assert re.fullmatch(REGEX, got[0].text)
    ids = [o.request_id for o in outputs]
    assert not any(ids[0] in step for step in verified)
    assert any(ids[1] in step or ids[2] in step for step in verified)
