#!/usr/bin/env python3
"""Compile the small-batch product's kernel, or the decode attention kernel, for Hopper
(sm_90) on any machine, no GPU needed, and count the machine instructions of its main loop:
what a weight (or a byte of the KV cache) costs in instructions, the bound of the quantized
decode products (docs/benchmarks.md, "Quantized decode of a few sequences") and of decode
attention over an FP8 cache.

    python scripts/sass_loop.py --tile 64,64,4,3,fma,8 --int-bits 4 [--print-loop]
    python scripts/sass_loop.py --decode 128,4,3 --kv fp8

``--tile BLOCK_N,BLOCK_K,num_warps,num_stages,dot|fma[,SPLIT]`` as
``PAGEDLLM_GEMV_TILE`` takes it; ``--int-bits 4|8`` for packed integer weights (groups of
``--group``), ``--fp8`` for FP8 weights, ``--int8`` for INT8 W8A8 ones (their rows come
quantized), none for bf16. Arguments are compiled with the 16-byte alignment a real launch
of contiguous tensors gets. Prints the loop's instruction count, instructions per weight
(per thread: the tile's weights over the threads), and the most frequent opcodes, and the
shared memory a program takes (which shows how many buffers the pipeliner gave its loads);
``--print-loop`` the loop itself, ``--json`` the counts as JSON.
``--pdl`` compiles the kernel as programmatic dependent launch runs it
(``pagedllm.layers.pdl``) and also reports the global-memory instructions placed before its
wait for the previous kernel (``memory_before_wait``, 0 by that module's contract).
``--decode BLOCK_N,num_warps,num_stages`` compiles the decode attention kernel instead
(Llama-3.1-8B's heads: 4 query heads a KV head, head_dim 128, pages of 16; the rope and
cache write of the new token riding on it, as in the engine), ``--prefill
BLOCK_M,BLOCK_N,num_warps,num_stages`` the prefill attention kernel (its longest loop), over
a ``--kv bf16|fp8`` cache. Counts are per byte of keys and values a thread loads.
``--wgmma BLOCK_M,BLOCK_N,BLOCK_K,STAGES[,num_warps]`` compiles the Hopper kernel for 4-bit
decode batches (``int_matmul.int4_wgmma``; its loop takes two steps a turn; ``--split``
slices of ``K``) and also reports ptxas' C7514 and C7515 warnings: each one a ``wgmma``
product the compiler made wait for the ones before it. It compiles whatever
``TRITON_INTERPRET`` says (the variable is dropped).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagedllm.layers import _triton_ops_kernels as kernels  # noqa: E402
from pagedllm.layers.attention import triton_decode, triton_prefill  # noqa: E402
from pagedllm.layers.int_matmul import WgmmaTile  # noqa: E402
from pagedllm.layers.triton_ops import GEMV_TILE_ENV, _parse_tile  # noqa: E402

# Arguments a real launch passes as 16-byte aligned pointers or multiples of 16.
ALIGNED = ("x_ptr", "weight_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn",
           "stride_om", "norm_weight_ptr", "residual_ptr", "normed_ptr", "residual_out_ptr",
           "counter_ptr", "stride_rm", "weight_scale_ptr", "input_scale_ptr", "zeros_ptr",
           "perm_ptr", "partial_ptr", "k_per_split")


def compile_kernel(tile, int_bits: int, group: int, w8a8: str, pdl: bool = False):
    """The compiled kernel (``triton.compile``'s result) for sm_90; ``w8a8``: "fp8",
    "int8" or "" (the kernel's ``W8A8``)."""
    weight = "*i32" if int_bits else {"fp8": "*fp8e4nv", "int8": "*i8", "": "*bf16"}[w8a8]
    signature = dict(
        x_ptr="*i8" if w8a8 == "int8" else "*bf16",  # int8 rows come quantized
        weight_ptr=weight, bias_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32",
        K="i32", stride_xm="i32", stride_wn="i32", stride_om="i32", norm_weight_ptr="*bf16",
        residual_ptr="*bf16", normed_ptr="*bf16", residual_out_ptr="*bf16", counter_ptr="*i32",
        stride_rm="i32", eps="fp32", weight_scale_ptr="*bf16" if int_bits else "*fp32",
        input_scale_ptr="*fp32", zeros_ptr="*u8", perm_ptr="*i32", stride_sn="i32",
        partial_ptr="*fp32", k_per_split="i32",
    )
    constants = dict(
        BLOCK_M=16 if tile.use_dot else 1, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        HAS_BIAS=False, EVEN_K=True, USE_DOT=tile.use_dot, SILU_GATED=False, NORM_BLOCK=0,
        W8A8=w8a8, STATIC_INPUT=False, AMAX_BLOCK=tile.block_k,
        ROW_LOOP=not tile.use_dot,
        INT_BITS=int_bits,
        GROUP=group if int_bits else 0, HAS_PERM=False, SPLIT=tile.split,
        PDL=pdl,
    )
    if not tile.use_dot:  # a launch for one row passes M = 1, which Triton makes a constant
        constants["M"] = 1
    signature.update({name: "constexpr" for name in constants})
    names = list(kernels.small_batch_matmul_kernel.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED}
    source = ASTSource(fn=kernels.small_batch_matmul_kernel, signature=signature,
                       constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=tile.num_warps, num_stages=tile.num_stages))


def compile_attention(kind: str, tile: list[int], kv: str, pdl: bool = False,
                      new_kv: str = "pages", widen_staged: bool = False):
    """The decode (``tile`` = BLOCK_N, warps, stages; one pass) or prefill (``tile`` =
    BLOCK_M, BLOCK_N, warps, stages) attention kernel for sm_90 (see the module docstring);
    ``new_kv``: where the prefill kernel reads a step's new keys, "pages", "rows", or
    "context-rows" (the cached contexts from rows too); ``widen_staged``: the decode
    kernel widens an FP8 cache's tiles before its products (``PAGEDLLM_FP8_KV_WIDEN``)."""
    kernel = triton_decode._decode_kernel if kind == "decode" else triton_prefill._prefill_kernel
    names = list(kernel.arg_names)
    pointers = dict(k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}", part_acc_ptr="*fp32",
                    part_max_ptr="*fp32", part_sum_ptr="*fp32", counters_ptr="*i32",
                    block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32",
                    order_ptr="*i32", slot_mapping_ptr="*i64", context_rows_ptr="*i32",
                    new_kv_ptr="*fp16" if kv == "fp8e4nv" else "*bf16")
    signature = {name: pointers.get(name, "*bf16") if name.endswith("_ptr")
                 else "fp32" if name in ("qk_scale", "k_scale", "v_scale") else "i32"
                 for name in names}
    # An FP8 cache's values are slot-major (kv_quant.paged_kv_views), as in the engine.
    shared = dict(QUERIES_PER_KV=4, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, USE_WINDOW=False,
                  IEEE_DOT=False, FP16_DOT=kv == "fp8e4nv", SOFTCAP=0.0,
                  V_SLOT_MAJOR=kv == "fp8e4nv")
    if kind == "decode":
        block_n, num_warps, num_stages = tile
        constants = dict(shared, BLOCK_G=16, BLOCK_N=block_n, SPLIT=False, MERGE_H=4,
                         MERGE_S=16, HAS_ORDER=True, ROPE_AND_CACHE=True, SUMS=False, HALF=64,
                         PDL=pdl, WIDEN_STAGED=widen_staged)
    else:
        block_m, block_n, num_warps, num_stages = tile
        constants = dict(shared, BLOCK_M=block_m, BLOCK_Q=block_m // 4, BLOCK_N=block_n,
                         SKIP_DECODES=True, LONGEST_FIRST=False, NEW_KV=new_kv != "pages",
                         CONTEXT_ROWS=new_kv == "context-rows")
    signature.update({name: "constexpr" for name in constants})
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride")]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def compile_wgmma(tile: WgmmaTile, group: int):
    """``_int_wgmma_kernel.int4_wgmma_kernel`` for sm_90 at ``tile``, bf16 activations."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from pagedllm.layers import _int_wgmma_kernel as wgmma

    kernel = wgmma.int4_wgmma_kernel
    layout = gl.NVMMASharedLayout.get_default_for([tile.block_m, tile.block_k], gl.bfloat16)
    words = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    pointers = dict(s_ptr="*bf16", z_ptr="*u8", bias_ptr="*bf16", out_ptr="*bf16",
                    partials_ptr="*fp32", locks_ptr="*i32",
                    x_desc=f"tensordesc<bf16[{tile.block_m}, {tile.block_k}],{layout!r}>",
                    w_desc=f"tensordesc<i32[{tile.block_n}, {tile.block_k // 8}],{words!r}>")
    constants = dict(GROUP=group, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                     BLOCK_K=tile.block_k, STAGES=tile.stages, WORD_STAGES=tile.word_stages,
                     SPLIT=tile.split, HAS_BIAS=False, PAIRED=tile.paired,
                     num_warps=tile.num_warps)
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32")
                 for name in kernel.arg_names}
    aligned = [n for n in kernel.arg_names if n.endswith("_ptr") or n.startswith("stride")]
    aligned += ["K"]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=tile.num_warps, num_stages=1))


def serialized_products(compiled) -> list[str]:
    """ptxas' warnings on the kernel's PTX for sm_90a that it made ``wgmma`` products wait
    for every product before them (C7515: an operand or accumulator register redefined under
    a product in flight; C7514: a product's sums read while one is in flight)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        Path(ptx).write_text(compiled.asm["ptx"])
        done = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", ptx, "-o",
                               os.path.join(tmp, "kernel.o")], capture_output=True, text=True,
                              check=True)
    return [line for line in (done.stdout + done.stderr).splitlines()
            if "wgmma.mma_async instructions are serialized" in line]


