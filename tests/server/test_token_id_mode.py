"""``return_token_ids``, and a server with no tokenizer (token-id mode, ``--skip-tokenizer-init``)."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from pagedllm.benchmarks import serve as bench_serve
from tests.server.conftest import MODEL_NAME, started_server

PROMPT_IDS = [0, 60, 71, 72, 80, 90, 100, 120]
GREEDY = {"model": MODEL_NAME, "max_tokens": 9, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ids_server(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "ids-server",
                        "--skip-tokenizer-init") as remote:
        yield remote


def test_return_token_ids_gives_prompt_and_output_ids(http):
    body = {**GREEDY, "prompt": "The quick brown fox", "return_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    tokenized = http.post("/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
    assert choice["prompt_token_ids"] == tokenized
    assert len(choice["token_ids"]) == 9
    plain = http.post("/v1/completions", json={**body, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0]

    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/v1/chat/completions",
                     json={**GREEDY, "messages": messages, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert len(chat["choices"][0]["token_ids"]) == 9


def test_token_id_mode_generates_the_same_tokens(http, ids_server):
    expected = http.post("/v1/completions",
                         json={**GREEDY, "prompt": PROMPT_IDS, "return_token_ids": True}).json()
    response = httpx.post(f"{ids_server.api_url}/completions", json={**GREEDY, "prompt": PROMPT_IDS})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == ""
    assert choice["prompt_token_ids"] == PROMPT_IDS
    assert choice["token_ids"] == expected["choices"][0]["token_ids"]
    assert response.json()["usage"]["completion_tokens"] == 9


def test_token_id_mode_streams_token_ids(ids_server):
    body = {**GREEDY, "prompt": PROMPT_IDS, "stream": True}
    full = httpx.post(f"{ids_server.api_url}/completions", json={**body, "stream": False}).json()
    with httpx.stream("POST", f"{ids_server.api_url}/completions", json=body) as response:
        chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]]
    assert streamed == full["choices"][0]["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT_IDS


def test_token_id_mode_refuses_what_needs_text(ids_server):
    def post(path, body):
        return httpx.post(f"{ids_server.base_url}{path}", json=body)

    for path, body, param in (
        ("/v1/completions", {**GREEDY, "prompt": "text"}, "prompt"),
        ("/v1/completions", {**GREEDY, "prompt": PROMPT_IDS, "stop": ["x"]}, "stop"),
        ("/v1/chat/completions", {**GREEDY, "messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/tokenize", {"prompt": "text"}, None),
    ):
        response = post(path, body)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert "token-id mode" in error["message"] and error["param"] == param


def test_bench_serve_runs_against_token_id_mode_with_vocab_size(ids_server):
    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    args = parser.parse_args(["--port", str(ids_server.port), "--num-prompts", "3",
                              "--input-len", "8", "--output-len", "4"])
    with pytest.raises(ValueError, match="--vocab-size"):
        bench_serve.run(args)
    args.vocab_size = 384
    record = bench_serve.run(args)
    assert record["completed"] == 3 and record["total_output_tokens"] == 12
