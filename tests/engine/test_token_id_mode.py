"""Token-id mode (``skip_tokenizer_init``): a model without a tokenizer still generates."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import make_tiny_checkpoint


PROMPT = {"prompt_token_ids": [10, 11, 12, 13]}
GREEDY = dict(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("no-tokenizer"), "llama",
                                vocab_size=128, max_position_embeddings=128)


def _llm(path) -> LLM:
    return LLM(str(path), max_model_len=64, block_size=8, num_kv_blocks=64)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return _llm(checkpoint)


def test_a_model_directory_without_tokenizer_starts_in_token_id_mode(llm) -> None:
    assert llm.llm_engine.config.model_config.skip_tokenizer_init
    assert llm.get_tokenizer() is None


def test_token_id_prompts_give_token_ids_and_empty_text(llm) -> None:
    params = SamplingParams(**GREEDY, ignore_eos=True, logprobs=1)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.token_ids) == 6 and completion.text == ""
    assert out.prompt is None and out.prompt_token_ids == [10, 11, 12, 13]
    assert all(lp[t].decoded_token is None for lp, t in zip(completion.logprobs, completion.token_ids))


def test_eos_ids_come_from_the_checkpoint_generation_config(llm, checkpoint) -> None:
    first = llm.generate(PROMPT, SamplingParams(**GREEDY, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    # Declare the model's first greedy token an end-of-sequence id (one of a list).
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [first, 127]}))
    stopping = _llm(checkpoint)
    assert stopping.llm_engine.input_processor.eos_token_ids == frozenset({first, 127})
    out = stopping.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [first]


def test_text_prompts_and_stop_strings_are_refused_with_what_to_do(llm) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="without a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
