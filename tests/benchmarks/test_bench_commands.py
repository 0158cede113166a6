"""The benchmark commands on a tiny checkpoint (CPU): records, peers, ratios, step timing."""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks import latency, throughput
from pagedllm.benchmarks.step_timing import StepTimer
from pagedllm.core.scheduler import Scheduler
from tests.utils import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bench"), "llama", vocab_size=128,
                                max_position_embeddings=128)


def _tiny_workload(checkpoint: Path, out: Path) -> list[str]:
    """Five requests (prompts of 4-9 tokens, 6-8 output tokens) on the tiny checkpoint."""
    return ["--model", str(checkpoint), "--load-format", "dummy", "--num-prompts", "5",
            "--input-len", "4:9", "--output-len", "6:8", "--max-model-len", "32",
            "--num-kv-blocks", "64", "--block-size", "8", "--output-json", str(out)]


def _args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_cli_args(parser)
    return parser.parse_args(argv)


def test_throughput_runs_the_hf_peers_and_pagedllm_on_the_same_requests(checkpoint, tmp_path) -> None:
    out = tmp_path / "w1.json"
    args = _args(throughput, [
        "--model", str(checkpoint), "--load-format", "dummy", "--backend", "hf,hf-cb,pagedllm",
        "--num-prompts", "6", "--hf-num-prompts", "3", "--input-len", "4:9",
        "--output-len", "3:6", "--max-model-len", "32", "--num-kv-blocks", "64",
        "--block-size", "8", "--output-json", str(out),
    ])
    throughput.run(args)
    records = json.loads(out.read_text())
    by_run = {(r["backend"], r["num_prompts"]): r for r in records}
    assert set(by_run) == {("hf", 3), ("hf-cb", 3), ("pagedllm", 3), ("pagedllm", 6)}
    assert by_run["hf", 3]["output_tokens"] == by_run["pagedllm", 3]["output_tokens"]
    assert by_run["hf-cb", 3]["output_tokens"] == by_run["pagedllm", 3]["output_tokens"]
    assert not by_run["hf", 3]["truncated"] and not by_run["hf-cb", 3]["truncated"]
    subset = by_run["pagedllm", 3]
    assert subset["ratio_vs_hf_static"] == round(
        subset["output_tok_s"] / by_run["hf", 3]["output_tok_s"], 2)
    assert "ratio_vs_hf_cb" in subset and "ratio_vs_hf_static" not in by_run["pagedllm", 6]


def test_throughput_profiles_prompt_and_decode_steps_after_the_measured_run(
    checkpoint, tmp_path
) -> None:
    out = tmp_path / "w1.json"
    args = _args(throughput, _tiny_workload(checkpoint, out) + [
        "--profile-decode-steps", "2", "--profile-prefill-steps", "1"])
    throughput.run(args)
    record = json.loads(out.read_text())
    assert record["output_tokens"] == sum(r.output_len for r in throughput.synthetic_requests(
        5, (4, 9), (6, 8), 128, 0))  # the profile did not disturb the measured run
    # The engine's KV cache: 64 blocks of 8 tokens in the model's dtype (float32 on the CPU).
    assert (record["kv_cache_dtype"], record["kv_cache_tokens"]) == ("float32", 64 * 8)
    assert "aten::" in record["decode_profile"]  # the profiled steps ran the model
    assert "aten::" in record["prefill_profile"]


def test_shapes_run_fixed_length_workloads_on_one_engine_one_record_each(
    checkpoint, tmp_path
) -> None:
    out = tmp_path / "shapes.json"
    args = _args(throughput, ["--model", str(checkpoint), "--load-format", "dummy",
                              "--shapes", "4/6x3,9/2x2", "--max-model-len", "32",
                              "--num-kv-blocks", "64", "--block-size", "8",
                              "--output-json", str(out)])
    throughput.run(args)
    records = json.loads(out.read_text())
    assert [(r["shape"], r["num_prompts"], r["prompt_tokens"], r["output_tokens"])
            for r in records] == [("4/6", 3, 12, 18), ("9/2", 2, 18, 4)]
    assert records[1]["workload_args"]["input_len"] == [9, 9]
    assert not records[0]["workload_args"]["detokenize"]  # nothing reads the text
    with pytest.raises(ValueError, match="--output-len 30 does not fit"):
        throughput.run(_args(throughput, ["--model", str(checkpoint), "--load-format", "dummy",
                                          "--shapes", "4/6x3,9/30x2", "--max-model-len", "32"]))
    with pytest.raises(ValueError, match="pagedllm alone"):
        throughput.run(_args(throughput, ["--model", str(checkpoint), "--shapes", "4/6x3",
                                          "--backend", "hf,pagedllm"]))
    assert throughput.parse_shapes("128/128x30000, 2048/128x3000") == [
        (128, 128, 30000), (2048, 128, 3000)]
    with pytest.raises(ValueError, match="IN/OUTxREQUESTS"):
        throughput.parse_shapes("128x30000")


