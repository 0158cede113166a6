"""``/v1/chat/completions`` through the official openai client (sync and async)."""

from __future__ import annotations

import asyncio

from tests.server.conftest import MODEL_NAME

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write a function that reverses a list."},
]


def chat(client, messages=MESSAGES, max_tokens=8, **kw):
    extra = kw.pop("extra_body", {})
    return client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, **extra}, **kw)


def test_chat_completion_renders_template_and_counts_its_tokens(client, http):
    response = chat(client)
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    rendered = http.post("/tokenize", json={"messages": MESSAGES}).json()
    # The tiny template starts with BOS and ends with the assistant header.
    assert rendered["tokens"][0] == 0
    assert response.usage.prompt_tokens == rendered["count"]
    assert response.usage.completion_tokens == 8


def test_text_parts_content_equals_string_content(client):
    parts = [
        MESSAGES[0],
        {"role": "user", "content": [{"type": "text", "text": "Write a function"},
                                     {"type": "text", "text": "that reverses a list."}]},
    ]
    joined = [MESSAGES[0], {"role": "user", "content": "Write a function\nthat reverses a list."}]
    assert chat(client, parts).choices[0].message.content == chat(client, joined).choices[0].message.content


def test_assistant_turns_and_max_completion_tokens(client):
    history = MESSAGES + [{"role": "assistant", "content": "def rev(x): return x[::-1]"},
                          {"role": "user", "content": "Shorter?"}]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=history, max_completion_tokens=3, temperature=0,
        extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


def test_chat_stream_starts_with_role_and_ends_with_usage(client):
    full = chat(client).choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_logprobs_with_top_logprobs(client):
    response = chat(client, max_tokens=5, logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # Greedy: the chosen token is the most likely one.
        assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-4
    assert chat(client, max_tokens=5).choices[0].logprobs is None


def test_n_choices_with_seed_are_indexed_and_reproducible(client):
    def sample():
        return client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, n=3, max_tokens=8, temperature=1.0, seed=11,
            extra_body={"ignore_eos": True})

    first, second = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1  # children get different seeds
    assert first.usage.completion_tokens == 24


def test_32_concurrent_streams_complete_with_their_own_text(server, client):
    import openai

    prompts = [f"Item {i}: reverse a list of {i} numbers." for i in range(4)]
    expected = {p: chat(client, [{"role": "user", "content": p}], max_tokens=12).choices[0].message.content
                for p in prompts}

    async def one(aclient, prompt):
        stream = await aclient.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=12,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return prompt, text

    async def main():
        async with openai.AsyncOpenAI(base_url=server.api_url, api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, prompts[i % 4]) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    for prompt, text in results:
        assert text == expected[prompt]
