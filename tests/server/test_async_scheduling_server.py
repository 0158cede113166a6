"""The server with asynchronous scheduling (the default on CUDA): the engine core keeps a
step in flight, and what clients get back is unchanged."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, openai_client, started_server, wait_for

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def async_server(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "async-server",
                        "--async-scheduling") as remote:
        yield remote


@pytest.fixture
def async_client(async_server):
    with openai_client(async_server) as c:
        yield c


def test_greedy_and_seeded_completions_match_the_synchronous_offline_engine(
    async_server, async_client, server_model_dir
):
    assert "asynchronous scheduling on" in async_server.log()
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(server_model_dir), device="cpu", num_kv_blocks=128, max_model_len=MAX_MODEL_LEN,
              async_scheduling=False)
    cases = [dict(temperature=0.0, max_tokens=12), dict(temperature=1.0, seed=7, max_tokens=9)]
    for case in cases:
        want = llm.generate([PROMPT], SamplingParams(ignore_eos=True, **case),
                            use_tqdm=False)[0].outputs[0].text
        got = async_client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, extra_body={"ignore_eos": True}, **case)
        assert got.choices[0].text == want
        assert got.usage.completion_tokens == case["max_tokens"]


def test_streaming_with_a_stop_string_ends_before_it(async_client):
    full = async_client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].text
    stop = full[6:9]
    chunks = async_client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=True)
    text, reasons = "", []
    for chunk in chunks:
        text += chunk.choices[0].text
        reasons.append(chunk.choices[0].finish_reason)
    assert text == full[:full.index(stop)]
    assert reasons[-1] == "stop"


def test_disconnect_with_a_step_in_flight_frees_everything(async_server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=async_server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))

    def idle():
        return (async_server.metric("pagedllm:num_requests_running"),
                async_server.metric("pagedllm:kv_cache_usage_perc")) == (0.0, 0.0)

    assert wait_for(idle)
    # The engine still serves after the abort.
    with httpx.Client(base_url=async_server.base_url, timeout=60) as c:
        response = c.post("/v1/completions", json={**body, "max_tokens": 3, "stream": False})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3
