"""``pagedllm bench serve``: load a running server and measure what its users feel.

    pagedllm serve &                                   # or any OpenAI-compatible server
    pagedllm bench serve --num-prompts 200 --input-len 128 --output-len 128 --request-rate 4

Prompts are random token ids of exactly ``--input-len`` tokens, drawn from the ids the
server's own tokenizer gives a seeded random text (``POST /tokenize``; or uniformly from
``[0, --vocab-size)`` for a server in token-id mode), sent as token-id prompts to
``/v1/completions`` with ``ignore_eos`` so each produces exactly ``--output-len`` tokens. Requests arrive as a Poisson process at ``--request-rate`` per
second (``inf``: all at once), at most ``--max-concurrency`` in flight.

Per request, from the streamed response: TTFT (request sent -> first token chunk), ITL
(gaps between token chunks), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end
latency. Reported: request and token throughput, and mean / median / p99 of each latency
(milliseconds; the record also holds p95). ``--output-json`` saves the record.

``--prefix-len N`` starts every prompt with the same N token ids (a shared system prompt);
the record then adds the server's prefix-cache queries and hits over the run (read from
``/metrics`` before and after, when the server exports pagedllm's counters) and the share
of the shared-prefix tokens served from the cache.

``--structured-output json`` constrains request ``i`` to JSON schema ``i % 4`` of
``structured_workload.py`` (OpenAI's ``response_format``); the schemas cannot complete
before the output length, so the token counts stay those of the unconstrained workload.

The client runs on uvloop where it is installed (as the server does), so that on a fast
engine its own event loop is not the limit of what it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np

from pagedllm.benchmarks.common import parse_range, reported_seconds, result_record, write_json
from pagedllm.benchmarks.structured_workload import SCHEMAS
from pagedllm.entrypoints import event_loop

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
          "which but have an they you were her she there one all we their can has more when will "
          "would if been what about into other them some these two may then do first any like "
          "time only new could out also over made such after most years where system engine "
          "block cache token request model batch memory queue prefix attention kernel server "
          "def return class import print value list dict self none true false range len").split()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None,
                        help="Server root, e.g. http://127.0.0.1:8000 (default: from --host/--port).")
    parser.add_argument("--host", default="127.0.0.1", help="The server's host.")
    parser.add_argument("--port", type=int, default=8000, help="The server's port.")
    parser.add_argument("--model", default=None, help="Model name (default: the server's first).")
    parser.add_argument("--api-key", default=None,
                        help="Sent as 'Authorization: Bearer KEY' (default: no key).")
    parser.add_argument("--num-prompts", type=int, default=200, help="Requests to send.")
    parser.add_argument("--input-len", type=parse_range, default="128",
                        help="Prompt tokens, 'LOW:HIGH' (uniform) or one number.")
    parser.add_argument("--output-len", type=parse_range, default="128",
                        help="Output tokens, 'LOW:HIGH' (uniform) or one number.")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Mean requests per second of the Poisson arrivals (default: inf, all at once).")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="Most requests in flight at once (default: no limit).")
    parser.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature.")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="Generate exactly the output length (default on).")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="Draw prompt ids uniformly from [0, N), for a server in token-id "
                             "mode, which has no /tokenize (default: ids of the server's "
                             "tokenizer).")
    parser.add_argument("--seed", type=int, default=0,
                        help="Seed of the prompts and the arrival times.")
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="Token ids every prompt starts with (a shared prefix; default 0).")
    parser.add_argument("--structured-output", choices=("none", "json"), default="none",
                        help="json: every request constrained to a JSON schema "
                             "(response_format json_schema).")
    parser.add_argument("--output-json", default=None, help="Write the result record here.")


_JSON = {"Content-Type": "application/json"}


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}.")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}.")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ValueError(f"--vocab-size must be >= 1, got {args.vocab_size}.")


def _aiohttp():
    try:
        import aiohttp
    except ImportError:
        raise ValueError("pagedllm bench serve needs aiohttp: pip install 'pagedllm[bench]'.") from None
    return aiohttp


async def _token_pool(client, base_url: str, model: str, seed: int) -> list[int]:
    """Distinct token ids the server's tokenizer produces for ordinary text."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(_WORDS) for _ in range(2000))
    async with client.post(f"{base_url}/tokenize", json={
            "model": model, "prompt": text, "add_special_tokens": False}) as response:
        if response.status == 400:
            raise ValueError(f"The server cannot tokenize ({(await response.json())['error']['message']}): "
                             "pass --vocab-size N, the model's vocabulary size.")
        response.raise_for_status()
        pool = sorted(set((await response.json())["tokens"]))
    if not pool:
        raise ValueError("The server's /tokenize returned no tokens; cannot build prompts.")
    return pool