def test_a_shape_that_outgrows_the_cache_reports_its_preemptions_and_dropped_tokens(
    checkpoint, tmp_path, capsys
) -> None:
    """Requests that grow together past the cache are preempted and computed again: the
    record counts the preemptions and the computed tokens they dropped, and says so."""
    out = tmp_path / "tight.json"
    throughput.run(_args(throughput, ["--model", str(checkpoint), "--load-format", "dummy",
                                      "--shapes", "8/20x6", "--max-model-len", "32",
                                      "--num-kv-blocks", "8", "--block-size", "8",
                                      "--output-json", str(out)]))
    record = json.loads(out.read_text())  # one shape: one record
    assert record["output_tokens"] == 6 * 20
    assert record["preemptions"] > 0 and record["preempted_tokens"] >= 8 * record["preemptions"]
    assert (f"{record['preemptions']} preemptions, {record['preempted_tokens']} computed tokens "
            "dropped") in capsys.readouterr().out


def test_unknown_backend_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="pagedllm, hf, hf-cb"):
        throughput.parse_backends("hf,vllm")
    assert throughput.parse_backends("pagedllm, hf,pagedllm") == ["pagedllm", "hf"]


def test_latency_reports_ms_per_token_and_prefill_throughput(checkpoint, tmp_path) -> None:
    out = tmp_path / "latency.json"
    args = _args(latency, [
        "--model", str(checkpoint), "--input-len", "8", "--output-len", "5",
        "--prefill-batch", "2", "--prefill-len", "16", "--num-iters", "2",
        "--num-iters-warmup", "1", "--max-model-len", "32", "--num-kv-blocks", "32",
        "--block-size", "8", "--host-profile", "--output-json", str(out),
    ])
    latency.run(args)
    l1, p1 = json.loads(out.read_text())
    # The host profile names the engine's own functions (the model runner's step among them).
    assert "execute_model_async" in l1["host_profile"] and "model_runner.py" in p1["host_profile"]
    assert l1["workload"] == "L1" and l1["output_len"] == 5 and len(l1["latencies_s"]) == 2
    # Derived figures agree with the reported median up to their own last digit.
    assert l1["ms_per_token"] == pytest.approx(l1["latency_s_median"] / 5 * 1e3, abs=5e-4)
    assert 0 < l1["tpot_ms"]
    assert p1["workload"] == "P1" and p1["prompt_tok_s"] == pytest.approx(
        2 * 16 / p1["latency_s_median"], abs=0.05)


def test_derived_figures_agree_with_the_reported_durations_of_short_runs(monkeypatch) -> None:
    """A run of under a millisecond keeps its digits, and every rate in a record is the
    reported count over the reported duration (up to the rate's own last digit)."""
    from pagedllm.benchmarks import hf_backends, serve
    from pagedllm.benchmarks.run_profile import batch_buckets

    seconds = 0.00084321  # fixed decimals would report 0.0008 s: a 5% gap to any rate
    monkeypatch.setattr(latency, "_iterations", lambda *a, **k: [(seconds, [])])
    args = argparse.Namespace(batch_size=1, input_len=8, output_len=4, prefill_batch=2,
                              prefill_len=16, num_iters=1)
    p1 = latency.measure_prefill(None, args)
    assert p1["latency_s_median"] == pytest.approx(seconds, rel=1e-5)
    assert p1["prompt_tok_s"] == pytest.approx(32 / p1["latency_s_median"], abs=0.05)
    l1 = latency.measure_decode_latency(None, args)
    assert l1["ms_per_token"] == pytest.approx(l1["latency_s_median"] / 4 * 1e3, abs=5e-4)

    requests = throughput.synthetic_requests(3, (4, 4), (5, 5), 128)
    record = hf_backends._record("hf", requests, 15, seconds, truncated=False)
    assert record["output_tok_s"] == pytest.approx(15 / record["elapsed_s"], abs=0.05)

    results = [serve.RequestResult(ok=True, prompt_len=8, output_tokens=5, ttft_s=1e-4,
                                   latency_s=5e-4) for _ in range(3)]
    serve_args = argparse.Namespace(num_prompts=3, input_len=(8, 8), output_len=(5, 5),
                                    request_rate=float("inf"), max_concurrency=None,
                                    structured_output="none", prefix_len=0)
    summary = serve.summarize(serve_args, "m", results, seconds)
    assert summary["request_throughput"] == pytest.approx(3 / summary["duration_s"], abs=5e-4)
    assert summary["output_throughput"] == pytest.approx(15 / summary["duration_s"], abs=5e-3)

    row = batch_buckets([(1, 0.00004)])[0]
    assert row["mean_ms"] == pytest.approx(row["total_s"] * 1e3, abs=5e-4) and row["total_s"] > 0


