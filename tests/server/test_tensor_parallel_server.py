"""``pagedllm serve --tensor-parallel-size 2``: the OpenAI client gets the same greedy text
as the offline engine on one rank; a rank that dies fails the in-flight request, turns /health red and
makes the server exit non-zero, within seconds."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai

from pagedllm import LLM, SamplingParams
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, RemoteServer, wait_for
from tests.server.test_engine_failure import engine_core_pid


def rank_pids(core_pid: int) -> list[int]:
    children = Path(f"/proc/{core_pid}/task/{core_pid}/children").read_text().split()
    return [int(pid) for pid in children
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_tp2_server_answers_then_fails_loudly_when_a_rank_dies(server_model_dir, tmp_path):
    request = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=0)
    one = LLM(str(server_model_dir), max_model_len=MAX_MODEL_LEN)
    want = one.generate(request["prompt"], SamplingParams(max_tokens=12, temperature=0),
                        use_tqdm=False)[0].outputs[0].text
    remote = RemoteServer(server_model_dir, tmp_path / "tp2.log", "--tensor-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=remote.api_url, api_key="x")
        assert client.completions.create(**request).choices[0].text == want
        result = {}

        def long_request() -> None:
            with httpx.Client(base_url=remote.base_url, timeout=60) as c:
                response = c.post("/v1/completions", json={**request, "max_tokens": 1000, "n": 4,
                                                           "ignore_eos": True})
                result["status"] = response.status_code

        thread = threading.Thread(target=long_request)
        thread.start()
        assert wait_for(lambda: remote.metric("pagedllm:num_requests_running") >= 1, 20)
        ranks = rank_pids(engine_core_pid(remote.proc.pid))
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        thread.join(15)
        assert result.get("status") == 500
        assert remote.proc.wait(15) != 0
        assert time.monotonic() - killed < 15
        assert "rank 1 " in remote.log()
    finally:
        remote.stop()
