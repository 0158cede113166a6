"""A server started with an API key (from the environment), then stopped with SIGTERM."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, RemoteServer

API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def keyed_server(server_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("keyed-server") / "server.log"
    remote = RemoteServer(server_model_dir, log, "--shutdown-timeout", "60",
                          env={"PAGEDLLM_API_KEY": API_KEY})
    yield remote
    remote.stop()


def test_missing_or_wrong_key_is_401(keyed_server):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{keyed_server.api_url}/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed_server.api_url}/models").status_code == 401
    assert httpx.post(f"{keyed_server.base_url}/tokenize", json={"prompt": "hi"}).status_code == 401
    with openai.OpenAI(base_url=keyed_server.api_url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_right_key_is_accepted_and_probes_need_none(keyed_server):
    with openai.OpenAI(base_url=keyed_server.api_url, api_key=API_KEY, max_retries=0) as client:
        response = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert response.usage.completion_tokens >= 1
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{keyed_server.base_url}{path}").status_code == 200


def test_sigterm_finishes_in_flight_stream_then_exits_zero(keyed_server):
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 1000,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    first_chunk = threading.Event()
    result: dict = {}

    def stream() -> None:
        lines = []
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.stream("POST", f"{keyed_server.api_url}/completions", json=body,
                          headers=headers, timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    first_chunk.set()
        result["lines"] = lines

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_chunk.wait(60)
    keyed_server.proc.send_signal(signal.SIGTERM)
    thread.join(120)
    assert keyed_server.proc.wait(120) == 0, keyed_server.log()
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][len("data: "):])["usage"]
    assert usage["completion_tokens"] == 1000
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{keyed_server.base_url}/health", timeout=2)
    log = keyed_server.log()
    assert "Waiting for connections to close" in log  # the stream was in flight at SIGTERM
    assert "pagedllm server stopped" in log
