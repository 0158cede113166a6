"""The small-batch product's machine code, compiled for Hopper on the CPU
(scripts/sass_loop.py): the quantized decode products are bound by the instructions
each weight costs, so the count is checked where it cannot drift unseen."""

from __future__ import annotations

import pytest

from tests.benchmarks.gpu_report import load_script

pytest.importorskip("triton")
sass_loop = load_script("sass_loop")


@pytest.mark.parametrize("args, weights_per_thread, bound", [
    # 4-bit, one row, lane-wise: unpack (shift, mask, the float's bits), q - zero, the
    # scale, one multiply-add a weight; 7.7 instructions a weight when written.
    (["--tile", "64,64,4,3,fma,8", "--int-bits", "4"], 32, 9.0),
    # FP8, one row: two weights converted by one instruction; 3.6 when written.
    (["--tile", "16,512,4,3,fma,2", "--fp8"], 64, 4.5),
])
def test_the_loop_costs_one_multiply_add_and_few_instructions_a_weight(args, weights_per_thread,
                                                                        bound):
    result = sass_loop.main(args)
    assert result["opcodes"]["FFMA"] == weights_per_thread
    assert result["per_weight"] < bound