def test_step_timer_splits_decode_from_prefill_steps_and_unwraps(checkpoint) -> None:
    llm = LLM(str(checkpoint), max_model_len=32, num_kv_blocks=32, block_size=8)
    with StepTimer(llm) as timer:
        llm.generate({"prompt_token_ids": [5, 6, 7]},
                     SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        gc.collect()  # a full collection inside the run: its pause is in the timeline
    assert timer.timeline()["gc2_collections"] >= 1 and timer.timeline()["gc2_s"] >= 0
    assert not any(getattr(cb, "__self__", None) is timer for cb in gc.callbacks)
    summary = timer.summary()
    assert summary["prefill_or_mixed"]["steps"] == 1 and summary["decode"]["steps"] == 3
    # One request: the prompt's 3 tokens in one step, then 1 token per decode step.
    assert summary["prefill_or_mixed"]["tokens"] == 3 and summary["decode"]["tokens"] == 1
    assert summary["decode"]["total_ms"] > 0
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.schedule.__func__ is Scheduler.schedule


def test_gpu_bench_report_collects_one_record_per_workload(tmp_path) -> None:
    def record(**fields) -> dict:
        return {"command": "pagedllm --model m", **fields}

    (tmp_path / "w1-big.json").write_text(json.dumps([
        record(backend="hf", num_prompts=2, output_tok_s=10.0, truncated=True),
        record(backend="pagedllm", num_prompts=2, output_tok_s=300.0, output_tokens=9,
               elapsed_s=0.03, ratio_vs_hf_static=30.0),
        record(backend="pagedllm", num_prompts=4, output_tok_s=400.0, output_tokens=20,
               elapsed_s=0.05),
    ]))
    (tmp_path / "latency-big.json").write_text(json.dumps([
        record(workload="L1", ms_per_token=4.0, tpot_ms=3.9), record(workload="P1", prompt_tok_s=41000.0),
    ]))
    for name, cache, tokens in (("fp8-w1-big.json", "bfloat16", 1000), ("fp8-kv-w1-big.json",
                                                                          "float8_e4m3fn", 2000)):
        (tmp_path / name).write_text(json.dumps([record(
            backend="pagedllm", num_prompts=4, output_tok_s=500.0, output_tokens=20, elapsed_s=0.04,
            kv_cache_dtype=cache, kv_cache_tokens=tokens)]))
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_bench_report.py"), "--dir", str(tmp_path),
         "--date", "2026-01-02", "--big", "big", "--small", "small", "--hf-prompts", "2"],
        check=True, capture_output=True, text=True, env={"PAGEDLLM_COMMIT": "abc"})
    w1, l1, p1, small, fp8, fp8_kv = json.loads((tmp_path / "2026-01-02-h200.json").read_text())
    assert (fp8["quantization"], fp8["kv_cache_tokens"], fp8_kv["kv_cache_tokens"]) == ("fp8", 1000, 2000)
    assert fp8_kv["kv_capacity_vs_auto"] == 2.0 and "kv_capacity_vs_auto" not in fp8
    assert "KV cache 1000 tokens (bfloat16), 2000 with --kv-cache-dtype fp8" in result.stdout
    assert (w1["workload"], w1["output_tok_s"], w1["ratio_vs_hf_static"]) == ("W1", 400.0, 30.0)
    assert w1["commit"] == "abc" and w1["command"] == "pagedllm bench throughput --model m"
    assert w1["side_by_side"]["hf"]["truncated"] is True and w1["target_met"] is False
    assert (l1["ms_per_token"], l1["target_met"]) == (4.0, True)
    assert (p1["prompt_tok_s"], p1["target_met"]) == (41000.0, True)
    assert small["workload"] == "W1" and "error" in small


