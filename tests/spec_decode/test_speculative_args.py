"""The speculative-decoding flags: accepted in both forms (flags and vLLM's
``--speculative-config``), refused with a message that says what to change."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.engine.arg_utils import EngineArgs


def config(**kwargs):
    return EngineArgs(**kwargs).create_engine_config()


def cli(*argv: str):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(list(argv))).create_engine_config()


def test_flags_and_the_json_form_give_the_same_config():
    flags = cli("--speculative-model", "pagedllm-demo-draft", "--num-speculative-tokens", "3",
                "--speculative-disable-by-batch-size", "8").speculative_config
    json_form = cli("--speculative-config", '{"model": "pagedllm-demo-draft", '
                    '"num_speculative_tokens": 3, "disable_by_batch_size": 8}').speculative_config
    for spec in (flags, json_form):
        assert (spec.method, spec.num_speculative_tokens, spec.disable_by_batch_size) == (
            "draft_model", 3, 8)
        assert spec.draft_model_config.path.name == "pagedllm-demo-draft"
    ngram = cli("--speculative-method", "ngram", "--num-speculative-tokens", "5",
                "--ngram-prompt-lookup-min", "2", "--ngram-prompt-lookup-max", "3").speculative_config
    assert (ngram.method, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == ("ngram", 2, 3)


def test_speculation_keeps_the_asynchronous_scheduling_asked_for():
    for asked in (True, False):
        assert config(speculative_method="ngram", num_speculative_tokens=2,
                      async_scheduling=asked).scheduler_config.async_scheduling is asked


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_speculative_tokens=3), "needs a proposer: --speculative-model DRAFT or "
                                     "--speculative-method ngram"),
    (dict(speculative_model="pagedllm-demo-draft"), "needs --num-speculative-tokens K"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), r"must be an integer in \[1, 16\]"),
    (dict(speculative_method="eagle", num_speculative_tokens=2), "'eagle' is not supported"),
    (dict(speculative_method="ngram", num_speculative_tokens=2,
          speculative_model="pagedllm-demo-draft"), "ngram uses no model"),
    (dict(speculative_model="pagedllm-demo-draft", num_speculative_tokens=2,
          ngram_prompt_lookup_max=3), "apply to --speculative-method ngram only"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, ngram_prompt_lookup_min=4,
          ngram_prompt_lookup_max=2), "1 <= min <= max"),
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "k": 1}'),
     "unknown key"),
    (dict(speculative_config="{not json"), "not valid JSON"),
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
          num_speculative_tokens=4), "disagrees with --speculative-config"),
    (dict(speculative_model="no-such-draft-model-dir", num_speculative_tokens=2),
     "The draft model --speculative-model no-such-draft-model-dir"),
])
def test_wrong_settings_are_refused_with_what_to_change(kwargs, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=message):
        config(**kwargs)