async def _one_request(client, url: str, body: bytes, prompt_len: int) -> RequestResult:
    result = RequestResult(ok=False, prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    try:
        async with client.post(url, data=body, headers=_JSON) as response:
            if response.status != 200:
                body = await response.read()
                result.error = f"HTTP {response.status}: {body[:200]!r}"
                return result
            async for line in response.content:  # one line each, C-parsed
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):].rstrip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
        result.latency_s = time.perf_counter() - start
        result.ok = result.ttft_s > 0.0
        if not result.ok:
            result.error = "the stream ended without a token"
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "median": None, "p95": None, "p99": None}
    array = np.asarray(values) * scale
    return {"mean": round(float(array.mean()), 3), "median": round(float(np.median(array)), 3),
            "p95": round(float(np.percentile(array, 95)), 3),
            "p99": round(float(np.percentile(array, 99)), 3)}


async def benchmark(args: argparse.Namespace) -> dict:
    aiohttp = _aiohttp()
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)  # no cap on connections
    async with aiohttp.ClientSession(connector=connector, headers=headers, read_bufsize=2**20,
                                     timeout=aiohttp.ClientTimeout(total=None, connect=30.0)) as client:
        async with client.get(f"{base_url}/v1/models") as models:
            models.raise_for_status()
            model = args.model or (await models.json())["data"][0]["id"]
        if args.vocab_size is not None:
            pool = list(range(args.vocab_size))
        else:
            pool = await _token_pool(client, base_url, model, args.seed)

        rng = random.Random(args.seed)
        prefix = [rng.choice(pool) for _ in range(args.prefix_len)]
        work = []
        for _ in range(args.num_prompts):
            prompt_len = rng.randint(*args.input_len)
            work.append((prefix + [rng.choice(pool) for _ in range(prompt_len)],
                         rng.randint(*args.output_len)))
        url = f"{base_url}/v1/completions"

        def payload(prompt: list[int], output_len: int, index: int = 0) -> bytes:
            body = {"model": model, "prompt": prompt, "max_tokens": output_len,
                    "temperature": args.temperature, "ignore_eos": args.ignore_eos,
                    "stream": True, "stream_options": {"include_usage": True}}
            if args.structured_output == "json":
                name, schema = schemas[index % len(schemas)]
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": name, "schema": schema}}
            return json.dumps(body).encode()

        schemas = list(SCHEMAS.items())
        warmup = await _one_request(client, url, payload(work[0][0], 4), len(work[0][0]))
        if not warmup.ok:
            raise ValueError(f"The warm-up request failed: {warmup.error}")

        semaphore = asyncio.Semaphore(args.max_concurrency or len(work))

        # Bodies are encoded before the clock starts: the run times the server, not json.
        bodies = [payload(prompt, output_len, index)
                  for index, (prompt, output_len) in enumerate(work)]

        async def limited(body: bytes, prompt_len: int) -> RequestResult:
            async with semaphore:
                return await _one_request(client, url, body, prompt_len)

        print(f"Model {model}: {args.num_prompts} requests, request rate {args.request_rate}, "
              f"max concurrency {args.max_concurrency or 'unlimited'}")
        arrivals = random.Random(args.seed + 1)
        tasks = []
        cache_before = await _prefix_cache_counters(client, base_url)
        start_time = time.time()
        start = time.perf_counter()
        for body, (prompt, _) in zip(bodies, work):
            tasks.append(asyncio.create_task(limited(body, len(prompt))))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(arrivals.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cache_after = await _prefix_cache_counters(client, base_url)
    cache = None
    if cache_before is not None and cache_after is not None:
        cache = tuple(after - before for before, after in zip(cache_before, cache_after))
    return summarize(args, model, results, duration, cache, start_time)


async def _prefix_cache_counters(client, base_url: str) -> tuple[float, float] | None:
    """pagedllm's (prefix-cache queries, hits) totals from ``/metrics``; None when the
    server does not export them."""
    try:
        async with client.get(f"{base_url}/metrics") as response:
            if response.status != 200:
                return None
            text = await response.text()
    except Exception:  # noqa: BLE001 - a server without /metrics
        return None
    totals = {"pagedllm:prefix_cache_queries_total": 0.0, "pagedllm:prefix_cache_hits_total": 0.0}
    found = set()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
            found.add(name)
    if len(found) < 2:
        return None
    return totals["pagedllm:prefix_cache_queries_total"], totals["pagedllm:prefix_cache_hits_total"]


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float,
              cache: tuple[float, float] | None = None, start_time: float | None = None) -> dict:
    """The record of a run; ``cache``: the server's prefix-cache (queries, hits) during it;
    ``start_time``: when the first request was sent (Unix seconds)."""
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    failures = [r.error for r in results if not r.ok]
    duration = reported_seconds(duration)
    return result_record(
        workload="serve", model=model, num_prompts=args.num_prompts,
        input_len=list(args.input_len), output_len=list(args.output_len),
        request_rate=None if math.isinf(args.request_rate) else args.request_rate,
        max_concurrency=args.max_concurrency, structured_output=args.structured_output,
        duration_s=duration, start_time=start_time,
        completed=len(ok), failed=len(failures), first_errors=failures[:3],
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=round(len(ok) / duration, 3),
        output_throughput=round(output_tokens / duration, 2),
        total_token_throughput=round((input_tokens + output_tokens) / duration, 2),
        ttft_ms=_stats([r.ttft_s for r in ok]), tpot_ms=_stats(tpots),
        itl_ms=_stats([gap for r in ok for gap in r.itl_s]),
        e2e_latency_ms=_stats([r.latency_s for r in ok]),
        **_prefix_figures(args.prefix_len, len(ok), cache),
    )


