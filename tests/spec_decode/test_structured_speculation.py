"""Requests with an output constraint speculate like the others: their proposals are cut
at the first token the grammar refuses, every verification row is masked by the grammar's
state after the proposals before it, and the output is the one the engine gives without
speculation (greedy, with logprobs, under chunked prefill and preemption too), or a
seeded draw that keeps its constraint and does not depend on its batch."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.structured import StructuredOutputsParams
from tests.spec_decode.conftest import repetitive_prompts

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}},
          "required": ["name"], "additionalProperties": False}
# Long enough that the output repeats itself, which n-gram lookup needs to propose.
REGEX = r"[a-z ]{20,200}\."
REGEX_PREFIX = r"[a-z ]{0,200}\.?"
ENGINE = dict(block_size=8, max_model_len=160, max_num_seqs=4)


def proposer(method: str, draft_dir) -> dict:
    if method == "ngram":
        return dict(speculative_method="ngram", num_speculative_tokens=4)
    return dict(speculative_model=str(draft_dir), num_speculative_tokens=4)


def compiled(llm: LLM, params: list[SamplingParams]) -> None:
    """Compile the constraints of ``params`` into ``llm``'s cache and wait for them, so that
    its requests are admitted together whatever the machine's speed (a request waits for
    its grammar; one still compiling would let the others run alone)."""
    from types import SimpleNamespace

    structured = llm.llm_engine.engine_core.structured
    for p in params:
        if p.structured_outputs is not None:
            request = SimpleNamespace(sampling_params=p)
            structured.attach(request)
            request.grammar.wait()


@pytest.fixture
def verified(monkeypatch) -> list[dict[str, int]]:
    """Per scheduled step, the proposals each request verifies."""
    steps: list[dict[str, int]] = []
    schedule = Scheduler.schedule

    def recording(self):
        so = schedule(self)
        steps.append({r: len(p) for r, p in so.spec_token_ids.items()})
        return so

    monkeypatch.setattr(Scheduler, "schedule", recording)
    return steps


# A budget of 7 tokens chunks every prompt; 12 blocks of 8 tokens force preemption.
TIGHT = dict(ENGINE, max_num_batched_tokens=7, num_kv_blocks=12, max_model_len=96)
# Steps in flight while more than two requests run, speculative steps once two remain.
ASYNC = dict(ENGINE, async_scheduling=True, speculative_disable_by_batch_size=2)
ENGINES = {"roomy": ENGINE, "chunked-preempting": TIGHT, "async-above-two": ASYNC}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_constrained_greedy_output_is_the_one_without_speculation(target_dir, draft_dir,
                                                                  method, engine, verified):
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts(4, seed=2)]
    plain = LLM(str(target_dir), **ENGINE)
    free_run = plain.generate(prompts[2:3], SamplingParams(temperature=0.0, max_tokens=6,
                                                           ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    # The constraint starts after two tokens the model writes freely ("</think>").
    gated = StructuredOutputsParams(regex="[a-c]{2,6}", reasoning_end_token_ids=free_run[2:4])
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(temperature=0.0, max_tokens=64, logprobs=2,
                       structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=gated),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    verified.clear()
    llm = LLM(str(target_dir), **ENGINES[engine], **proposer(method, draft_dir))
    compiled(llm, params)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if engine == "chunked-preempting":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    got = [o.outputs[0] for o in outputs]
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    jsonschema.validate(json.loads(got[0].text), SCHEMA)
    assert re.fullmatch(REGEX_PREFIX, got[1].text)
    assert got[2].token_ids[:4] == free_run[:4]
    assert re.fullmatch("[a-c]{2,6}", llm.get_tokenizer().decode(got[2].token_ids[4:]))
    for g_position, w_position in zip(got[1].logprobs, want[1].logprobs):
        assert set(g_position) == set(w_position)
        for token, entry in w_position.items():
            assert g_position[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert sum(steps.get(outputs[1].request_id, 0) for steps in verified) > 0
    assert llm.llm_engine.engine_core.scheduler.spec_decoding_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_seeded_constrained_request_keeps_its_constraint_and_its_tokens(target_dir, draft_dir,
                                                                         method, verified):
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts(3, seed=4)]
    llm = LLM(str(target_dir), **ENGINE, **proposer(method, draft_dir))
    seeded = [SamplingParams(temperature=0.8, seed=seed, max_tokens=100,
                             structured_outputs=StructuredOutputsParams(regex=REGEX), **knobs)
              for seed, knobs in ((1, {}), (2, dict(top_p=0.9)))]
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = [llm.generate(prompts[i:i + 1], p, use_tqdm=False)[0].outputs[0]
             for i, p in enumerate(seeded)]
    verified.clear()
    together = llm.generate(prompts, [seeded[0], seeded[1], others], use_tqdm=False)
    for a, t in zip(alone, together):
        assert t.outputs[0].token_ids == a.token_ids
        assert re.fullmatch(REGEX if a.finish_reason == "stop" else REGEX_PREFIX, a.text)
    assert any(steps.get(together[0].request_id, 0) > 0 for steps in verified)