def test_device_idle_counts_only_time_no_event_covers() -> None:
    """Overlapping and nested kernels are busy time; the gaps between them are idle."""
    from pagedllm.benchmarks.common import device_idle

    line = device_idle([(100.0, 1100.0), (0.0, 500.0), (200.0, 300.0), (1600.0, 2000.0)])
    assert line == "device idle 0.5 ms of a 2.0 ms span (25.0%)"


def test_throughput_profiles_the_whole_run_by_phase_family_and_batch(checkpoint, tmp_path) -> None:
    out = tmp_path / "w1.json"
    args = _args(throughput, _tiny_workload(checkpoint, out) + [
        "--max-num-batched-tokens", "16", "--profile-run"])
    throughput.run(args)
    profile = json.loads(out.read_text())["run_profile"]
    record = json.loads(out.read_text())
    assert record["output_tok_s"] == pytest.approx(
        record["output_tokens"] / record["elapsed_s"], abs=0.05)
    steps = profile["num_steps"]
    requests = throughput.synthetic_requests(5, (4, 9), (6, 8), 128, 0)
    # The prompts do not fit one 16-token step; a request gains at most one token a step,
    # so the longest one alone takes as many steps as its output length.
    assert sum(len(r.prompt_token_ids) for r in requests) > 16 and steps["prompt"] >= 2
    assert steps["decode"] >= 1
    assert steps["prompt"] + steps["decode"] >= max(r.output_len for r in requests)
    assert sum(row["steps"] for row in profile["decode_by_batch"]) == steps["decode"]
    assert all(row["low"] <= 5 for row in profile["decode_by_batch"])  # never over 5 requests
    # The model's products ran in both phases and were attributed to them.
    for phase in ("prompt", "decode"):
        assert profile["family_s"][phase]["products (BLAS)"] > 0


def test_run_profile_attributes_events_to_the_step_they_start_in() -> None:
    from pagedllm.benchmarks.run_profile import (
        attribute, batch_buckets, kernel_family, unclassified,
    )

    assert kernel_family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "products (BLAS)"
    assert kernel_family("void cublasLt::splitKreduce_kernel<32, 16, int>") == "products (BLAS)"
    assert kernel_family("_decode_kernel") == "decode attention"
    assert kernel_family("rms_norm_kernel") == "RMSNorm"
    assert kernel_family("some_new_kernel") == "other"
    assert kernel_family("_fp8_matmul_kernel") == "products (Triton GEMM)"
    assert kernel_family("int_dequantize_kernel") == "weight dequantization"
    assert kernel_family("quantize_rows_kernel") == "activation quantization"
    ranges = [(100.0, 200.0, "decode"), (0.0, 100.0, "prompt")]
    events = [(10.0, 60.0, "nvjet_a"), (100.0, 130.0, "nvjet_b"), (150.0, 250.0, "_decode_kernel"),
              (300.0, 310.0, "nvjet_c"),  # starts after every step: left out
              (110.0, 112.0, "pad_kernel"), (120.0, 125.0, "add_kernel"),
              (130.0, 132.0, "pad_kernel")]
    assert attribute(ranges, events) == {
        "prompt": {"products (BLAS)": 50e-6},
        "decode": {"products (BLAS)": 30e-6, "decode attention": 100e-6, "other": 9e-6},
    }
    # What "other" holds, by kernel, largest first.
    assert unclassified(ranges, events) == {
        "prompt": [], "decode": [("add_kernel", 5e-6), ("pad_kernel", 4e-6)]}
    rows = batch_buckets([(1, 0.001), (32, 0.003), (33, 0.010), (256, 0.020)])
    assert [(r["low"], r["high"], r["steps"], r["mean_ms"]) for r in rows] == [
        (1, 32, 2, 2.0), (33, 64, 1, 10.0), (225, 256, 1, 20.0)]
    assert "idle_ms" not in rows[0]


