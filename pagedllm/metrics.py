"""Prometheus metrics of the server and the periodic stats log line.

Every metric lives in the API processes (the core sends a ``SchedulerStats`` snapshot with
each step to each of them). With one API process, a plain registry; with several
(``--api-server-count``), the counters and histograms each process observes are written
to files in a directory they share (Prometheus's multiprocess mode) and every scrape, in
whichever process, sums them, while the gauges of the core's snapshot are the same in all.
Names follow vLLM's, with a ``model_name`` label on all of them::

    pagedllm:num_requests_running            gauge    core requests in the running batch
    pagedllm:num_requests_waiting            gauge    core requests queued or preempted
    pagedllm:num_requests_waiting_for_grammar gauge   of those, requests whose output
                                                      constraint is still compiling
    pagedllm:kv_cache_usage_perc             gauge    fraction (0..1) of KV blocks in use
    pagedllm:kv_cache_capacity_tokens        gauge    tokens the KV cache holds (blocks x
                                                      block size), labelled with its
                                                      cache_dtype and block_size; absent
                                                      until the engine is ready
    pagedllm:prefix_cache_queries_total      counter  prompt tokens looked up in the prefix cache
    pagedllm:prefix_cache_hits_total         counter  of those, tokens found
    pagedllm:num_preemptions_total           counter  preemptions (recompute or swap)
    pagedllm:num_preempted_tokens_total      counter  computed tokens those preemptions dropped
                                                      (computed again when the requests resume)
    pagedllm:num_swapped_tokens_total        counter  computed tokens they swapped out to host
                                                      memory instead (--swap-space)
    pagedllm:num_requests_rejected_total     counter  requests refused with a 503 because the
                                                      waiting queue was full (--max-num-waiting)
    pagedllm:api_server_requests             gauge    user requests the API processes hold any
                                                      state of (streams, detokenizers, deadlines);
                                                      0 when none is open (with several
                                                      processes, each one's count as of its
                                                      last refresh, summed)
    pagedllm:prompt_tokens_total             counter  prompt tokens of requests that got a first token
    pagedllm:generation_tokens_total         counter  tokens generated
    pagedllm:request_success_total           counter  finished sequences, by finished_reason
                                                      (stop | length | abort)
    pagedllm:time_to_first_token_seconds     histogram arrival (HTTP request parsed) -> first token
    pagedllm:time_per_output_token_seconds   histogram per request: (finish - first token) / (tokens - 1)
    pagedllm:e2e_request_latency_seconds     histogram arrival -> last token
    pagedllm:request_queue_time_seconds      histogram per core request: arrival -> first scheduled

With speculative decoding (absent otherwise)::

    pagedllm:spec_decode_num_drafts_total             counter  request-steps that verified proposals
    pagedllm:spec_decode_num_draft_tokens_total       counter  tokens proposed in them
    pagedllm:spec_decode_num_accepted_tokens_total    counter  of those, tokens accepted
    pagedllm:spec_decode_num_accepted_tokens_per_pos_total
                                             counter  accepted tokens by position in the
                                                      draft (label position, 0-based)

acceptance rate = accepted / draft tokens; mean accepted length (tokens a verifying step
yields) = 1 + accepted / drafts. The stats line shows both over its interval.

Gauges and the core's totals are read from the latest snapshot at scrape time (a custom
collector), so they can never drift from the scheduler. All times are seconds of
``time.monotonic()``.

``--metrics-compat vllm`` also exports the series of ``VLLM_NAMES`` under vLLM's names, with
the same labels and values, so dashboards, alerts and autoscaling rules written for vLLM
work unchanged (``pagedllm:kv_cache_usage_perc`` is both ``vllm:kv_cache_usage_perc`` and
the older ``vllm:gpu_cache_usage_perc``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics,
    multiprocess, values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from pagedllm.core.outputs import SchedulerStats, SpecDecodingStats

logger = logging.getLogger(__name__)

FINISHED_REASONS = ("stop", "length", "abort")

# Family names (counters without ``_total``) -> their vLLM names under --metrics-compat vllm.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "pagedllm:num_requests_running": ("vllm:num_requests_running",),
    "pagedllm:num_requests_waiting": ("vllm:num_requests_waiting",),
    "pagedllm:kv_cache_usage_perc": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
    "pagedllm:prompt_tokens": ("vllm:prompt_tokens",),
    "pagedllm:generation_tokens": ("vllm:generation_tokens",),
    "pagedllm:request_success": ("vllm:request_success",),
    "pagedllm:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "pagedllm:time_per_output_token_seconds": ("vllm:time_per_output_token_seconds",),
    "pagedllm:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "pagedllm:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "pagedllm:num_preemptions": ("vllm:num_preemptions",),
    "pagedllm:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "pagedllm:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "pagedllm:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "pagedllm:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "pagedllm:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "pagedllm:spec_decode_num_accepted_tokens_per_pos": (
        "vllm:spec_decode_num_accepted_tokens_per_pos",),
}
METRICS_COMPAT_CHOICES = ("vllm",)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _SchedulerCollector:
    """Exposes the latest ``SchedulerStats`` snapshot at scrape time."""

    def __init__(self, metrics: "ServerMetrics") -> None:
        self.metrics = metrics

    def collect(self):
        stats = self.metrics.scheduler_stats
        labels = ["model_name"]
        values = [self.metrics.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("pagedllm:num_requests_running", "Requests in the running batch.",
                    stats.num_running if stats else 0)
        yield gauge("pagedllm:num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).",
                    stats.num_waiting if stats else 0)
        yield gauge("pagedllm:num_requests_waiting_for_grammar",
                    "Waiting requests whose output constraint is still compiling.",
                    stats.num_waiting_for_grammar if stats else 0)
        yield gauge("pagedllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use, 0..1.",
                    stats.kv_cache_usage if stats else 0.0)
        cache = self.metrics.kv_cache
        if cache is not None:
            family = GaugeMetricFamily(
                "pagedllm:kv_cache_capacity_tokens",
                "Tokens the KV cache holds (blocks x block size), by element type.",
                labels=[*labels, "cache_dtype", "block_size"])
            family.add_metric([*values, cache.dtype, str(cache.block_size)],
                              cache.num_blocks * cache.block_size)
            yield family
        yield counter("pagedllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries if stats else 0)
        yield counter("pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits if stats else 0)
        yield counter("pagedllm:num_preemptions",
                      "Requests preempted (recomputed, or swapped out to host memory).",
                      stats.num_preemptions if stats else 0)
        yield counter("pagedllm:num_preempted_tokens",
                      "Computed tokens preemptions dropped (computed again on resuming).",
                      stats.num_preempted_tokens if stats else 0)
        yield counter("pagedllm:num_swapped_tokens",
                      "Computed tokens preemptions swapped out to host memory (copied back "
                      "on resuming).", stats.num_swapped_tokens if stats else 0)
        spec = stats.spec_decoding if stats else None
        if spec is not None:
            yield counter("pagedllm:spec_decode_num_drafts",
                          "Request-steps that verified proposed tokens.", spec.num_drafts)
            yield counter("pagedllm:spec_decode_num_draft_tokens",
                          "Tokens proposed for verification.", spec.num_draft_tokens)
            yield counter("pagedllm:spec_decode_num_accepted_tokens",
                          "Proposed tokens accepted.", spec.num_accepted_tokens)
            family = CounterMetricFamily(
                "pagedllm:spec_decode_num_accepted_tokens_per_pos",
                "Proposed tokens accepted, by their position in the draft (0-based).",
                labels=[*labels, "position"])
            for position, accepted in enumerate(spec.accepted_per_position):
                family.add_metric([*values, str(position)], accepted)
            yield family
        if self.metrics.multiprocess_dir is not None:
            return  # the processes' counts, summed from their files
        tracked = self.metrics.tracked_requests
        yield gauge("pagedllm:api_server_requests",
                    "User requests the API process holds any state of.",
                    tracked() if tracked is not None else 0)


class _RenamedCollector:
    """The families of ``sources`` named in ``names`` again under each of their new names
    (samples renamed, labels and values kept); other families are left out."""

    def __init__(self, sources: list, names: dict[str, tuple[str, ...]]) -> None:
        self.sources = sources
        self.names = names

    def collect(self):
        for source in self.sources:
            for family in source.collect():
                for new_name in self.names.get(family.name, ()):
                    renamed = Metric(new_name, family.documentation, family.type, family.unit)
                    renamed.samples = [
                        sample._replace(name=new_name + sample.name[len(family.name):])
                        for sample in family.samples
                    ]
                    yield renamed


@dataclass(frozen=True)
class KVCacheShape:
    """The engine's KV cache as the core reported it at start."""

    dtype: str  # element type, e.g. "bfloat16" or "float8_e4m3fn"
    num_blocks: int
    block_size: int  # tokens per block


