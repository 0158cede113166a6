"""``/v1/completions`` through the official openai client and raw HTTP."""

from __future__ import annotations

import json
import string

import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME

PROMPT = "The quick brown fox"


def greedy(client, prompt=PROMPT, max_tokens=12, extra: dict | None = None, **kw):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True, **(extra or {})},
                                     **kw)


def test_models_endpoint_lists_served_name_with_max_model_len(client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card["object"] == "model"
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_completion_has_openai_shape_and_exact_usage(client, http):
    response = greedy(client, max_tokens=7)
    assert response.object == "text_completion"
    assert response.id.startswith("cmpl-")
    assert response.model == MODEL_NAME
    assert response.created > 0
    [choice] = response.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    num_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.completion_tokens == 7
    assert response.usage.total_tokens == num_prompt + 7


def test_greedy_completion_matches_offline_engine(client, server_model_dir):
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(server_model_dir), device="cpu", num_kv_blocks=128, max_model_len=MAX_MODEL_LEN)
    offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text
    assert greedy(client).choices[0].text == offline


def test_prompt_list_and_token_ids_give_one_choice_per_prompt_and_n(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = greedy(client).choices[0].text
    by_ids = greedy(client, prompt=ids).choices[0].text
    assert by_ids == by_text

    response = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, "def fibonacci(n):"], n=2, max_tokens=5,
        temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    five_tokens = greedy(client, max_tokens=5).choices[0].text
    assert response.choices[0].text == response.choices[1].text == five_tokens
    assert response.usage.completion_tokens == 4 * 5


def test_echo_prepends_prompt_and_its_logprobs(client):
    plain = greedy(client, max_tokens=4)
    response = greedy(client, max_tokens=4, echo=True, logprobs=2)
    choice = response.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    num_prompt = response.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client):
    """``echo`` with ``max_tokens: 0`` (vLLM's prompt scoring): the prompt's text and
    logprobs, nothing generated (no token, no usage), in full and streamed; without echo
    ``max_tokens: 0`` stays a 400 (test_errors)."""
    with_one = greedy(client, max_tokens=1, echo=True, logprobs=2)
    scored = greedy(client, max_tokens=0, echo=True, logprobs=2)
    [choice] = scored.choices
    num_prompt = scored.usage.prompt_tokens
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    lp, want = choice.logprobs, with_one.choices[0].logprobs
    assert len(lp.tokens) == num_prompt
    assert lp.tokens == want.tokens[:num_prompt]
    assert lp.token_logprobs == pytest.approx(want.token_logprobs[:num_prompt], abs=1e-5)

    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert text == PROMPT and len(tokens) == num_prompt
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0


def test_logprobs_give_sampled_and_top_tokens(client):
    response = greedy(client, max_tokens=6, logprobs=3)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token_logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        # The top 3 plus the sampled token when outside them; tokens that decode to the
        # same text (partial UTF-8 bytes) share one key.
        assert 1 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert token_logprob == pytest.approx(max(top.values()), abs=1e-4)


def test_stop_string_ends_text_before_it(client):
    text = greedy(client, max_tokens=40).choices[0].text
    # A short printable ASCII piece of the greedy text, past its start.
    candidates = [text[i:i + 2] for i in range(2, len(text) - 2)
                  if all(ch in string.ascii_letters for ch in text[i:i + 2])]
    if not candidates:
        pytest.fail(f"The greedy text has no ASCII letter pair to stop on: {text!r}")
    stop = candidates[0]
    response = greedy(client, max_tokens=40, stop=[stop])
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[:text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_vllm_extra_sampling_fields_apply(client):
    # top_k=1 at temperature 1 is greedy.
    top1 = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10,
                                     temperature=1.0, extra_body={"top_k": 1, "ignore_eos": True})
    assert top1.choices[0].text == greedy(client, max_tokens=10).choices[0].text


def test_streaming_completion_matches_full_text_and_reports_usage(client):
    full = greedy(client, max_tokens=10).choices[0].text
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_prompt_logprobs_give_each_prompt_token_and_the_top_ones(client, http):
    """vLLM's prompt_logprobs: per prompt position (None first) the prompt token and the
    top N by id, the same logprobs an echo gives; on chat for the rendered prompt; in the
    first streamed chunk; above 20 it is a 400."""
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    response = greedy(client, max_tokens=2, echo=True, logprobs=1, extra={"prompt_logprobs": 2})
    entries = response.choices[0].model_extra["prompt_logprobs"]
    echoed = response.choices[0].logprobs.token_logprobs[:len(ids)]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry, want in zip(ids[1:], entries[1:], echoed[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        assert entry[str(token_id)]["logprob"] == pytest.approx(want, abs=1e-5)
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
    stream = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, stream=True,
        extra_body={"prompt_logprobs": 0}))
    first = stream[0].choices[0].model_extra["prompt_logprobs"]
    assert len(first) == len(ids) and all(len(e) == 1 for e in first[1:])
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 1})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    error = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT,
                                              "prompt_logprobs": 50})
    assert error.status_code == 400 and error.json()["error"]["param"] == "prompt_logprobs"