def test_run_profile_charges_device_idle_to_the_step_it_waited_for() -> None:
    """A gap between kernels is charged to the step whose span holds its end (a gap
    inside a step) or, between two steps, to the next one; gaps outside every step are
    not; the buckets report the mean idle a step."""
    from pagedllm.benchmarks.run_profile import batch_buckets, idle_by_step

    ranges = [(0.0, 100.0), (150.0, 300.0), (300.0, 400.0)]
    kernels = [(-50.0, -40.0),               # before the first step: its gap is left out
               (0.0, 40.0), (60.0, 100.0),   # 20 us idle inside step 0
               (150.0, 200.0), (190.0, 300.0),  # 50 us between steps 0 and 1: step 1's
               (320.0, 400.0),               # 20 us between steps 1 and 2 (back to back)
               (500.0, 510.0)]               # after the last step: left out
    assert idle_by_step(ranges, kernels) == pytest.approx([20e-6, 50e-6, 20e-6])
    assert idle_by_step([], kernels) == []  # no step launched anything on the device
    rows = batch_buckets([(3, 0.002, 0.0005), (4, 0.004, 0.0015), (40, 0.01, 0.0)])
    assert [(r["low"], r["idle_ms"]) for r in rows] == [(1, 1.0), (33, 0.0)]


