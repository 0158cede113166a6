"""``--api-server-count N``: N API processes share the port and one engine core. Requests
answered by any of them carry the same greedy tokens as with one process, the metrics of
every process add up in each scrape, and a dead core, or a dead API process, stops them all
with a non-zero status."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
from prometheus_client import values

from pagedllm.metrics import ServerMetrics
from tests.server.conftest import MODEL_NAME, RemoteServer, wait_for

PROMPT = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12,
          "temperature": 0, "ignore_eos": True}


def spawned_children(pid: int) -> list[int]:
    """``pid``'s children started by multiprocessing's spawn, oldest first (the engine core
    is started before the other API processes)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    spawned = [int(c) for c in children
               if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return sorted(spawned, key=lambda c: int(Path(f"/proc/{c}/stat").read_text()
                                                 .rsplit(")", 1)[1].split()[19]))


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def complete(remote: RemoteServer, stream: bool) -> str:
    with httpx.Client(base_url=remote.base_url, timeout=60) as c:
        if not stream:
            response = c.post("/v1/completions", json=PROMPT)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]
        text = []
        with c.stream("POST", "/v1/completions", json={**PROMPT, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    text += [choice["text"] for choice in json.loads(line[6:])["choices"]]
        return "".join(text)


def test_api_processes_answer_alike_sum_their_metrics_and_die_with_the_core(
        server, server_model_dir, tmp_path):
    expected = complete(server, stream=False)  # one API process
    remote = RemoteServer(server_model_dir, tmp_path / "server.log", "--api-server-count", "2")
    try:
        core, other = spawned_children(remote.proc.pid)
        texts: list[str] = []
        threads = [threading.Thread(target=lambda i=i: texts.append(complete(remote, i % 2 == 0)))
                   for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert texts == [expected] * 12
        assert remote.metric("pagedllm:request_success_total", finished_reason="length") == 12
        assert remote.metric("pagedllm:generation_tokens_total") == 12 * 12
        assert wait_for(lambda: remote.metric("pagedllm:api_server_requests") == 0, 5)

        # The core dies with streams open on both processes (as far as the kernel spreads
        # the connections): every stream ends with an error event, and every process exits.
        endings: list[str] = []
        refused: list[str] = []  # a stream the server did not accept: status and body

        def long_stream() -> None:
            with httpx.Client(base_url=remote.base_url, timeout=60) as c:
                with c.stream("POST", "/v1/completions", json={
                        **PROMPT, "max_tokens": 1000, "stream": True}) as response:
                    lines = [line for line in response.iter_lines() if line]
            if response.status_code != 200 or len(lines) < 2:
                refused.append(f"{response.status_code}: {lines}")
            else:
                endings.append(lines[-2])

        streams = [threading.Thread(target=long_stream) for _ in range(4)]
        for thread in streams:
            thread.start()
        running = wait_for(lambda: remote.metric("pagedllm:num_requests_running") == 4 or refused, 30)
        assert not refused, refused
        assert running, remote.log()[-3000:]
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        for thread in streams:
            thread.join(10)
        assert len(endings) == 4
        assert all("error" in json.loads(line[len("data: "):]) for line in endings)
        assert remote.proc.wait(10) == 1
        assert time.monotonic() - killed < 5.0
        assert wait_for(lambda: gone(other), 5)
    finally:
        remote.stop()


def test_sigterm_lets_every_process_finish_its_streams_then_exits_0(server_model_dir, tmp_path):
    remote = RemoteServer(server_model_dir, tmp_path / "server.log", "--api-server-count", "2",
                          "--shutdown-timeout", "60")
    try:
        endings: list[dict] = []

        def stream() -> None:
            with httpx.Client(base_url=remote.base_url, timeout=60) as c:
                # Long enough that none can finish before the six are running together.
                with c.stream("POST", "/v1/completions", json={
                        **PROMPT, "max_tokens": 800, "stream": True}) as response:
                    lines = [line for line in response.iter_lines() if line]
            endings.append({"last": lines[-1], "finish": json.loads(lines[-2][6:])})

        streams = [threading.Thread(target=stream) for _ in range(6)]
        for thread in streams:
            thread.start()
        running = wait_for(lambda: remote.metric("pagedllm:num_requests_running") == 6, 30)
        assert running, (endings, remote.log()[-3000:])
        remote.proc.send_signal(signal.SIGTERM)
        for thread in streams:
            thread.join(60)
        assert len(endings) == 6
        assert all(e["last"] == "data: [DONE]" and e["finish"]["choices"][0]["finish_reason"]
                   == "length" for e in endings)
        assert remote.proc.wait(30) == 0
    finally:
        remote.stop()


def test_a_dead_api_process_stops_the_server_and_the_core(server_model_dir, tmp_path):
    remote = RemoteServer(server_model_dir, tmp_path / "server.log", "--api-server-count", "2")
    try:
        core, other = spawned_children(remote.proc.pid)
        os.kill(other, signal.SIGKILL)
        assert remote.proc.wait(10) == 1
        assert wait_for(lambda: gone(core), 10)
        assert re.search(r"API server process pagedllm-api-server-1 exited with code -9",
                         remote.log())
    finally:
        remote.stop()


def _observe(directory: str, tokens: int, done) -> None:
    metrics = ServerMetrics("m", multiprocess_dir=directory)
    metrics.on_first_token(num_prompt_tokens=10, ttft_s=0.5)
    metrics.on_new_tokens(tokens)
    metrics.on_sequence_finished("length")
    done.set()


def test_metrics_of_several_processes_add_up_in_any_process(tmp_path, monkeypatch):
    # This process reads the files too: its prometheus_client setting is put back after.
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    context = multiprocessing.get_context("spawn")
    done = [context.Event(), context.Event()]
    workers = [context.Process(target=_observe, args=(str(tmp_path), tokens, event))
               for tokens, event in zip((3, 4), done)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert all(event.is_set() for event in done)
    metrics = ServerMetrics("m", multiprocess_dir=str(tmp_path))
    metrics.on_new_tokens(5)
    text = metrics.render()[0].decode()
    assert 'pagedllm:generation_tokens_total{model_name="m"} 12.0' in text
    assert 'pagedllm:prompt_tokens_total{model_name="m"} 20.0' in text
    assert 'pagedllm:request_success_total{finished_reason="length",model_name="m"} 2.0' in text
    assert 'pagedllm:time_to_first_token_seconds_count{model_name="m"} 2.0' in text
    assert metrics.token_totals() == (20.0, 12.0)