def test_allowed_token_ids_limit_what_is_sampled(client, http):
    """vLLM's allowed_token_ids: every sampled token is one of them; bad ids are 400s."""
    allowed = http.post("/tokenize", json={"prompt": " the quick fox"}).json()["tokens"]
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1, seed=5,
        extra_body={"ignore_eos": True, "return_token_ids": True, "allowed_token_ids": allowed})
    assert set(response.choices[0].token_ids) <= set(allowed)
    for bad in ([], [-1], [10**8]):
        error = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT,
                                                  "allowed_token_ids": bad})
        assert error.status_code == 400
        assert error.json()["error"]["param"] == "allowed_token_ids"


def contains(ids: list[int], run: list[int]) -> bool:
    return any(ids[i:i + len(run)] == run for i in range(len(ids) - len(run) + 1))


def test_bad_words_keep_words_out_of_the_output(client, http):
    """vLLM's bad_words: greedy decoding steps around a listed word wherever it would have
    come: a one-token word and a two-token one taken from the unconstrained output (words
    whose text tokenizes back to those tokens); blank words are 400s."""
    plain = greedy(client, max_tokens=40, extra={"return_token_ids": True}).choices[0].token_ids

    def tokens(text: str) -> list[int]:
        return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}
                         ).json()["tokens"]

    def word_of(run: list[int]) -> str | None:
        """The word whose banned forms (bare, or after a space when that is as many
        tokens) include ``run``; None if none does."""
        word = http.post("/detokenize", json={"tokens": run}).json()["prompt"].strip()
        if not word:
            return None
        bare, spaced = tokens(word), tokens(" " + word)
        forms = [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
        return word if run in forms else None

    for size in (1, 2):
        found = next(((i, w) for i in range(len(plain) - size + 1)
                      if (w := word_of(plain[i:i + size])) is not None), None)
        assert found is not None, f"no {size}-token word in the greedy output"
        i, word = found
        avoided = greedy(client, max_tokens=40, extra={"return_token_ids": True,
                                                       "bad_words": [word]}).choices[0].token_ids
        assert avoided[:i] == plain[:i]  # the same until the word would come
        assert not contains(avoided, plain[i:i + size]), word
    error = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT,
                                              "bad_words": ["  "]})
    assert error.status_code == 400 and error.json()["error"]["param"] == "bad_words"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, http):
    """vLLM's truncate_prompt_tokens: the last N prompt tokens are what the model reads (an
    echo shows them); -1 keeps up to the context length; other values are 400s."""
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    kept = greedy(client, max_tokens=4, echo=True, extra={"truncate_prompt_tokens": 2})
    from_ids = greedy(client, prompt=ids[-2:], max_tokens=4, echo=True)
    assert kept.usage.prompt_tokens == 2
    assert kept.choices[0].text == from_ids.choices[0].text
    whole = greedy(client, max_tokens=4, extra={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi " * 20}], max_tokens=1,
        extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        response = http.post("/v1/completions", json={
            "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": bad})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens
    streamed up to it, the last chunk the whole request's."""
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    text_chunks = [c for c in chunks if c.choices]
    seen = 0
    for chunk in text_chunks:
        seen += len(chunk.choices[0].token_ids)
        assert chunk.usage.completion_tokens == seen
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + seen
    assert seen == 6 and chunks[-1].usage.completion_tokens == 6

    chat = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chat]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 5


def test_raw_sse_lines_end_with_done(http):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][len("data: "):])
    assert first["object"] == "text_completion" and first["model"] == MODEL_NAME
    assert "usage" not in first  # only with stream_options.include_usage


def test_logit_bias_forces_and_bans_tokens_through_the_openai_client(client, http):
    """OpenAI's logit_bias: +100 on one token makes every sampled token that one (at
    temperature 1 too); -100 on the greedy choice moves greedy decoding off it; biases
    past +-100 are clamped, as OpenAI's range is."""
    forced = http.post("/tokenize", json={"prompt": " fox"}).json()["tokens"][-1]
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=1, seed=3,
        logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert response.choices[0].token_ids == [forced] * 6

    def first_greedy_token(**bias) -> int:
        response = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, **bias,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        return response.choices[0].token_ids[0]

    first = first_greedy_token()
    for bias in (-100, -1e9):
        assert first_greedy_token(logit_bias={str(first): bias}) != first

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        logit_bias={str(forced): 100}, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert chat.choices[0].token_ids == [forced] * 4
