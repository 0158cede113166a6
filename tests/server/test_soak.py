"""A soak run against a live server: many requests mixing streaming and non-streaming,
completions and chat, ``n > 1``, stop strings and seeds, with about a fifth of the clients
going away at a random point (a stream closed mid-way, a non-streaming request dropped
before its answer). Afterwards the server holds nothing: no KV block in use, no running or
waiting request, no request state in the API process, and its memory grew by less than
``RSS_GROWTH_BOUND_MB``; every answer that completed is well-formed.

The default run is 1,000 requests (about a minute on two cores);
``PAGEDLLM_SOAK_REQUESTS=10000`` runs the long one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import httpx

from tests.server.conftest import MODEL_NAME, started_server, wait_for

NUM_REQUESTS = int(os.environ.get("PAGEDLLM_SOAK_REQUESTS", "1000"))
CONCURRENCY = 16
DISCONNECT_FRACTION = 0.2
RSS_GROWTH_BOUND_MB = 64.0
STOPS = ["\n", "e", "th", "ab", "zz"]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def random_body(rng: random.Random) -> tuple[str, dict]:
    n = rng.choice([1, 1, 1, 2, 3])
    fields = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 24), "n": n,
              "temperature": rng.choice([0.0, 0.8, 1.0]), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        fields["seed"] = rng.randint(0, 1000)
    if rng.random() < 0.4:
        fields["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if fields["stream"] and rng.random() < 0.5:
        fields["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/completions", {**fields, "prompt": "def f(x):" * rng.randint(1, 20)}
    return "/v1/chat/completions", {
        **fields, "messages": [{"role": "user", "content": "hello " * rng.randint(1, 30)}]}


def check_full(path: str, body: dict, response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    data = response.json()
    assert len(data["choices"]) == body["n"]
    assert sorted(c["index"] for c in data["choices"]) == list(range(body["n"]))
    for choice in data["choices"]:
        assert choice["finish_reason"] in ("stop", "length")
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        assert isinstance(text, str)
    assert 1 <= data["usage"]["completion_tokens"] <= body["n"] * body["max_tokens"]


def check_stream(body: dict, lines: list[str]) -> None:
    assert lines[-1] == "data: [DONE]"
    finished = set()
    for line in lines[:-1]:
        assert line.startswith("data: ")
        chunk = json.loads(line[len("data: "):])
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            if choice["finish_reason"] is not None:
                finished.add(choice["index"])
    assert finished == set(range(body["n"]))


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: dict) -> None:
    path, body = random_body(rng)
    leave = rng.random() < DISCONNECT_FRACTION
    if not body["stream"]:
        if leave:
            try:
                response = await asyncio.wait_for(client.post(path, json=body),
                                                  rng.uniform(0.0, 0.2))
            except asyncio.TimeoutError:
                tally["dropped"] += 1
                return
            check_full(path, body, response)  # answered before the client would leave
            tally["completed"] += 1
            return
        check_full(path, body, await client.post(path, json=body))
        tally["completed"] += 1
        return
    leave_after = rng.randint(0, 6) if leave else None
    lines = []
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                continue
            lines.append(line)
            if leave_after is not None and len(lines) > leave_after:
                tally["dropped"] += 1
                return  # closes the connection mid-stream
    check_stream(body, lines)
    tally["completed"] += 1


async def soak(base_url: str, num_requests: int, seed: int) -> dict:
    rng = random.Random(seed)
    tally = {"completed": 0, "dropped": 0}
    queue = list(range(num_requests))
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        async def worker() -> None:
            while queue:
                queue.pop()
                await one_request(client, rng, tally)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return tally


def held(remote) -> tuple[float, ...]:
    return tuple(remote.metric(name) for name in (
        "pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
        "pagedllm:kv_cache_usage_perc", "pagedllm:api_server_requests"))


def test_soak_leaves_no_blocks_no_state_and_bounded_memory(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "soak-server",
                        "--disable-log-stats") as remote:
        asyncio.run(soak(remote.base_url, 50, seed=1))  # warm-up: lazy imports, caches
        assert wait_for(lambda: held(remote) == (0.0, 0.0, 0.0, 0.0), 30), held(remote)
        before = rss_mb(remote.proc.pid)
        tally = asyncio.run(soak(remote.base_url, NUM_REQUESTS, seed=2))
        assert wait_for(lambda: held(remote) == (0.0, 0.0, 0.0, 0.0), 30), held(remote)
        after = rss_mb(remote.proc.pid)
        assert tally["completed"] + tally["dropped"] == NUM_REQUESTS
        assert tally["dropped"] >= 0.1 * NUM_REQUESTS, tally
        assert after - before < RSS_GROWTH_BOUND_MB, (before, after)
        assert remote.metric("pagedllm:request_success_total", finished_reason="abort") > 0
        assert httpx.get(f"{remote.base_url}/health").status_code == 200
        assert "Traceback" not in remote.log()
