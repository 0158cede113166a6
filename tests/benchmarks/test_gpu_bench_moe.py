"""The GPU run's moe step: Mixtral's W1 sits beside the dense model's W1 of the same run,
with the ratio and the target (at least 0.6x); the smaller MoE's W1 is recorded too. And
the MoE tile sweep (``scripts/bench_fused_moe.py --sweep``), run on tiny shapes."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.gpu_report import W1_ROW, load_script, run_report, write_records

ARGS = ("--big", "big", "--small", "small", "--moe", "mix", "--moe-small", "a3b")


def test_moe_w1_carries_its_ratio_to_the_dense_w1_and_the_target(tmp_path) -> None:
    write_records(tmp_path, "w1-big.json", [dict(W1_ROW, output_tok_s=1000.0)])
    write_records(tmp_path, "moe-w1-mix.json", [dict(W1_ROW, output_tok_s=550.0)])
    write_records(tmp_path, "moe-w1-a3b.json", [dict(W1_ROW, output_tok_s=1500.0)])
    write_records(tmp_path, "moe-latency-mix.json", [dict(workload="L1", ms_per_token=9.0),
                                                     dict(workload="P1", prompt_tok_s=20000.0)])
    records, stdout = run_report(tmp_path, *ARGS)
    moe = {(r["workload"], r["model"]): r for r in records if r.get("variant") == "moe"}
    assert (moe["W1", "mix"]["ratio_vs_dense"], moe["W1", "mix"]["target_met"]) == (0.55, False)
    assert moe["W1", "a3b"]["output_tok_s"] == 1500.0
    assert moe["L1", "mix"]["ms_per_token"] == 9.0 and moe["P1", "mix"]["prompt_tok_s"] == 20000.0
    assert "at least 0.6x big: NOT met" in stdout


def test_a_run_without_the_moe_step_has_no_moe_records(tmp_path) -> None:
    records, _ = run_report(tmp_path, *ARGS)
    assert not [r for r in records if r.get("variant") == "moe"]


def test_the_tile_sweep_runs_end_to_end_on_tiny_shapes_and_writes_its_rows(tmp_path,
                                                                          capsys) -> None:
    bench = load_script("bench_fused_moe")
    out = tmp_path / "sweep.json"
    bench.main(["--sweep", "--tiny", "--out", str(out), "--budget-s", "600"])
    rows = json.loads(out.read_text())
    pairs = {(r["shape"], r["tokens"]) for r in rows}
    assert pairs == {(s, t) for s in bench.TINY_SHAPES for t in (1, 8)}
    for pair in pairs:
        kinds = sorted(r["kind"] for r in rows if (r["shape"], r["tokens"]) == pair)
        assert kinds == ["candidate"] * len(bench.TINY_CANDIDATES) + ["configured", "loop"]
    assert all(r["ok"] and r["ms"] > 0 and r["error"] is None for r in rows)
    assert {r["tile"] for r in rows if r["kind"] == "candidate"} == \
        {t.spec() for t in bench.TINY_CANDIDATES}
    table = capsys.readouterr().out.strip().splitlines()[-len(pairs) - 1:]
    assert table[0].split() == ["shape", "tokens", "bucket", "configured", "ms", "best", "tile",
                                "ms", "loop", "ms"]
    assert [line.split()[:2] for line in table[1:]] == \
        [[s, str(t)] for s in bench.TINY_SHAPES for t in (1, 8)]


def test_the_sweep_stops_at_its_budget_with_the_rows_it_has(tmp_path) -> None:
    bench = load_script("bench_fused_moe")
    out = tmp_path / "sweep.json"
    bench.main(["--sweep", "--tiny", "--out", str(out), "--budget-s", "0"])
    assert json.loads(out.read_text()) == []


def test_the_fp8_comparison_quantizes_experts_per_channel_and_per_block() -> None:
    """``--fp8``'s experts: each 128 x 128 block (or output channel) scaled by its own
    largest magnitude, the FP8 values within e4m3's rounding of the weights (scaled)."""
    from types import SimpleNamespace

    import torch

    from pagedllm.quantization.fp8 import dequantize_blocks

    bench = load_script("bench_fused_moe")
    gen = torch.Generator().manual_seed(0)
    case = SimpleNamespace(w13=torch.randn(2, 256, 384, generator=gen),
                           w2=torch.randn(2, 384, 128, generator=gen))
    for kind, block in (("channel", None), ("block", (128, 128))):
        q13, q2, scales = bench.fp8_experts(case, kind)
        assert scales.block == block and q13.dtype == torch.float8_e4m3fn
        for q, scale, weight in ((q13, scales.w13, case.w13), (q2, scales.w2, case.w2)):
            tile = block or (1, weight.shape[-1])
            rows, cols = weight.shape[1] // tile[0], weight.shape[2] // tile[1]
            amax = weight.reshape(2, rows, tile[0], cols, tile[1]).abs().amax((2, 4))
            torch.testing.assert_close(scale.reshape(2, rows, cols), amax / 448)
            for e in range(2):
                values = dequantize_blocks(q[e], scale[e], tile)
                # Half a step of e4m3: 1/16 of the value, or of 2**-9 below its normals.
                step = dequantize_blocks(torch.ones_like(weight[e]), scale[e], tile) * 2.0**-9
                assert ((values - weight[e]).abs() <= weight[e].abs() / 16 + step).all()


def test_the_integer_comparison_rounds_each_group_to_its_nearest_code() -> None:
    """``--int-bits``' experts: symmetric groups of 128 whose dequantized weights are within
    half a step (the group's scale) of the weights."""
    from types import SimpleNamespace

    import torch

    from pagedllm.quantization.int_weights import dequantize

    bench = load_script("bench_fused_moe")
    gen = torch.Generator().manual_seed(0)
    case = SimpleNamespace(w13=torch.randn(2, 64, 256, generator=gen),
                           w2=torch.randn(2, 256, 128, generator=gen))
    for bits in (4, 8):
        q13, q2, ints = bench.int_experts(case, bits)
        assert ints.bits == bits and ints.group_size == 128 and q13.dtype == torch.int32
        for q, scales, zeros, weight in ((q13, ints.w13_scales, ints.w13_zeros, case.w13),
                                         (q2, ints.w2_scales, ints.w2_zeros, case.w2)):
            assert (zeros == 1 << (bits - 1)).all()
            for e in range(2):
                values = dequantize(q[e], scales[e], zeros[e], bits, 128, weight.shape[2],
                                    torch.float32)
                step = scales[e].repeat_interleave(128, dim=1)
                assert ((values - weight[e]).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("flag", [["--fp8", "block"], ["--int-bits", "4"]])
def test_quantized_experts_with_the_sweep_are_refused_not_ignored(capsys, flag) -> None:
    bench = load_script("bench_fused_moe")
    with pytest.raises(SystemExit):
        bench.main(["--sweep", "--out", "x.json", *flag])
    assert "--fp8 and --int-bits time the configured tiles" in capsys.readouterr().err
