"""``pagedllm plan``: memory, concurrency, GPUs, cost per day and per million tokens on
known inputs, checked against values computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.config import BUILTIN_CONFIGS_DIR
from pagedllm.entrypoints import plan
from pagedllm.entrypoints.cli import main

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
LLAMA_8B = json.loads((BUILTIN_CONFIGS_DIR / "llama-3.1-8b" / "config.json").read_text())
LLAMA_70B = json.loads((BUILTIN_CONFIGS_DIR / "llama-3.1-70b" / "config.json").read_text())
# llama-3.1-8b: 8,030,261,248 parameters, 16,060,522,496 bytes in bf16; a 16-token block of
# bf16 KV is 2 x 32 layers x 16 x 8 heads x 128 x 2 bytes = 2 MiB (131,072 bytes a token).


def _profile(**kwargs):
    defaults = dict(input_len=(1000, 1000), output_len=(500, 500), requests_per_day=864_000)
    return plan.Profile(**{**defaults, **kwargs})


def _h200(**kwargs):
    """An H200 candidate of 100 GiB running at most 256 requests at once (the figures
    below are worked out by hand for 256)."""
    return plan.Candidate(**{"name": "h200", "gpu": "H200", "price_per_hour": 3.0,
                             "memory_gib": 100.0, "max_num_seqs": 256, **kwargs})


def test_measured_throughput_gives_gpus_and_costs():
    """864,000 requests a day = 10/s, peak 20/s (factor 2); peak output 20 x 500 = 10,000
    tokens/s over 4,000 per replica -> 3 replicas = 3 GPUs; 3 x $3 x 24 = $216 a day;
    432 M output tokens a day -> $0.50 per million; 1,296 M tokens -> $0.1667."""
    measured = plan.Measurement("test", output_tok_s=4000.0)
    p = plan.plan_candidate(_profile(), LLAMA_8B, _h200(), measured)
    assert p.fits and p.weights_gib == round(16_060_522_496 / GIB, 2)
    # 0.9 x 100 GiB - weights = 80,576,241,664 bytes = 38,421 blocks, capped at what
    # 256 requests of 1,500 tokens (94 blocks each) can use: 24,064 blocks.
    assert p.kv_cache_gib == round(80_576_241_664 / GIB, 2)
    assert p.kv_tokens == 24_064 * 16 and p.max_concurrency == 256
    assert (p.replicas, p.gpus, p.cost_per_day) == (3, 3, 216.0)
    assert p.cost_per_million_output_tokens == 0.5
    assert p.cost_per_million_tokens == round(216 / 1296, 4)
    assert (p.ttft_p95, p.tpot_p95) == ("not set", "not set")


def test_concurrency_counts_the_shared_prefix_once():
    """24 GiB x 0.9 = 23,192,823,398 bytes less 16,060,522,496 of weights = 7,132,300,902
    = 3,400 blocks; half of a 1,000-token prompt shared -> 500 + 500 = 1,000 tokens = 63
    blocks a request -> 53 at once."""
    p = plan.plan_candidate(_profile(prefix_fraction=0.5), LLAMA_8B, _h200(memory_gib=24.0), None)
    assert p.fits and p.kv_tokens == 3400 * 16 and p.max_concurrency == 53
    assert p.gpus is None and p.cost_per_day is None and "no throughput" in p.notes[0]


def test_an_fp8_kv_cache_holds_twice_the_blocks():
    """As above with one byte an element: 7,132,300,902 bytes = 6,801 blocks of 1 MiB ->
    107 requests of 63 blocks at once, and records of the fp8 cache match only it."""
    p = plan.plan_candidate(_profile(prefix_fraction=0.5), LLAMA_8B,
                            _h200(memory_gib=24.0, kv_cache_dtype="fp8"), None)
    assert p.kv_tokens == 6801 * 16 and p.max_concurrency == 107
    command = "pagedllm bench throughput --model llama-3.1-8b --kv-cache-dtype fp8"
    record = {"workload": "W1", "model": "llama-3.1-8b", "gpu": "NVIDIA H200", "command": command,
              "output_tok_s": 5000.0}
    for candidate, matches in ((_h200(kv_cache_dtype="fp8_e4m3"), True), (_h200(), False)):
        assert plan._record_matches(record, "", "llama-3.1-8b", candidate, "bfloat16") is matches


def test_llama_70b_fits_one_h200_in_fp8_but_not_in_bf16():
    """fp8: per layer 855,638,016 projection bytes + 83,968 float32 channel scales + two bf16
    norms of 8,192 = 856,006,656; x 80 layers + bf16 embedding, LM head and final norm
    (2 x 128,256 x 8,192 + 8,192) x 2 = 72,683,241,472 bytes."""
    bf16 = plan.plan_candidate(_profile(), LLAMA_70B, _h200(memory_gib=139.8), None)
    assert not bf16.fits and bf16.kv_tokens == 0 and "does not fit" in bf16.notes[0]
    fp8 = plan.plan_candidate(_profile(), LLAMA_70B, _h200(memory_gib=139.8, quantization="fp8"),
                              None)
    assert fp8.fits and fp8.weights_gib == round(72_683_241_472 / GIB, 2)
    tp2 = plan.plan_candidate(_profile(), LLAMA_70B, _h200(memory_gib=139.8, tp=2), None)
    assert tp2.fits and tp2.projection and "projection" in tp2.notes[0]


def test_llama_70b_in_4_bits_leaves_an_h200_more_kv_cache_than_fp8():
    """gptq/awq: 4-bit weights in groups of 128, each projection N x (4 bytes per 8 inputs
    + 3 bytes per group): qkv 10,240 x 4,288 + o 8,192 x 4,288 + gate/up 57,344 x 4,288 +
    down 8,192 x 15,008 = 447,873,024, + two bf16 norms 32,768; x 80 layers + bf16
    embedding, LM head and final norm 4,202,708,992 = 40,035,172,352 bytes."""
    fp8 = plan.plan_candidate(_profile(), LLAMA_70B, _h200(memory_gib=139.8, quantization="fp8"),
                              None)
    for method in ("gptq", "awq"):
        int4 = plan.plan_candidate(_profile(), LLAMA_70B,
                                   _h200(memory_gib=139.8, quantization=method), None)
        assert int4.fits and int4.weights_gib == round(40_035_172_352 / GIB, 2)
        assert int4.kv_tokens > fp8.kv_tokens
    with pytest.raises(ValueError, match="quantization='int3' is not one of"):
        plan.plan_candidate(_profile(), LLAMA_70B, _h200(quantization="int3"), None)


def test_roofline_estimate_by_hand():
    """1,000 GB/s and 100 TFLOPS; batch 256 at a mean context of 1,000 + 250 tokens:
    memory (16,060,522,496 + 256 x 1,250 x 131,072) / 1e12 = 58.0 ms; compute
    2 x 8,030,261,248 x 256 x (1 + 1000 / 500) / 1e14 = 123.34 ms -> 256 / 0.12334 =
    2,075.5 tokens/s. Floors: TTFT 2 x P x 1,000 / 1e14 = 160.6 ms; TPOT at batch 1
    (16,060,522,496 + 1,250 x 131,072) / 1e12 = 16.2 ms."""
    candidate = _h200(bandwidth_gb_s=1000, tflops=100)
    p = plan.plan_candidate(_profile(), LLAMA_8B, candidate, None)
    assert p.output_tok_s_per_replica == round(256 / (12_334_481_276_928 / 1e14), 1)
    assert "roofline estimate" in p.throughput_source and p.replicas == 5  # 10,000 / 2,075.5
    missed = plan.plan_candidate(_profile(ttft_p95_ms=100, tpot_p95_ms=10), LLAMA_8B, candidate, None)
    assert missed.ttft_p95 == "no (at least 160.6 ms)" and missed.tpot_p95 == "no (at least 16.2 ms)"
    met = plan.plan_candidate(_profile(ttft_p95_ms=500, tpot_p95_ms=100), LLAMA_8B, candidate, None)
    assert (met.ttft_p95, met.tpot_p95) == ("unknown", "unknown")


def _write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_measurements_come_from_matching_records(tmp_path):
    command = "pagedllm bench throughput --model llama-3.1-8b --input-len 1000 --output-len 500"
    records = [
        _write(tmp_path / "a-h200.json", [
            {"workload": "W1", "model": "llama-3.1-8b", "gpu": "NVIDIA H200", "date": "2026-01-01",
             "command": command, "output_tok_s": 5000.0},
            {"workload": "W1", "model": "llama-3.1-8b", "gpu": "NVIDIA H100", "date": "2026-01-05",
             "command": command, "output_tok_s": 3000.0},
            {"workload": "L1", "model": "llama-3.1-8b", "gpu": "NVIDIA H200", "date": "2026-01-01",
             "command": "pagedllm bench latency", "tpot_ms": 4.4}]),
        _write(tmp_path / "b-h200.json", {"note": "H200", "runs": {"serve": [
            {"workload": "serve", "model": "llama-3.1-8b", "date": "2026-01-02", "command": "",
             "output_throughput": 4000.0, "input_len": [1000, 1000], "output_len": [500, 500],
             "ttft_ms": {"mean": 300, "median": 250, "p95": 600, "p99": 900},
             "tpot_ms": {"mean": 30, "median": 29, "p99": 45}}], "structured": [
            {"workload": "throughput", "model": "llama-3.1-8b", "date": "2026-01-03",
             "command": "", "backend": "pagedllm+json", "output_tok_s": 100.0}]}}),
    ]
    found = plan.find_measurement(records, "llama-3.1-8b", _h200(), "bfloat16")
    assert found.output_tok_s == 4000.0 and found.tpot_floor_ms == 4.4
    assert plan.find_measurement(records, "llama-3.1-8b", _h200(quantization="fp8"), "bfloat16") is None
    p = plan.plan_candidate(_profile(ttft_p95_ms=500, tpot_p95_ms=50), LLAMA_8B, _h200(), found)
    assert p.ttft_p95 == "no (p95 600.0 ms)" and p.tpot_p95 == "yes (p99 45.0 ms)"
    assert p.replicas == 3 and not p.notes  # same lengths as the profile


def test_the_repository_records_give_the_h200_bf16_and_fp8_throughput():
    records = sorted((REPO / "benchmarks" / "results").glob("*.json"))
    bf16 = plan.find_measurement(records, "llama-3.1-8b", _h200(), "bfloat16")
    fp8 = plan.find_measurement(records, "llama-3.1-8b", _h200(quantization="fp8"), "bfloat16")
    assert bf16.output_tok_s > fp8.output_tok_s > 0
    assert bf16.input_len == [100, 1024] and bf16.tpot_floor_ms is not None


def test_recommendation_is_the_cheapest_plan_that_does_not_miss_a_target():
    def made(name, cost, tpot):
        return plan.Plan(name, "H200", 1, False, True, 1, 1, 1, 1, "", 1.0, 1, 1, cost, 1, 1,
                         "not set", tpot)

    plans = [made("cheap-missing", 10, "no (p95 80.0 ms)"), made("unknown", 20, "unknown"),
             made("holds", 30, "yes (p95 40.0 ms)")]
    assert plan.recommend(plans).candidate == "holds"
    assert plan.recommend(plans[:2]).candidate == "unknown"
    assert plan.recommend(plans[:1]) is None


def test_the_command_reads_candidates_and_a_live_measurement(tmp_path, monkeypatch, capsys):
    from pagedllm.benchmarks import serve as serve_bench

    seen = {}

    def fake_run(args):
        seen.update(vars(args))
        return {"output_throughput": 2500.0, "input_len": [1000, 1000], "output_len": [500, 500],
                "ttft_ms": {"p95": 200.0}, "tpot_ms": {"p95": 20.0}}

    monkeypatch.setattr(serve_bench, "run", fake_run)
    candidates = tmp_path / "candidates.yaml"
    candidates.write_text("candidates:\n"
                          "  - {name: live, gpu: H200, price_per_hour: 3, memory_gib: 100}\n"
                          "  - {name: other, gpu: L4, price_per_hour: 1, memory_gib: 22}\n")
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-3.1-8b", "--requests-per-day", "864000",
                 "--input-len", "1000", "--output-len", "500", "--tpot-p95-ms", "50",
                 "--candidates", str(candidates), "--records", "--measure-url",
                 "http://127.0.0.1:9", "--output-json", str(out)]) == 0
    assert seen["base_url"] == "http://127.0.0.1:9" and seen["request_rate"] == 20.0
    result = json.loads(out.read_text())
    live, other = result["plans"]
    assert (live["gpus"], live["cost_per_day"], live["tpot_p95"]) == (4, 288.0, "yes (p95 20.0 ms)")
    assert other["gpus"] is None and result["recommendation"] == "live"
    assert "Recommendation: live: 4 GPUs, $288.00/day." in capsys.readouterr().out


def test_a_profile_needs_traffic_and_a_candidate_needs_a_price():
    with pytest.raises(ValueError, match="--requests-per-day"):
        plan.Profile(input_len=(1, 1), output_len=(1, 1))
    assert main(["plan", "--requests-per-day", "10", "--gpu", "H200"]) == 2