class ServerMetrics:
    """The server's metrics registry, fed by the async engine.

    ``compat``: None, or ``"vllm"`` to also export ``VLLM_NAMES``; ``multiprocess_dir``: the
    directory the API processes share when there are several (None: one process)."""

    def __init__(self, model_name: str, compat: str | None = None,
                 multiprocess_dir: str | None = None) -> None:
        if compat not in (None, *METRICS_COMPAT_CHOICES):
            raise ValueError(f"Unknown metrics compatibility {compat!r}: choose one of "
                             f"{', '.join(METRICS_COMPAT_CHOICES)}.")
        # ``*_created`` series only add noise to a single long-lived server process.
        disable_created_metrics()
        self.model_name = model_name
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        # The metrics themselves: in the registry, or (several processes) in the files.
        metric_registry: CollectorRegistry | None = self.registry
        self._files: multiprocess.MultiProcessCollector | None = None
        if multiprocess_dir is None:
            ProcessCollector(registry=self.registry)
        else:
            # prometheus_client picks its value store from this variable; our metrics are
            # built below, after it is set.
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiprocess_dir
            values.ValueClass = values.get_value_class()
            self._files = multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)
            metric_registry = None
        self.scheduler_stats: SchedulerStats | None = None
        # Set once the engine is ready (``on_engine_ready``).
        self.kv_cache: KVCacheShape | None = None
        # Set by the engine: how many user requests the API process holds state of.
        self.tracked_requests: Callable[[], int] | None = None
        scheduler_collector = _SchedulerCollector(self)
        self.registry.register(scheduler_collector)
        # Plain totals too, for the log line's rates.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

        labels = ["model_name"]
        prompt_tokens = Counter("pagedllm:prompt_tokens", "Prompt tokens processed.", labels,
                                registry=metric_registry)
        generation_tokens = Counter("pagedllm:generation_tokens", "Tokens generated.", labels,
                                    registry=metric_registry)
        success = Counter(
            "pagedllm:request_success", "Finished sequences, by finished_reason.",
            ["model_name", "finished_reason"], registry=metric_registry,
        )
        ttft = Histogram(
            "pagedllm:time_to_first_token_seconds", "Time to first token, seconds.", labels,
            buckets=_TTFT_BUCKETS, registry=metric_registry,
        )
        tpot = Histogram(
            "pagedllm:time_per_output_token_seconds",
            "Mean time per output token after the first, per request, seconds.", labels,
            buckets=_TPOT_BUCKETS, registry=metric_registry,
        )
        rejected = Counter(
            "pagedllm:num_requests_rejected",
            "Requests refused with a 503 because the waiting queue was full.", labels,
            registry=metric_registry,
        )
        e2e = Histogram(
            "pagedllm:e2e_request_latency_seconds", "End-to-end request latency, seconds.", labels,
            buckets=_LATENCY_BUCKETS, registry=metric_registry,
        )
        queue = Histogram(
            "pagedllm:request_queue_time_seconds",
            "Time from arrival to first scheduling, seconds.", labels,
            buckets=_LATENCY_BUCKETS, registry=metric_registry,
        )
        self._tracked_gauge = None
        if multiprocess_dir is not None:
            self._tracked_gauge = Gauge(
                "pagedllm:api_server_requests", "User requests the API processes hold any state of.",
                labels, registry=None, multiprocess_mode="livesum").labels(model_name)
        self._prompt_tokens = prompt_tokens.labels(model_name)
        self._generation_tokens = generation_tokens.labels(model_name)
        self._success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self._ttft = ttft.labels(model_name)
        self._tpot = tpot.labels(model_name)
        self._e2e = e2e.labels(model_name)
        self._rejected = rejected.labels(model_name)
        self._queue = queue.labels(model_name)
        if compat == "vllm":
            sources = [scheduler_collector, *([self._files] if self._files is not None else
                                              [prompt_tokens, generation_tokens, success, ttft,
                                               tpot, e2e, queue])]
            self.registry.register(_RenamedCollector(sources, VLLM_NAMES))

    # -- engine hooks -------------------------------------------------------------------
    def on_engine_ready(self, kv_cache: KVCacheShape) -> None:
        self.kv_cache = kv_cache

    def on_step(self, stats: SchedulerStats | None, queue_times: list[float]) -> None:
        if stats is not None:
            self.scheduler_stats = stats
        for seconds in queue_times:
            self._queue.observe(seconds)

    def on_first_token(self, num_prompt_tokens: int, ttft_s: float) -> None:
        self.num_prompt_tokens += num_prompt_tokens
        self._prompt_tokens.inc(num_prompt_tokens)
        self._ttft.observe(ttft_s)

    def on_new_tokens(self, num_tokens: int) -> None:
        if num_tokens:
            self.num_generation_tokens += num_tokens
            self._generation_tokens.inc(num_tokens)

    def on_sequence_finished(self, finish_reason: str | None) -> None:
        counter = self._success.get(finish_reason or "abort")
        if counter is not None:
            counter.inc()

    def on_rejected(self) -> None:
        self._rejected.inc()

    def on_request_finished(self, e2e_s: float, tpot_s: float | None) -> None:
        self._e2e.observe(e2e_s)
        if tpot_s is not None:
            self._tpot.observe(tpot_s)

    def refresh_tracked_requests(self) -> None:
        """Write this process's count of requests it holds state of to the shared files
        (several processes; the scrape sums them)."""
        if self._tracked_gauge is not None and self.tracked_requests is not None:
            self._tracked_gauge.set(self.tracked_requests())

    def token_totals(self) -> tuple[float, float]:
        """Prompt and generated tokens so far, over every API process."""
        if self._files is None:
            return self.num_prompt_tokens, self.num_generation_tokens
        totals = {"pagedllm:prompt_tokens": 0.0, "pagedllm:generation_tokens": 0.0}
        for family in self._files.collect():
            if family.name in totals:
                totals[family.name] = sum(sample.value for sample in family.samples
                                          if sample.name.endswith("_total"))
        return totals["pagedllm:prompt_tokens"], totals["pagedllm:generation_tokens"]

    # -- exposition ---------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        self.refresh_tracked_requests()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class StatsLogger:
    """Builds the periodic stats line; ``maybe_log`` logs it while there is work to report."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._last_time = time.monotonic()
        self._last_prompt = 0
        self._last_generation = 0
        self._last_queries = 0
        self._last_hits = 0
        self._last_spec: SpecDecodingStats | None = None

    def line(self) -> str | None:
        """The line for the interval since the last call, or None when nothing happened."""
        m = self.metrics
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-6)
        prompt_total, generation_total = m.token_totals()
        prompt = prompt_total - self._last_prompt
        generation = generation_total - self._last_generation
        stats = m.scheduler_stats
        queries = stats.prefix_cache_queries if stats else 0
        hits = stats.prefix_cache_hits if stats else 0
        running = stats.num_running if stats else 0
        waiting = stats.num_waiting if stats else 0
        usage = stats.kv_cache_usage if stats else 0.0
        self._last_time = now
        self._last_prompt, self._last_generation = prompt_total, generation_total
        interval_queries, interval_hits = queries - self._last_queries, hits - self._last_hits
        self._last_queries, self._last_hits = queries, hits
        spec = self._spec_interval(stats.spec_decoding if stats else None)
        if not (prompt or generation or running or waiting):
            return None
        hit_rate = 100.0 * interval_hits / interval_queries if interval_queries else 0.0
        line = (
            f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100.0 * usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
        )
        if spec is not None:
            line += (f", Speculative acceptance rate: {100.0 * spec.acceptance_rate:.1f}%, "
                     f"Mean accepted length: {spec.mean_accepted_length:.2f}")
        return line

    def _spec_interval(self, totals: SpecDecodingStats | None) -> SpecDecodingStats | None:
        """The speculative-decoding counts since the last line (None without speculation)."""
        if totals is None:
            return None
        last = self._last_spec or SpecDecodingStats()
        self._last_spec = totals
        return SpecDecodingStats(
            num_drafts=totals.num_drafts - last.num_drafts,
            num_draft_tokens=totals.num_draft_tokens - last.num_draft_tokens,
            num_accepted_tokens=totals.num_accepted_tokens - last.num_accepted_tokens,
        )

    def maybe_log(self) -> None:
        text = self.line()
        if text is not None:
            logger.info(text)
