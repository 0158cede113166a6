"""The small-batch product's and the attention kernels' machine code, compiled for Hopper
on the CPU (scripts/sass_loop.py): the quantized decode products, and attention over an
FP8 cache, are bound by the instructions each weight or cache byte costs, so the count is
checked where it cannot drift unseen."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmarks.gpu_report import REPO

pytest.importorskip("triton")


def sass_loop(args: list[str]) -> dict:
    """The script's counts, from its own process (kernels imported by other tests here
    may be the interpreter's)."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "sass_loop.py"), *args,
                           "--json"], capture_output=True, text=True, check=True, timeout=300)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("args, weights_per_thread, bound", [
    # 4-bit, one row: a shift and one and/or make each weight a float, a multiply-add
    # takes it; 6.2 instructions a weight with the rest (7.7 before int_row_products).
    (["--tile", "64,64,4,3,fma,8", "--int-bits", "4"], 32, 7.0),
    # FP8, one row: two weights converted by one instruction, and each lane quantizing its
    # own copy of the inputs; 4.9 when written (3.6 with the row exchanged through shared
    # memory, which an H200 ran slower).
    (["--tile", "16,512,4,3,fma,2", "--fp8"], 64, 5.2),
])
def test_the_loop_costs_one_multiply_add_and_few_instructions_a_weight(args, weights_per_thread,
                                                                        bound):
    result = sass_loop(args)
    assert weights_per_thread <= result["opcodes"]["FFMA"] <= weights_per_thread + 4
    assert result["per_weight"] < bound


def test_one_row_of_fp8_weights_exchanges_nothing_through_shared_memory():
    """Each lane loads the inputs its weights multiply: no barrier, no shared-memory store
    or load in the loop (the row exchanged through shared memory took 8 barriers an
    iteration)."""
    opcodes = sass_loop(["--tile", "16,512,4,3,fma,2", "--fp8"])["opcodes"]
    assert not [op for op in opcodes if op.startswith(("BAR", "STS", "LDS"))]


@pytest.mark.parametrize("tile, steps_k", [("256,64,64,3", 64), ("128,64,128,3", 128),
                                           ("8,64,128,4 --split 4", 128)])
def test_the_4bit_wgmma_loop_keeps_its_products_asynchronous(tile, steps_k):
    """The Hopper kernel of 4-bit decode batches: ptxas makes no product wait for the ones
    before it (C7515, which halved the kernel's pace), and each weight is made in the
    thread whose register operand holds it: nothing is stored to shared memory in the loop
    (a tile exchanged there costs barriers a step). A turn takes two steps of
    ``BLOCK_K / 16`` products; a decode batch's tile with ``K`` split as well."""
    result = sass_loop(["--wgmma", *tile.split()])
    assert result["serialized_products"] == 0
    assert not [op for op in result["opcodes"] if op.startswith("STS")]
    assert sum(n for op, n in result["opcodes"].items() if "GMMA" in op) == 2 * steps_k // 16


def test_a_decode_tile_pages_its_keys_and_values_with_one_offset():
    """Each key's page and slot are found once for its key and its value (the caches
    share strides), with unsigned shifts and masks: about 1.6 instructions a bf16 cache
    byte at the one-pass tile (2.3 when the value repeated the key's arithmetic)."""
    assert sass_loop(["--decode", "64,4,2"])["per_kv_byte"] < 1.8


def test_the_script_shows_which_decode_tiles_double_buffer_their_keys_and_values():
    """The shared memory a program takes shows the pipeliner's buffers: a 64-key tile at
    five stages holds two K and two V tiles (16 KB each), at three stages one of each
    (docs/benchmarks.md, "Decode attention with double-buffered tiles")."""
    single = sass_loop(["--decode", "64,2,3"])["shared_bytes"]
    double = sass_loop(["--decode", "64,2,5"])["shared_bytes"]
    assert 32 << 10 <= single < 48 << 10
    assert double - single >= 32 << 10


@pytest.mark.parametrize("tile", ["64,4,2", "128,4,2"])
def test_decode_over_an_fp8_cache_widened_before_its_products_loads_them_by_ldmatrix(tile):
    """Widened at the products' operand loads, an FP8 cache's tile gives both operands a
    four-wide layout: the queries come back from shared memory every iteration by 64-bit
    loads and are copied into the products' register quads. Widened before the products
    (``PAGEDLLM_FP8_KV_WIDEN=staged``), every operand loads by ``ldmatrix``, few of those
    loads and moves remain, the conversions are the same, and the loop is shorter."""
    args = ["--decode", tile, "--kv", "fp8", "--fp8-widen"]
    operand, staged = sass_loop(args + ["operand"]), sass_loop(args + ["staged"])
    moves = ("LDS.64", "IMAD.MOV.U32")  # the queries' reloads and register copies
    assert sum(staged["opcodes"].get(op, 0) for op in moves) < sum(
        operand["opcodes"].get(op, 0) for op in moves) / 8
    widen = "F2FP.F16.E4M3.UNPACK_B"  # the same conversions, one for two values
    assert staged["opcodes"][widen] == operand["opcodes"][widen]
    assert staged["instructions"] < 0.9 * operand["instructions"]


@pytest.mark.parametrize("new_kv", ["rows", "context-rows"])
def test_prefill_over_an_fp8_cache_takes_its_keys_from_rows_without_widening_them(new_kv):
    """A prompt step's keys read from rows already in the products' dtype go from the copy
    into shared memory straight to the tensor cores, as a bf16 cache's pages do: no e4m3
    widening and no store back to shared memory in the loop (the pages' loop widens 64
    values and stores 17 times an iteration)."""
    opcodes = sass_loop(["--prefill", "64,64,4,2", "--kv", "fp8", "--new-kv", new_kv])["opcodes"]
    assert [op for op in opcodes if op.startswith("HGMMA")]
    assert [op for op in opcodes if op.startswith("LDGSTS")]
    assert not [op for op in opcodes if op.startswith(("F2FP.F16.E4M3", "STS"))]


@pytest.mark.parametrize("args", [
    ["--tile", "16,512,4,3,fma,2", "--fp8"],  # one row of FP8 weights
    ["--tile", "64,512,4,3,dot"],  # bf16 on tensor cores
    ["--tile", "64,64,4,3,fma,8", "--int-bits", "4"],  # one row of 4-bit weights
    ["--decode", "64,4,2"],  # decode attention, the new token's rope and cache write in it
])
def test_a_kernel_launched_early_touches_no_memory_before_the_previous_kernel_completes(args):
    """Programmatic dependent launch places a decode step's kernel while the one before it
    runs: its first instruction must wait for that kernel (``ACQBULK``, the
    ``griddepcontrol.wait`` of ``pagedllm.layers.pdl``), or it could read an activation
    before it is written."""
    assert sass_loop([*args, "--pdl"])["memory_before_wait"] == 0
