"""``--stream-interval N``: a streamed response carries its first token at once, then a chunk
per N new tokens, and the same tokens and text as without it."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, RemoteServer


@pytest.fixture(scope="module")
def interval_server(server_model_dir, tmp_path_factory):
    remote = RemoteServer(server_model_dir, tmp_path_factory.mktemp("interval") / "server.log",
                          "--stream-interval", "4")
    yield remote
    remote.stop()


def chunks(remote: RemoteServer, body: dict) -> list[dict]:
    with httpx.Client(base_url=remote.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            return [json.loads(line[6:]) for line in response.iter_lines()
                    if line.startswith("data: {")]


def test_streams_send_a_chunk_per_interval_with_the_same_tokens(interval_server, server):
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 14,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    streamed = chunks(interval_server, body)
    counts = [len(c["choices"][0]["token_ids"]) for c in streamed]
    assert counts[0] == 1 and sum(counts) == 14
    assert all(n >= 4 for n in counts[1:-1]) and len(streamed) <= 1 + 13 // 4 + 1
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        full = c.post("/v1/completions", json=body).json()["choices"][0]
    assert [t for c in streamed for t in c["choices"][0]["token_ids"]] == full["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in streamed) == full["text"]


def test_a_stream_interval_below_one_is_refused(server_model_dir, tmp_path):
    with pytest.raises(RuntimeError, match="--stream-interval must be >= 1"):
        RemoteServer(server_model_dir, tmp_path / "server.log", "--stream-interval", "0")
