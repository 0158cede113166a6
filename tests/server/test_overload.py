"""Overload and deadlines on a live server: a bounded waiting queue refuses new requests at
once with 503 and Retry-After, and a request past --request-timeout is aborted with a 504."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, started_server, wait_for

LONG = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 1000,
        "temperature": 0, "ignore_eos": True}
# The deadline server's --request-timeout: a few times shorter than 4 x 1,000 tokens of the
# tiny model take on an idle machine (about 2 s), so the long requests always pass it.
DEADLINE_S = 0.5


def gauges(remote) -> tuple[float, float, float]:
    return (remote.metric("pagedllm:num_requests_running"),
            remote.metric("pagedllm:num_requests_waiting"),
            remote.metric("pagedllm:kv_cache_usage_perc"))


@pytest.fixture(scope="module")
def bounded_server(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "bounded-server",
                        "--max-num-seqs", "1", "--max-num-waiting", "2") as remote:
        yield remote


@pytest.fixture(scope="module")
def deadline_server(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "deadline-server",
                        "--request-timeout", str(DEADLINE_S)) as remote:
        yield remote


def test_full_waiting_queue_answers_503_with_retry_after_at_once(bounded_server):
    """One request runs (--max-num-seqs 1), two wait (--max-num-waiting 2): the next is refused."""
    remote = bounded_server
    stop = threading.Event()
    opened = threading.Semaphore(0)

    def hold_stream() -> None:
        with httpx.Client(base_url=remote.base_url, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
                assert response.status_code == 200  # submitted
                opened.release()
                for _ in response.iter_lines():
                    if stop.is_set():
                        return

    threads = [threading.Thread(target=hold_stream) for _ in range(3)]
    try:
        threads[0].start()
        assert opened.acquire(timeout=30)
        assert wait_for(lambda: gauges(remote)[0] == 1.0, 10)
        for thread in threads[1:]:
            thread.start()
            assert opened.acquire(timeout=30)
        rejected = remote.metric("pagedllm:num_requests_rejected_total")
        start = time.perf_counter()
        response = httpx.post(f"{remote.api_url}/completions", json={**LONG, "max_tokens": 2},
                              timeout=30)
        assert time.perf_counter() - start < 1.0
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["code"] == "overloaded" and error["type"] == "server_error"
        assert "--max-num-waiting 2" in error["message"]
        assert remote.metric("pagedllm:num_requests_rejected_total") == rejected + 1
        chat = httpx.post(f"{remote.api_url}/chat/completions", timeout=30, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 503
        assert gauges(remote)[:2] == (1.0, 2.0)  # the queue depth, as Prometheus sees it
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert wait_for(lambda: gauges(remote) == (0.0, 0.0, 0.0), 30), gauges(remote)
    response = httpx.post(f"{remote.api_url}/completions", json={**LONG, "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 200


def test_request_past_its_deadline_is_aborted_with_504(deadline_server):
    remote = deadline_server
    aborted = remote.metric("pagedllm:request_success_total", finished_reason="abort")
    start = time.perf_counter()
    response = httpx.post(f"{remote.api_url}/completions", json={**LONG, "n": 4}, timeout=60)
    assert DEADLINE_S <= time.perf_counter() - start < DEADLINE_S + 2.0
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "request_timeout" and "--request-timeout" in error["message"]
    assert wait_for(lambda: gauges(remote) == (0.0, 0.0, 0.0), 10), gauges(remote)
    assert remote.metric("pagedllm:request_success_total", finished_reason="abort") == aborted + 4
    assert remote.metric("pagedllm:api_server_requests") == 0


def test_stream_past_its_deadline_ends_with_an_error_event(deadline_server):
    remote = deadline_server
    with httpx.Client(base_url=remote.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "model": MODEL_NAME, "max_tokens": 1000, "ignore_eos": True, "stream": True,
                "n": 4, "messages": [{"role": "user", "content": "hi"}]}) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) > 3  # tokens streamed before the deadline
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "request_timeout"
    assert wait_for(lambda: gauges(remote) == (0.0, 0.0, 0.0), 10), gauges(remote)


def test_request_within_its_deadline_is_answered(deadline_server):
    response = httpx.post(f"{deadline_server.api_url}/completions",
                          json={**LONG, "max_tokens": 5}, timeout=30)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 5
