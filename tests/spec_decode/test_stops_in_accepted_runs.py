"""Stops that fall inside a run of accepted tokens: the output ends exactly where it
would without speculation (EOS, a stop token, a stop string, max_tokens), and the tokens
after it are dropped.

The bundled demo model drafts for itself here, so every proposal is accepted and each
step yields K + 1 = 9 tokens: any stop lands inside a run.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler import Scheduler

CHAT = [{"role": "user", "content": "Write a Python function `is_palindrome(s)`. Return True "
                                    "if the string reads the same forwards and backwards."}]
CODE = "import os\n\n\ndef read_lines(path):"


@pytest.fixture(scope="module")
def plain():
    return LLM(max_model_len=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def speculative():
    return LLM(max_model_len=256, max_num_seqs=4, speculative_model="pagedllm-demo",
               num_speculative_tokens=8)


def completion(llm: LLM, prompt: str, params: SamplingParams):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_eos_inside_an_accepted_run_ends_the_output(plain, speculative, monkeypatch):
    runs = []
    append = Scheduler._append_tokens

    def recording(request, sampled):
        runs.append(list(sampled))
        return append(request, sampled)

    monkeypatch.setattr(Scheduler, "_append_tokens", staticmethod(recording))
    params = SamplingParams(temperature=0.0, max_tokens=120)
    want = plain.chat([CHAT], params, use_tqdm=False)[0].outputs[0]
    got = speculative.chat([CHAT], params, use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 120
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
    eos = want.token_ids[-1]
    # The EOS was a proposal the target accepted, with more accepted tokens after it.
    assert any(eos in run[:-1] for run in runs)


@pytest.mark.parametrize("max_tokens", [1, 5, 9, 10])
def test_max_tokens_is_never_exceeded(plain, speculative, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want = completion(plain, CODE, params)
    got = completion(speculative, CODE, params)
    assert len(got.token_ids) == max_tokens and got.finish_reason == "length"
    assert (got.token_ids, got.text) == (want.token_ids, want.text)


def test_a_stop_string_inside_an_accepted_run_cuts_the_output_there(plain, speculative):
    reference = completion(plain, CODE, SamplingParams(temperature=0.0, max_tokens=40,
                                                       ignore_eos=True))
    stop = reference.text[30:34]
    assert stop.strip() and reference.text.find(stop) == 30
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        want = completion(plain, CODE, params)
        got = completion(speculative, CODE, params)
        assert len(want.token_ids) < 40 and want.stop_reason == stop
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason)


def test_a_stop_token_inside_an_accepted_run_ends_the_output(plain, speculative):
    reference = completion(plain, CODE, SamplingParams(temperature=0.0, max_tokens=30,
                                                       ignore_eos=True))
    stop_token = reference.token_ids[13]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                            stop_token_ids=[stop_token])
    want = completion(plain, CODE, params)
    got = completion(speculative, CODE, params)
    assert want.stop_reason == stop_token and len(want.token_ids) <= 14
    assert (got.token_ids, got.text, got.stop_reason) == (want.token_ids, want.text, stop_token)
