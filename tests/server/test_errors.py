"""Every user error is a 4xx in OpenAI's error shape, and none disturbs other requests."""

from __future__ import annotations

import threading

import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME

PROMPT = "The quick brown fox"


def assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def complete(http, **body):
    return http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, **body})


def test_bad_logit_bias_is_400_naming_it(http):
    """A key that is not a token id, one outside the vocabulary, a negative one and a
    bias that is not a number are refused; the server answers the next request."""
    for bias in ({"abc": 5}, {"99999999": 5}, {"-3": 5}, {"5": "lots"}):
        error = assert_error(complete(http, logit_bias=bias), 400, param="logit_bias")
        assert "logit_bias" in error["message"]
    assert complete(http, max_tokens=2).status_code == 200


def test_invalid_sampling_value_is_400_naming_the_parameter(http, client):
    error = assert_error(complete(http, temperature=-1), 400, param="temperature")
    assert "temperature" in error["message"]
    assert_error(complete(http, top_p=1.5), 400, param="top_p")
    assert_error(complete(http, n=0), 400, param="n")
    assert_error(complete(http, max_tokens=0), 400, param="max_tokens")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, presence_penalty=5)


def test_wrong_type_and_missing_field_are_400(http):
    assert_error(complete(http, max_tokens="many"), 400, param="max_tokens")
    assert_error(http.post("/v1/completions", json={"model": MODEL_NAME}), 400, param="prompt")
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": "hi"}),
                 400, param="messages")


def test_malformed_json_is_400(http):
    response = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ',
                         headers={"Content-Type": "application/json"})
    error = assert_error(response, 400)
    assert "JSON" in error["message"]


def test_prompt_plus_max_tokens_beyond_context_is_400(http, client):
    error = assert_error(complete(http, max_tokens=MAX_MODEL_LEN), 400, param="max_tokens",
                         code="context_length_exceeded")
    assert str(MAX_MODEL_LEN) in error["message"]
    long_prompt = [5] * MAX_MODEL_LEN
    assert_error(complete(http, prompt=long_prompt, max_tokens=1), 400, param="prompt",
                 code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=MAX_MODEL_LEN)


def test_unknown_model_is_404(http, client):
    assert_error(complete(http, model="gpt-4o"), 404, param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert_error(http.get("/v1/models/nope"), 404)


def test_bad_prompts_and_messages_are_400(http):
    assert_error(complete(http, prompt=[1, 2, 999999]), 400, param="prompt")
    assert_error(complete(http, prompt=[]), 400, param="prompt")
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [image]}),
                 400)
    unknown_role = {"role": "wizard", "content": "hi"}
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [unknown_role]}),
                 400, param="messages")


def test_unsupported_openai_fields_are_refused_by_name(http):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice.
    assert_error(http.post("/v1/chat/completions", json={**body, "tools": tools}), 400,
                 param="tool_choice")
    assert_error(http.post("/v1/chat/completions", json={**body, "functions": tools}), 400,
                 param="functions")
    assert_error(http.post("/v1/chat/completions",
                           json={**body, "response_format": {"type": "yaml"}}),
                 400, param="response_format")
    assert_error(complete(http, logits_processors=["my.module:Proc"]), 400,
                 param="logits_processors")
    assert_error(complete(http, priority=1), 400, param="priority")
    assert_error(http.post("/v1/chat/completions", json={**body, "top_logprobs": 2}),
                 400, param="top_logprobs")


def test_unknown_route_is_404_in_openai_shape(http):
    assert_error(http.get("/v1/nothing-here"), 404)


def test_bad_requests_do_not_disturb_a_running_request(http, server):
    import httpx

    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 300, "temperature": 0,
            "ignore_eos": True}
    solo = complete(http, **{k: v for k, v in body.items() if k not in ("model", "prompt")}).json()
    result = {}

    def run():
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            result["response"] = c.post("/v1/completions", json=body).json()

    thread = threading.Thread(target=run)
    thread.start()
    for _ in range(10):
        assert complete(http, temperature=-1).status_code == 400
        assert complete(http, model="nope").status_code == 404
        assert complete(http, prompt=[999999]).status_code == 400
    thread.join(60)
    assert result["response"]["choices"][0]["text"] == solo["choices"][0]["text"]
    assert http.get("/health").status_code == 200
