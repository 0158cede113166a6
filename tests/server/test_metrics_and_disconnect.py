"""Prometheus metrics, utility endpoints, and aborting the requests of clients that leave."""

from __future__ import annotations

import json
import socket

import httpx

import pagedllm
from tests.server.conftest import MODEL_NAME, wait_for

REQUIRED_METRICS = [
    "pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
    "pagedllm:num_requests_waiting_for_grammar",
    "pagedllm:kv_cache_usage_perc", "pagedllm:prefix_cache_queries_total",
    "pagedllm:prefix_cache_hits_total", "pagedllm:num_preemptions_total",
    "pagedllm:num_preempted_tokens_total", "pagedllm:num_swapped_tokens_total",
    "pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total",
    "pagedllm:request_success_total", "pagedllm:time_to_first_token_seconds_count",
    "pagedllm:time_per_output_token_seconds_count", "pagedllm:e2e_request_latency_seconds_count",
    "pagedllm:request_queue_time_seconds_count",
]
LONG = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 1000,
        "temperature": 0, "ignore_eos": True}


def test_health_version_tokenize_detokenize(http):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json() == {"version": pagedllm.__version__}
    tokens = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    no_bos = http.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert tokens["tokens"][1:] == no_bos["tokens"]
    assert http.post("/detokenize", json={"tokens": no_bos["tokens"]}).json() == {"prompt": "hello world"}
    assert http.post("/detokenize", json={"tokens": [10 ** 6]}).status_code == 400


def test_metrics_count_tokens_and_requests_with_model_label(http, server):
    before_prompt = server.metric("pagedllm:prompt_tokens_total")
    before_length = server.metric("pagedllm:request_success_total", finished_reason="length")
    response = http.post("/v1/completions", json={**LONG, "max_tokens": 5}).json()
    assert response["usage"]["completion_tokens"] == 5
    samples = server.metrics()
    for name in REQUIRED_METRICS:
        assert any(key.startswith(name + "{") and f'model_name="{MODEL_NAME}"' in key
                   for key in samples), name
    num_prompt = response["usage"]["prompt_tokens"]
    assert server.metric("pagedllm:prompt_tokens_total") == before_prompt + num_prompt
    assert server.metric("pagedllm:request_success_total", finished_reason="length") == before_length + 1
    assert server.metric("pagedllm:time_to_first_token_seconds_count") >= 1
    assert server.metric("pagedllm:request_queue_time_seconds_count") >= 1


def test_prefix_cache_hits_show_in_metrics(http, server):
    prompt = "A shared system prompt that is long enough to fill a few KV blocks. " * 3
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}
    http.post("/v1/completions", json=body)
    hits = server.metric("pagedllm:prefix_cache_hits_total")
    second = http.post("/v1/completions", json=body).json()
    assert server.metric("pagedllm:prefix_cache_hits_total") > hits
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def running_and_usage(server):
    return (server.metric("pagedllm:num_requests_running"),
            server.metric("pagedllm:kv_cache_usage_perc"))


def test_stream_disconnect_aborts_request_and_frees_its_blocks(server):
    aborted = server.metric("pagedllm:request_success_total", finished_reason="abort")
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert wait_for(lambda: server.metric("pagedllm:num_requests_running") == 1, 10)
    # The connection is closed mid-stream: the request must be aborted, not finished.
    assert wait_for(lambda: running_and_usage(server) == (0.0, 0.0)), running_and_usage(server)
    assert server.metric("pagedllm:request_success_total", finished_reason="abort") == aborted + 1


def test_non_streaming_disconnect_aborts_request(server):
    aborted = server.metric("pagedllm:request_success_total", finished_reason="abort")
    body = json.dumps({**LONG, "n": 2}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request + body)
        assert wait_for(lambda: server.metric("pagedllm:num_requests_running") == 2, 10)
    # Closed before the response: both sequences are aborted, not finished.
    assert wait_for(lambda: running_and_usage(server) == (0.0, 0.0)), running_and_usage(server)
    assert server.metric("pagedllm:request_success_total", finished_reason="abort") == aborted + 2


def test_tokenizing_a_huge_prompt_does_not_stall_other_requests(server):
    """A prompt of megabytes takes over a second to tokenize; meanwhile the server keeps
    answering (tokenization runs off the event loop)."""
    import threading
    import time

    huge = {"model": MODEL_NAME, "prompt": "The quick brown fox jumps over the lazy dog. " * 80000,
            "max_tokens": 1}
    result = {}

    def post_huge() -> None:
        start = time.perf_counter()
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            result["status"] = c.post("/v1/completions", json=huge).status_code
        result["seconds"] = time.perf_counter() - start

    worker = threading.Thread(target=post_huge)
    worker.start()
    time.sleep(0.5)  # the huge prompt is being tokenized
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        probes = []
        for _ in range(5):
            start = time.perf_counter()
            assert c.get("/health").status_code == 200
            probes.append(time.perf_counter() - start)
    worker.join()
    assert result["status"] == 400  # far longer than max_model_len
    assert result["seconds"] > 1.5  # the probes ran while it was tokenized
    assert max(probes) < 0.6 * result["seconds"], (probes, result)


def test_kv_cache_capacity_is_in_metrics_with_its_dtype(server):
    # The shared server: 512 blocks of 16 tokens in the float32 model's dtype.
    assert server.metric("pagedllm:kv_cache_capacity_tokens", cache_dtype="float32",
                         block_size="16") == 512 * 16


def test_an_fp8_kv_cache_serves_and_reports_its_capacity(server_model_dir, tmp_path_factory):
    from tests.server.conftest import started_server

    with started_server(server_model_dir, tmp_path_factory, "fp8-kv",
                        "--kv-cache-dtype", "fp8") as remote:
        with httpx.Client(base_url=remote.base_url, timeout=60) as c:
            response = c.post("/v1/completions", json={**LONG, "max_tokens": 5}).json()
        assert response["usage"]["completion_tokens"] == 5
        assert remote.metric("pagedllm:kv_cache_capacity_tokens",
                             cache_dtype="float8_e4m3fn") == 512 * 16
        assert "KV cache (float8_e4m3fn): 512 blocks x 16 tokens = 8192 tokens" in remote.log()
