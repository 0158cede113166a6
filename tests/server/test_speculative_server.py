"""A server with speculative decoding answers as one without it (JSON-schema output too),
streams accepted runs, and reports acceptance in /metrics (under vLLM's names too) and in
its stats line."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import MODEL_NAME, started_server, wait_for
from tests.spec_decode.conftest import repetitive_prompts


def test_ngram_speculation_serves_the_same_tokens_and_reports_acceptance(
    server, server_model_dir, tmp_path_factory
):
    # Token ids that repeat spans of themselves: the tiny model's greedy output repeats
    # parts of them, so n-gram lookup finds proposals it accepts.
    body = {"model": MODEL_NAME, "prompt": repetitive_prompts(4, seed=1)[1], "max_tokens": 40,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    chat = {"model": MODEL_NAME, "max_tokens": 80, "temperature": 0,
            "messages": [{"role": "user", "content": "Plan a trip as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "trip", "schema": schema, "strict": True}}}
    with httpx.Client(base_url=server.base_url, timeout=60) as plain:
        want = plain.post("/v1/completions", json=body).json()["choices"][0]
        want_json = plain.post("/v1/chat/completions", json=chat).json()["choices"][0]
    with started_server(server_model_dir, tmp_path_factory, "speculative",
                        "--speculative-method", "ngram", "--num-speculative-tokens", "4",
                        "--log-stats-interval", "0.5", "--metrics-compat", "vllm") as remote:
        with httpx.Client(base_url=remote.base_url, timeout=60) as c:
            got = c.post("/v1/completions", json=body).json()["choices"][0]
            got_json = c.post("/v1/chat/completions", json=chat).json()["choices"][0]
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                chunks = [line[len("data: "):] for line in stream.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
        assert (got["token_ids"], got["text"]) == (want["token_ids"], want["text"])
        assert got_json["message"]["content"] == want_json["message"]["content"]
        assert set(json.loads(got_json["message"]["content"])) == {"city", "days"}
        streamed = "".join(json.loads(chunk)["choices"][0]["text"] for chunk in chunks)
        assert streamed == want["text"]
        drafts = remote.metric("pagedllm:spec_decode_num_drafts_total")
        accepted = remote.metric("pagedllm:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and accepted > 0
        assert remote.metric("pagedllm:spec_decode_num_draft_tokens_total") >= accepted
        assert remote.metric("pagedllm:spec_decode_num_accepted_tokens_per_pos_total",
                             position="0") > 0
        # vLLM's dashboards read the same counters under vLLM's names.
        assert remote.metric("vllm:spec_decode_num_drafts_total") == drafts
        assert remote.metric("vllm:spec_decode_num_accepted_tokens_total") == accepted
        assert remote.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                             position="0") > 0
        assert wait_for(lambda: "Speculative acceptance rate: " in remote.log(), timeout=10)
