"""``pagedllm bench serve`` against the session's server: every request measured."""

from __future__ import annotations

import argparse
import asyncio
import json

from pagedllm.benchmarks import serve as bench_serve


def test_bench_serve_reports_exact_token_counts_and_latencies(server, tmp_path):
    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    out = tmp_path / "serve.json"
    args = parser.parse_args(["--port", str(server.port), "--num-prompts", "6", "--input-len", "16",
                              "--output-len", "5", "--request-rate", "50", "--max-concurrency", "3",
                              "--output-json", str(out)])
    record = bench_serve.run(args)
    assert record["completed"] == 6 and record["failed"] == 0
    assert record["total_input_tokens"] == 6 * 16
    assert record["total_output_tokens"] == 6 * 5
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        stats = record[key]
        assert 0 < stats["median"] <= stats["p99"]
    assert record["ttft_ms"]["mean"] < record["e2e_latency_ms"]["mean"]
    assert json.loads(out.read_text())["completed"] == 6


def test_bench_serve_counts_requests_the_server_refuses(server):
    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    # The 4-token warm-up fits the 1024-token context; 1015 + 16 tokens do not.
    args = parser.parse_args(["--port", str(server.port), "--num-prompts", "2",
                              "--input-len", "1015", "--output-len", "16"])
    record = asyncio.run(bench_serve.benchmark(args))
    assert record["completed"] == 0 and record["failed"] == 2
    assert "HTTP 400" in record["first_errors"][0]


def test_bench_serve_with_every_request_constrained_to_a_json_schema(server):
    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    args = parser.parse_args(["--port", str(server.port), "--num-prompts", "8", "--input-len", "16",
                              "--output-len", "40", "--temperature", "1",
                              "--structured-output", "json"])
    record = asyncio.run(bench_serve.benchmark(args))
    assert record["completed"] == 8 and record["failed"] == 0
    assert record["total_output_tokens"] == 8 * 40  # the schemas never complete early
    assert record["structured_output"] == "json"


def test_bench_serve_shared_prefix_comes_from_the_prefix_cache(server):
    """A 64-token prefix ahead of every prompt: the server's own counters show (nearly) all
    of it served from the cache, and the record says so."""
    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    args = parser.parse_args(["--port", str(server.port), "--num-prompts", "8", "--input-len", "16",
                              "--output-len", "2", "--prefix-len", "64", "--max-concurrency", "1"])
    record = asyncio.run(bench_serve.benchmark(args))
    assert record["completed"] == 8 and record["prefix_len"] == 64
    assert record["total_input_tokens"] == 8 * (64 + 16)
    assert record["prefix_cache_queries"] >= 8 * (64 + 16) - 8  # the last token is never looked up
    assert record["shared_prefix_cached_share"] >= 0.95
