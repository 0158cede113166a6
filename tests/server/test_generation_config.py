"""The server's sampling defaults (``--generation-config``, ``--override-generation-config``):
a request that does not set a field samples with the model's default, one that sets it with
its own, on every endpoint."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL_NAME, openai_client, started_server

MESSAGES = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def client(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "generation-defaults",
                        "--override-generation-config",
                        '{"top_k": 1, "temperature": 0.8, "max_new_tokens": 6}') as remote:
        with openai_client(remote) as c:
            yield c
        assert "sample with max_tokens=6, temperature=0.8, top_k=1 (" in remote.log()


def test_a_request_takes_the_defaults_it_does_not_set(client):
    ignore_eos = {"extra_body": {"ignore_eos": True}}
    default = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **ignore_eos)
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0.0,
                                            max_tokens=6, **ignore_eos)
    # top_k 1 is greedy whatever the temperature; max_new_tokens is the default max_tokens.
    assert default.usage.completion_tokens == 6
    assert default.choices[0].message.content == greedy.choices[0].message.content
    longer = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=9,
                                            **ignore_eos)
    assert longer.usage.completion_tokens == 9
    assert longer.choices[0].message.content.startswith(greedy.choices[0].message.content)
    # A request's own top_k replaces the default: seeded draws at temperature 0.8 differ.
    drawn = {client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, seed=seed, max_tokens=6,
        extra_body={"top_k": 0, "ignore_eos": True}).choices[0].message.content
        for seed in range(4)}
    assert len(drawn) > 1


def test_completions_and_responses_take_them_too(client):
    completion = client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                           max_tokens=6)
    greedy = client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                       max_tokens=6, temperature=0.0)
    assert completion.choices[0].text == greedy.choices[0].text
    response = client.responses.create(model=MODEL_NAME, input="Once upon a time")
    assert response.temperature == 0.8 and response.usage.output_tokens <= 6
