"""Speculative decoding in the metrics: the counters the core reports, and the stats line."""

from __future__ import annotations

from pagedllm.core.outputs import SchedulerStats, SpecDecodingStats
from pagedllm.metrics import ServerMetrics, StatsLogger


def snapshot(spec: SpecDecodingStats | None) -> SchedulerStats:
    return SchedulerStats(num_running=1, num_waiting=0, kv_cache_usage=0.1,
                          prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                          spec_decoding=spec)


def exposition(metrics: ServerMetrics) -> str:
    return metrics.render()[0].decode()


def test_counters_and_acceptance_by_position_are_exported():
    metrics = ServerMetrics("m")
    spec = SpecDecodingStats()
    spec.observe(4, 2)
    spec.observe(4, 4)
    spec.observe(3, 0)
    metrics.on_step(snapshot(spec.copy()), [])
    text = exposition(metrics)
    assert 'pagedllm:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'pagedllm:spec_decode_num_draft_tokens_total{model_name="m"} 11.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_total{model_name="m"} 6.0' in text
    for position, count in enumerate([2, 2, 1, 1]):
        assert (f'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
                f'position="{position}"}} {float(count)}') in text


def test_without_speculation_there_are_no_speculative_series():
    metrics = ServerMetrics("m")
    metrics.on_step(snapshot(None), [])
    assert "spec_decode" not in exposition(metrics)


def test_the_stats_line_shows_the_interval_acceptance():
    metrics = ServerMetrics("m")
    logger = StatsLogger(metrics)
    spec = SpecDecodingStats()
    spec.observe(4, 4)
    metrics.on_step(snapshot(spec.copy()), [])
    metrics.on_new_tokens(5)
    assert logger.line().endswith(
        "Speculative acceptance rate: 100.0%, Mean accepted length: 5.00")
    spec.observe(4, 1)
    spec.observe(4, 0)
    metrics.on_step(snapshot(spec.copy()), [])
    metrics.on_new_tokens(3)
    # Only the interval's two drafts: 1 of 8 tokens accepted, 1.5 tokens a step.
    assert logger.line().endswith(
        "Speculative acceptance rate: 12.5%, Mean accepted length: 1.50")
    metrics.on_step(snapshot(None), [])
    metrics.on_new_tokens(1)
    assert "Speculative" not in logger.line()