def sass(compiled) -> list[tuple[int, str]]:
    """``(address, instruction)`` of the compiled kernel's machine code (cuobjdump)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(tool), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    found = (re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in text.splitlines())
    return [(int(m.group(1), 16), m.group(2).strip()) for m in found if m]


# Instructions that read or write global memory (shared-memory and constant loads aside).
GLOBAL_MEMORY = re.compile(
    r"^(@!?U?P\w+\s+)?(LDG|STG|LDGSTS|ATOMG|ATOM|RED|LD|ST|UTMA\w*|UBLKCP)\b")


def memory_before_wait(code: list[tuple[int, str]]) -> int | None:
    """Global-memory instructions before the kernel's first wait for the previous kernel
    (``griddepcontrol.wait``, ``ACQBULK`` in the machine code); None without a wait."""
    texts = [text for _, text in code]
    wait = next((i for i, text in enumerate(texts) if text.startswith("ACQBULK")), None)
    if wait is None:
        return None
    return sum(1 for text in texts[:wait] if GLOBAL_MEMORY.match(text))


def main_loop(code: list[tuple[int, str]], holding: str = "") -> list[str]:
    """The instructions of the longest backward branch's body: the loop over ``K``. With
    ``holding``, of the earliest starting one whose body holds that text and does not open
    on a barrier's retry (ptxas places the retries of an mbarrier wait after the kernel's
    end, so their branches back into the loop span more than it)."""
    spans = []
    for address, text in code:
        target = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            spans.append((int(target.group(1), 16), address))
    bodies = {span: [text for address, text in code if span[0] <= address <= span[1]]
              for span in spans}
    if holding:
        spans = sorted(span for span, body in bodies.items() if any(
            holding in text for text in body) and not any(
            "SYNCS.PHASECHK" in text for text in body[:3]))[:1]
    if not spans:
        raise SystemExit("no loop found in the kernel's machine code")
    return bodies[max(spans, key=lambda span: span[1] - span[0])]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--tile", help="BLOCK_N,BLOCK_K,warps,stages,dot|fma[,SPLIT]")
    what.add_argument("--decode", help="BLOCK_N,warps,stages: the decode attention kernel")
    what.add_argument("--prefill", help="BLOCK_M,BLOCK_N,warps,stages: the prefill attention kernel")
    what.add_argument("--wgmma", help="BLOCK_M,BLOCK_N,BLOCK_K,STAGES[,warps]: the Hopper kernel "
                                      "for 4-bit decode batches")
    parser.add_argument("--kv", choices=("bf16", "fp8"), default="bf16",
                        help="the attention kernel's cache dtype")
    parser.add_argument("--fp8-widen", choices=("operand", "staged"), default="operand",
                        help="--decode --kv fp8: where the cache's tiles widen to float16, "
                             "as PAGEDLLM_FP8_KV_WIDEN sets it")
    parser.add_argument("--new-kv", choices=("pages", "rows", "context-rows"), default="pages",
                        help="the prefill kernel: where a step's new keys (and with "
                             "context-rows its cached contexts) are read")
    parser.add_argument("--int-bits", type=int, choices=(0, 4, 8), default=0)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--split", type=int, default=1, help="--wgmma: slices of K")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--pdl", action="store_true",
                        help="compile for programmatic dependent launch (pagedllm.layers.pdl)")
    parser.add_argument("--print-loop", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON last")
    args = parser.parse_args(argv)
    if args.fp8 + args.int8 + bool(args.int_bits) > 1:
        parser.error("--fp8, --int8 and --int-bits name weight formats: give one.")
    attention = args.decode or args.prefill
    serialized = None
    if args.wgmma:
        shape = [int(v) for v in args.wgmma.split(",")]
        wtile = WgmmaTile(*shape[:4], **({"num_warps": shape[4]} if len(shape) > 4 else {}),
                          split=args.split)
        compiled = compile_wgmma(wtile, args.group)
        code, serialized = sass(compiled), serialized_products(compiled)
        unit = "weight"  # a turn of the loop takes two steps
        per_thread = 2 * wtile.block_n * wtile.block_k / (32 * wtile.num_warps)
    elif attention:
        tile = [int(v) for v in attention.split(",")]
        kv = "fp8e4nv" if args.kv == "fp8" else "bf16"
        kind = "decode" if args.decode else "prefill"
        compiled = compile_attention(kind, tile, kv, args.pdl, args.new_kv,
                                     args.fp8_widen == "staged" and kv == "fp8e4nv")
        code = sass(compiled)
        block_n, num_warps = tile[-3], tile[-2]
        unit, per_thread = "KV byte", block_n * 128 * 2 * (1 if args.kv == "fp8" else 2) / (32 * num_warps)
    else:
        tile = _parse_tile(GEMV_TILE_ENV, args.tile, rows=1)
        compiled = compile_kernel(tile, args.int_bits, args.group,
                                  "fp8" if args.fp8 else "int8" if args.int8 else "", args.pdl)
        code = sass(compiled)
        unit, per_thread = "weight", tile.block_n * tile.block_k / (32 * tile.num_warps)
    loop = main_loop(code, holding="GMMA" if args.wgmma else "")
    opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for text in loop)
    per_unit = len(loop) / per_thread
    result = {"instructions": len(loop), f"per_{unit.replace(' ', '_').lower()}": per_unit,
              "shared_bytes": compiled.metadata.shared, "opcodes": dict(opcodes.most_common())}
    if args.pdl:
        result["memory_before_wait"] = memory_before_wait(code)
    if serialized is not None:
        result["serialized_products"] = len(serialized)
    print(f"loop: {len(loop)} instructions, {per_unit:.2f} per {unit} "
          f"({per_thread:.0f} {unit}s a thread an iteration); shared memory "
          f"{compiled.metadata.shared} bytes a program (multi-buffered loads show here)")
    print("  " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(12)))
    if args.pdl:
        print(f"  global-memory instructions before the wait: {result['memory_before_wait']}")
    if serialized is not None:
        print(f"  products ptxas serialized (C7514, C7515): {len(serialized)}")
    if args.print_loop:
        print("\n".join(loop))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
