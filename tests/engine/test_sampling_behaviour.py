"""What users of the offline API rely on: seeds, stops, limits, n, logprobs, and clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine import output_processor
from tests.engine.conftest import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), block_size=8, max_model_len=128)


@pytest.fixture(scope="module")
def prompt():
    return {"prompt_token_ids": random_prompts(1, 12, 12, seed=3)[0]}


def run(llm, prompts, **params):
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def test_seeded_sample_is_the_same_whatever_else_is_in_the_batch(llm, prompt):
    alone = run(llm, [prompt], temperature=1.0, seed=1234, max_tokens=16)[0]
    others = [{"prompt_token_ids": p} for p in random_prompts(5, 2, 30, seed=4)]
    params = [SamplingParams(temperature=1.0, max_tokens=16)] * 2 + [
        SamplingParams(temperature=1.0, seed=1234, max_tokens=16)] + [
        SamplingParams(temperature=0.7, seed=9, max_tokens=16)] * 3
    batched = llm.generate(others[:2] + [prompt] + others[2:], params, use_tqdm=False)[2]
    assert batched.outputs[0].token_ids == alone.outputs[0].token_ids
    assert batched.outputs[0].text == alone.outputs[0].text


def test_different_seeds_give_different_samples(llm, prompt):
    a = run(llm, [prompt], temperature=1.0, seed=1, max_tokens=16)[0].outputs[0].token_ids
    b = run(llm, [prompt], temperature=1.0, seed=2, max_tokens=16)[0].outputs[0].token_ids
    assert a != b


def test_max_tokens_ends_with_length(llm, prompt):
    out = run(llm, [prompt], temperature=0.0, max_tokens=5, ignore_eos=True)[0].outputs[0]
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"


def test_stop_string_cuts_text_and_reports_reason(llm, prompt):
    full = run(llm, [prompt], temperature=0.0, max_tokens=24, ignore_eos=True)[0].outputs[0].text
    assert len(full) > 6, "the tiny model's output is too short to pick a stop string"
    stop = full[3:6]
    before = full[: full.index(stop)]
    out = run(llm, [prompt], temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])[0].outputs[0]
    assert out.text == before
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    kept = run(llm, [prompt], temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop,
               include_stop_str_in_output=True)[0].outputs[0]
    assert kept.text == before + stop


def test_stop_token_id_ends_generation(llm, prompt):
    greedy = run(llm, [prompt], temperature=0.0, max_tokens=10, ignore_eos=True)[0].outputs[0].token_ids
    stop_id = greedy[3]
    out = run(llm, [prompt], temperature=0.0, max_tokens=10, ignore_eos=True,
              stop_token_ids=[stop_id])[0].outputs[0]
    first = greedy.index(stop_id)
    assert out.token_ids == greedy[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # The stop token ends the text without appearing in it.
    assert out.text == llm.get_tokenizer().decode(greedy[:first])


def test_min_tokens_holds_back_stop_tokens(llm, prompt):
    greedy = run(llm, [prompt], temperature=0.0, max_tokens=10, ignore_eos=True)[0].outputs[0].token_ids
    stop_id = greedy[0]
    out = run(llm, [prompt], temperature=0.0, max_tokens=10, ignore_eos=True,
              stop_token_ids=[stop_id], min_tokens=4)[0].outputs[0]
    assert len(out.token_ids) >= 4
    assert stop_id not in out.token_ids[:3]


def test_logit_bias_bans_the_greedy_tokens_and_leaves_logprobs_raw(llm, prompt):
    """Banning each greedy token with -100 moves greedy decoding elsewhere, for every
    request of a batch (n > 1 children too); the logprobs reported stay those of the raw
    logits, as OpenAI's and vLLM's do; a batch neighbour without a bias is unchanged."""
    greedy = run(llm, [prompt], temperature=0.0, max_tokens=6, ignore_eos=True,
                 logprobs=1)[0].outputs[0]
    banned = {t: -100.0 for t in greedy.token_ids}
    plain, biased = llm.generate(
        [prompt, prompt],
        [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
         SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=6, ignore_eos=True,
                        logit_bias=banned, logprobs=0)], use_tqdm=False)
    assert plain.outputs[0].token_ids == greedy.token_ids
    for choice in biased.outputs:
        assert not set(choice.token_ids) & set(banned)
        # A banned token's raw logprob is reported as the model gave it.
        first = choice.logprobs[0][choice.token_ids[0]].logprob
        assert first < greedy.logprobs[0][greedy.token_ids[0]].logprob


def test_n_returns_n_distinct_completions(llm, prompt):
    out = run(llm, [prompt], temperature=1.0, n=3, seed=5, max_tokens=8)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_logprobs_match_hf_and_rank_the_greedy_token_first(llm, prompt, hf_model):
    out = run(llm, [prompt], temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)[0]
    completion = out.outputs[0]
    ids = prompt["prompt_token_ids"] + completion.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert len(entry) == 3  # the greedy token is one of the top 3
        assert entry[token].rank == 1
        position = len(prompt["prompt_token_ids"]) - 1 + step
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[position, tid].item(), abs=1e-4)
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs_match_hf(llm, prompt, hf_model):
    out = run(llm, [prompt], temperature=0.0, max_tokens=1, prompt_logprobs=2)[0]
    ids = prompt["prompt_token_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert ids[i] in entry
        assert entry[ids[i]].logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert math.isfinite(entry[ids[i]].logprob)


def test_prompt_logprobs_survive_chunked_prefill(tiny_model_dir, prompt, hf_model):
    llm = LLM(str(tiny_model_dir), block_size=8, max_model_len=128, max_num_batched_tokens=5)
    out = run(llm, [prompt], temperature=0.0, max_tokens=1, prompt_logprobs=0)[0]
    ids = prompt["prompt_token_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = [e[ids[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None]
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_are_reported_once_when_preemption_recomputes_them(
    tiny_model_dir, hf_model, async_scheduling
):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, 20, 40, seed=13)]
    llm = LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=10, max_model_len=64,
              max_num_batched_tokens=8, enable_prefix_caching=False,
              async_scheduling=async_scheduling)
    outs = run(llm, prompts, temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    for prompt, out in zip(prompts, outs):
        ids = prompt["prompt_token_ids"]
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        got = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        assert got == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                    abs=1e-4)


def test_detokenize_false_gives_the_token_ids_and_no_text_without_decoding(llm, prompt,
                                                                         monkeypatch):
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    with_text = run(llm, [prompt], **greedy)[0].outputs[0]

    def decode(*args, **kwargs):
        raise AssertionError("text decoded for a request that asked for token ids only")

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", decode)
    monkeypatch.setattr(llm.llm_engine.output_processor, "_decode_one", decode)
    ids_only = run(llm, [prompt], **greedy, detokenize=False)[0].outputs[0]
    assert with_text.text and ids_only.text == ""
    assert ids_only.token_ids == with_text.token_ids
    assert [{t: lp.logprob for t, lp in entry.items()} for entry in ids_only.logprobs] == [
        {t: lp.logprob for t, lp in entry.items()} for entry in with_text.logprobs]
    assert all(lp.decoded_token is None for entry in ids_only.logprobs for lp in entry.values())
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop=["x"], detokenize=False)


def test_text_prompt_round_trips_through_the_tokenizer(llm):
    out = run(llm, ["hello world"], temperature=0.0, max_tokens=3, ignore_eos=True)[0]
    assert out.prompt == "hello world"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("hello world")
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)


def test_prompt_longer_than_max_model_len_fails_at_submission(llm, prompt):
    with pytest.raises(ValueError, match="maximum model length"):
        run(llm, [{"prompt_token_ids": [10] * 200}], max_tokens=4)
    # The engine is unharmed and still serves.
    assert run(llm, [prompt], temperature=0.0, max_tokens=2)[0].finished


def test_out_of_vocabulary_token_id_is_rejected(llm):
    with pytest.raises(ValueError, match="out of the vocabulary"):
        run(llm, [{"prompt_token_ids": [1, 10**6]}])
    with pytest.raises(ValueError, match="logit_bias must name token ids of the vocabulary"):
        run(llm, [{"prompt_token_ids": [1, 2]}], logit_bias={10**6: 1.0})
    with pytest.raises(ValueError, match="allowed_token_ids must name token ids of the vocab"):
        run(llm, [{"prompt_token_ids": [1, 2]}], allowed_token_ids=[5, 10**6])


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"n": 0}, {"max_tokens": 0},
                                 {"logprobs": 50}, {"min_p": 2.0}, {"logit_bias": {"5": 1.0}},
                                 {"logit_bias": {5: float("nan")}}, {"logit_bias": [5]},
                                 {"allowed_token_ids": []}, {"allowed_token_ids": [-1]}])
def test_invalid_sampling_params_name_the_parameter(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_unsupported_engine_features_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(tiny_model_dir), enable_lora=True)
    with pytest.raises(TypeError, match="Unknown engine argument"):
        LLM(str(tiny_model_dir), not_an_option=True)


def test_kv_cache_smaller_than_one_request_fails_at_start(tiny_model_dir):
    with pytest.raises(ValueError, match="max-model-len"):
        LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=4, max_model_len=128)


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    rendered = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)


def test_chat_passes_tools_and_template_variables(llm):
    """vLLM's ``LLM.chat`` arguments reach the template: ``chat_template_kwargs`` (Qwen3's
    ``enable_thinking``), ``tools``, and ``continue_final_message``."""
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% if not (continue_final_message and loop.last) %}</{{ m.role }}>{% endif %}"
                "{% endfor %}{% if tools %}[{{ tools | map(attribute='function.name') | join(',') }}]"
                "{% endif %}{% if enable_thinking is false %}<nothink>{% endif %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    params = SamplingParams(temperature=0.0, max_tokens=2)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    out = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False,
                   chat_template=template, tools=[tool],
                   chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt == "<user>hi</user>[get_weather]<nothink><assistant>"
    out = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
                   params, use_tqdm=False, chat_template=template, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt == "<user>hi</user><assistant>Hel"
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat([{"role": "user", "content": "hi"}], params, chat_template_kwargs=["x"])


# The constructs of DeepSeek V3's tool template: ``content is none`` tested, then
# concatenated with ``+`` (a missing key fails there), arguments written with ``tojson``.
DEEPSEEK_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] is defined %}"
    "{% if m['content'] is none %}<calls>{% else %}{{ '<a>' + m['content'] + '<calls>' }}{% endif %}"
    "{% for c in m['tool_calls'] %}{{ c['function']['name'] + ':' }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}</calls>"
    "{% else %}{{ '<' + m['role'] + '>' + m['content'] }}{% endif %}{% endfor %}"
)


def test_chat_renders_an_agent_loop_with_openai_messages(llm):
    """An assistant turn of tool calls only (``content: None``, arguments as a JSON string)
    renders through a template that tests ``content is none`` and writes the arguments."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False,
                      chat_template=DEEPSEEK_LIKE, add_generation_prompt=False)
    assert out.prompt == '<user>Weather?<a><calls>get_weather:{"city": "Paris"}</calls><tool>18 C'


def test_seeded_sampling_is_unchanged_by_preemption(tiny_model_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 3, 40, seed=1)]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]
    roomy = LLM(str(tiny_model_dir), block_size=8, max_model_len=64)
    tight = LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=8, max_model_len=64,
                enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert tight.llm_engine.engine_core.scheduler.num_preemptions_total > 0


def test_priority_needs_the_priority_policy(llm, prompt):
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate([prompt, prompt], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1, 0])


def test_priority_policy_serves_lower_values_first(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), block_size=8, max_model_len=64, max_num_seqs=1,
              scheduling_policy="priority")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 4, 8, seed=21)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False, priority=[2, 0, 1])
    # One request runs at a time, so first-token times follow the priority order.
    first = [o.metrics["first_token_time"] for o in outputs]
    assert first[1] < first[2] < first[0]