def test_bench_tokenizer_corpus_is_the_standard_library_alone(tmp_path, monkeypatch) -> None:
    """The bench tokenizer trains on the standard library only: packages installed under
    its directory (site-packages, dist-packages) would make another tokenizer on every
    machine."""
    from pagedllm.benchmarks import bench_tokenizer

    for name, text in {"json/decoder.py": "STDLIB = 1\n", "site-packages/pkg/mod.py": "PKG = 2\n",
                       "dist-packages/other.py": "DIST = 3\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(bench_tokenizer.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert list(bench_tokenizer.corpus()) == ["STDLIB = 1\n"]


def test_structured_output_run_beside_the_unconstrained_one(tmp_path, monkeypatch) -> None:
    """``--structured-output json``: the same requests constrained, the same number of
    tokens generated (the schemas never end early), the ratio and the constraints' host
    time recorded, and the profiles asked for are of the constrained run; the config-only
    checkpoint gets a tokenizer of its vocabulary from bench_tokenizer."""
    from pagedllm.benchmarks import bench_tokenizer
    from pagedllm.engine.tokenizer import Tokenizer
    from pagedllm.structured.manager import StructuredOutputManager
    from pagedllm.worker import model_runner

    monkeypatch.setattr(model_runner, "CHECK_CANDIDATES", 8)  # PAGEDLLM_CHECK_CANDIDATES=8
    checks = []
    check_tokens = StructuredOutputManager.check_tokens
    monkeypatch.setattr(StructuredOutputManager, "check_tokens",
                        lambda self, *a, **k: checks.append(1) or check_tokens(self, *a, **k))
    profiled_checks = []
    kernel_table = throughput.kernel_table

    def counting_table(run, **kwargs):
        before = len(checks)
        table = kernel_table(run, **kwargs)
        profiled_checks.append(len(checks) - before)
        return table

    monkeypatch.setattr(throughput, "kernel_table", counting_table)
    vocab = 320
    checkpoint = make_tiny_checkpoint(tmp_path / "model", "llama", vocab_size=vocab,
                                      max_position_embeddings=128)
    learned = bench_tokenizer.build(vocab, tmp_path / "tok", corpus_bytes=1 << 20)
    tokenizer = Tokenizer.from_pretrained(tmp_path / "tok")
    assert len(tokenizer) == vocab and learned <= vocab and tokenizer.eos_token_ids
    out = tmp_path / "structured.json"
    argv = _tiny_workload(checkpoint, out)
    argv[argv.index("--output-len") + 1] = "40:60"
    argv[argv.index("--max-model-len") + 1] = "96"
    throughput.run(_args(throughput, [*argv, "--tokenizer", str(tmp_path / "tok"),
                                      "--structured-output", "json",
                                      "--profile-decode-steps", "3", "--step-timing"]))
    free, constrained = json.loads(out.read_text())
    assert "decode_profile" in constrained and profiled_checks[0] > 0
    # The sampler's launches are timed in both runs; the calls of a step sampled under
    # masks filled ahead in the constrained one (none here: they are off on a CPU).
    assert free["step_timeline"]["sampler_s"] > 0 < constrained["step_timeline"]["sampler_s"]
    assert constrained["step_timeline"]["grammar_take_s"] == 0
    assert constrained["step_timeline"]["grammar_masks_s"] == 0
    assert (free["backend"], constrained["backend"]) == ("pagedllm", "pagedllm+json")
    assert constrained["output_tokens"] == free["output_tokens"]
    assert constrained["constrained_ratio"] == round(
        constrained["output_tok_s"] / free["output_tok_s"], 3)
    # Every token is checked; only the refused ones cost a mask (filled at the check, or
    # ahead of it where PAGEDLLM_PREFETCH_MASKS is on: a GPU by default, not here).
    assert constrained["checked_rows"] == constrained["output_tokens"]
    assert 0 < constrained["mask_rows"] < constrained["checked_rows"]
    assert constrained["masks_filled_ahead"] == constrained["masks_used_ahead"] == 0
    assert constrained["ahead_start_delay_s"] == constrained["ahead_wait_s"] == 0
    assert constrained["ahead_fills"] == 0 and "ahead_fill_ms_p90" not in constrained
    assert constrained["refused_fraction"] == round(
        (constrained["mask_rows"] + constrained["masks_used_ahead"])
        / constrained["checked_rows"], 4)
    # A refused token's row takes its draw's next allowed candidate where there is one.
    assert 0 < constrained["substituted_fraction"] < 1
    assert constrained["mask_host_s"] > 0 and constrained["mask_steps"] > 0
    # The bitmask fills, call by call: they cover every masked row.
    fills = constrained["fill_calls"]
    assert constrained["fill_rows_per_call"] * fills == pytest.approx(constrained["mask_rows"],
                                                                      abs=0.01 * fills)
    assert 0 < constrained["fill_ms_p50"] <= constrained["fill_ms_p99"] <= constrained["fill_ms_max"]


def test_fills_ahead_are_summed_up_by_their_spread_not_only_their_mean() -> None:
    """The fills ahead one by one: medians, p90 and the slowest, of the fill and of the
    step loop's wait for it, in milliseconds."""
    fills = [(0.002, 128, 0.0)] * 8 + [(0.009, 128, 0.005), (0.012, 128, 0.008)]
    figures = throughput.ahead_fill_figures(fills)
    assert figures == {"ahead_fills": 10,
                       "ahead_fill_ms_p50": 2.0, "ahead_fill_ms_p90": 9.0,
                       "ahead_fill_ms_max": 12.0,
                       "ahead_wait_ms_p50": 0.0, "ahead_wait_ms_p90": 5.0,
                       "ahead_wait_ms_max": 8.0}


def test_throughput_with_a_shared_prefix_serves_it_from_the_prefix_cache(checkpoint, tmp_path) -> None:
    """--prefix-len 64 ahead of 40 prompts: all but the first prompts' prefixes are cache
    hits (a step budget of one prompt keeps later prompts from starting before it is cached)."""
    out = tmp_path / "prefix.json"
    args = _args(throughput, [
        "--model", str(checkpoint), "--load-format", "dummy", "--num-prompts", "40",
        "--prefix-len", "64", "--input-len", "4:9", "--output-len", "2:4",
        "--max-model-len", "128", "--num-kv-blocks", "256", "--block-size", "8",
        "--max-num-batched-tokens", "80", "--output-json", str(out),
    ])
    throughput.run(args)
    record = json.loads(out.read_text())
    shared = 64 * 40
    assert record["prefix_cache_hits"] >= 0.95 * shared
    assert record["prompt_tokens_computed"] == record["prompt_tokens"] - record["prefix_cache_hits"]
    assert record["prompt_tokens_computed"] < record["prompt_tokens"] - 0.95 * shared
    assert 0 < record["prefix_cache_hit_rate"] <= 1
    requests = throughput.synthetic_requests(3, (4, 9), (2, 4), 128, 0, prefix_len=64)
    assert all(r.prompt_token_ids[:64] == requests[0].prompt_token_ids[:64] for r in requests)


def test_records_name_files_not_the_machines_directories():
    from pagedllm.benchmarks.common import recorded_command

    command = recorded_command(["bench", "latency", "--prompt-files", "/data/held_out/a.py",
                                "--output-json=/out/run/lat.json", "--model", "m"])
    assert command == ("pagedllm bench latency --prompt-files a.py --output-json=lat.json "
                       "--model m")