def _prefix_figures(prefix_len: int, completed: int, cache: tuple[float, float] | None) -> dict:
    """The shared prefix's share of the server's prefix-cache hits (when it was read)."""
    figures: dict = {"prefix_len": prefix_len}
    if cache is not None:
        queries, hits = cache
        figures.update(prefix_cache_queries=int(queries), prefix_cache_hits=int(hits),
                       prefix_cache_hit_rate=round(hits / queries, 4) if queries else None)
        if prefix_len:
            figures["shared_prefix_cached_share"] = round(hits / (prefix_len * completed), 4)
    return figures


def _print(record: dict) -> None:
    print(f"{'completed / failed':<28} {record['completed']} / {record['failed']}")
    for error in record["first_errors"]:
        print(f"  error: {error}")
    print(f"{'duration (s)':<28} {record['duration_s']}")
    print(f"{'request throughput (req/s)':<28} {record['request_throughput']}")
    print(f"{'output throughput (tok/s)':<28} {record['output_throughput']}")
    if record.get("prefix_cache_hit_rate") is not None:
        shared = record.get("shared_prefix_cached_share")
        print(f"{'prefix-cache hit rate':<28} {record['prefix_cache_hit_rate']}"
              + (f" (shared prefix from the cache: {shared})" if shared is not None else ""))
    print(f"{'total throughput (tok/s)':<28} {record['total_token_throughput']}")
    print(f"{'':<28} {'mean':>10} {'median':>10} {'p99':>10}")
    for key, name in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
                      ("e2e_latency_ms", "E2E latency (ms)")):
        s = record[key]
        cells = ["-" if s[k] is None else f"{s[k]:.2f}" for k in ("mean", "median", "p99")]
        print(f"{name:<28} {cells[0]:>10} {cells[1]:>10} {cells[2]:>10}")


def run(args: argparse.Namespace) -> dict:
    _check_args(args)
    record = event_loop.run(benchmark(args))
    _print(record)
    write_json(args.output_json, record)
    return record
