"""The engine core dies under load: every in-flight request ends with an error, the server
answers 503 to new work and exits non-zero, so a supervisor (Kubernetes) restarts it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.server.conftest import MODEL_NAME, RemoteServer, wait_for

LONG = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 1000,
        "temperature": 0, "ignore_eos": True}


def engine_core_pid(server_pid: int) -> int:
    """The engine core: the server's child started by multiprocessing's spawn."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            return int(pid)
    raise AssertionError(f"No engine core among the children {children} of {server_pid}")


def test_killed_engine_core_fails_in_flight_requests_and_exits_non_zero(server_model_dir, tmp_path):
    remote = RemoteServer(server_model_dir, tmp_path / "server.log", "--shutdown-timeout", "60")
    results: dict[str, object] = {}
    streaming = threading.Event()

    def full(name: str) -> None:
        with httpx.Client(base_url=remote.base_url, timeout=60) as c:
            response = c.post("/v1/completions", json={**LONG, "n": 2})
            results[name] = (response.status_code, response.json())

    def stream(name: str) -> None:
        lines = []
        with httpx.Client(base_url=remote.base_url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json={
                    "model": MODEL_NAME, "max_tokens": 1000, "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]}) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        streaming.set()
        results[name] = lines

    try:
        threads = [threading.Thread(target=full, args=(f"full{i}",)) for i in range(3)]
        threads += [threading.Thread(target=stream, args=(f"stream{i}",)) for i in range(3)]
        for thread in threads:
            thread.start()
        assert streaming.wait(60)
        assert wait_for(lambda: remote.metric("pagedllm:num_requests_running") == 9, 20)
        os.kill(engine_core_pid(remote.proc.pid), signal.SIGKILL)
        killed = time.monotonic()
        for thread in threads:
            thread.join(10)
        assert time.monotonic() - killed < 5.0
        assert not any(thread.is_alive() for thread in threads)
        for i in range(3):
            status, body = results[f"full{i}"]
            assert status == 500, body
            assert body["error"]["type"] == "server_error"
            assert "engine" in body["error"]["message"].lower()
            lines = results[f"stream{i}"]
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2][len("data: "):])["error"]
            assert error["type"] == "server_error" and "engine" in error["message"].lower()
        assert remote.proc.wait(5) != 0
        assert time.monotonic() - killed < 5.0
    finally:
        remote.stop()


def test_health_is_503_once_the_engine_is_dead_and_new_requests_get_503():
    from fastapi.testclient import TestClient

    from tests.server.app_stub import stub_app

    app, engine = stub_app()
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        engine.die()
        response = client.get("/health")
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "server_error"
        response = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert response.status_code == 503
        assert "engine" in response.json()["error"]["message"]
