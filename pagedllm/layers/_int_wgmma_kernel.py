"""A Hopper kernel for 4-bit weights in steps of up to ``int_matmul.WGMMA_MAX_ROWS`` rows
(decode batches, ``K`` split for the smaller ones; short prompts), imported only when it
launches: ``x [M, K] @ W.T`` with ``W`` in the stored layout of
``pagedllm.quantization.int_weights``, written in Gluon so that the weight tile made in
registers is ``wgmma``'s register operand, made while the previous tile's product runs.

The product is computed transposed, ``W x^T``: a program owns ``BLOCK_N`` outputs (the
``wgmma`` rows, whose operand comes from registers) by ``BLOCK_M`` activation rows (its
columns, read from shared memory), and walks ``K`` in ``BLOCK_K`` steps. Step ``i``:

1. once the packed words of tile ``i`` have arrived (TMA, ``WORD_STAGES`` tiles in flight:
   they come from memory, and one step is shorter than a memory load), they are unpacked
   and scaled, ``(q - zero) * scale`` rounded once to the activation dtype (as
   ``_int_matmul_kernels.int_weight_tile`` makes them: the same weights bit for bit), each
   pair of weights in the thread whose register operand holds it (``unpack_layout_of``);
2. once the activation tile ``i`` has arrived (TMA, ``STAGES`` tiles in flight), ``wgmma``
   multiplies, asynchronously;
3. the step waits until only that product is in flight: the one before it is done, so the
   word and activation stages it read take the copies of tiles ``WORD_STAGES - 1`` and
   ``STAGES - 1`` further on.

Two choices keep the products asynchronous (checked in ptxas' report, C7515):

- nothing the threads write is read by ``wgmma`` from shared memory, so no proxy fence (a
  full memory barrier in the machine code, which waits for the words in flight) stands in
  the loop: a first form with the weight tile stored as ``wgmma``'s shared operand ran at
  half the tensor cores' pace;
- the loop takes two steps a turn, so consecutive steps' register operands are different
  registers: an operand redefined under a product in flight makes ptxas wait for every
  product.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

from pagedllm.layers._int_matmul_kernels import _PAIR_ASM_BF16, _PAIR_ASM_F16


def activation_descriptor(x: torch.Tensor, block_m: int, block_k: int) -> TensorDescriptor:
    """The TMA descriptor of ``x [M, K]`` (row-major, 16-byte aligned rows) in blocks of
    ``block_m x block_k``; rows past ``M`` read as zeros."""
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], dtype)
    return TensorDescriptor.from_tensor(x, [block_m, block_k], layout)


def word_descriptor(qweight: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The TMA descriptor of the packed words ``qweight [N, K / 8]`` (int32) in blocks of
    ``block_n`` outputs by ``block_k`` inputs, stored unswizzled (a thread reads whole
    rows); rows past ``N`` read as zeros."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor.from_tensor(qweight, [block_n, block_k // 8], layout)


@constexpr_function
def unpack_layout_of(block_n: int, words: int, num_warps: int) -> gl.DistributedLinearLayout:
    """Where the pairs of a ``[block_n, words, 4]`` tile of packed words (output, word, pair)
    live: exactly where ``wgmma``'s register operand (16-output rows a warp, ``k_width`` 2)
    wants the two weights a pair makes, so no value moves between threads. Lane ``l`` makes
    pair ``l % 4`` of outputs ``l // 4`` and ``l // 4 + 8`` of its warp's 16, of every word
    (the four lanes of a quad read the same words)."""
    assert block_n == 16 * num_warps, (block_n, num_warps)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << b, 0] for b in range(words.bit_length() - 1)] + [[8, 0, 0]],
        lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16 << b, 0, 0] for b in range(num_warps.bit_length() - 1)],
        block_bases=[], shape=[block_n, words, 4])


@constexpr_function
def store_layout_of(block_n: int, block_m: int, num_warps: int) -> gl.BlockedLayout:
    """How the ``[block_n, block_m]`` result is stored: each thread holds a run of up to 8
    outputs of one row of ``out`` (contiguous), the threads and warps spread over the rows
    first (8 rows a warp at most)."""
    lanes_m = min(8, block_m)
    warps_m = max(1, min(num_warps, block_m // lanes_m))
    run = max(1, min(8, block_n // ((32 // lanes_m) * (num_warps // warps_m))))
    return gl.BlockedLayout([run, 1], [32 // lanes_m, lanes_m], [num_warps // warps_m, warps_m],
                            [0, 1])


@gluon.jit
def _weight_tile(q, scale, zero, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 PAIRED: gl.constexpr, unpack_layout: gl.constexpr, dtype: gl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` weights ``(q - zero) * scale`` in ``dtype`` from the packed
    words ``q [BLOCK_N, BLOCK_K / 8]`` (``scale``, ``zero``: ``[BLOCK_N]``), rounded once.
    A word shifted right by ``4p`` holds its values ``2p`` and ``2p + 1`` in bits 0-3 and
    16-19; a thread makes pair ``p`` of each of its words (``unpack_layout`` over words and
    pairs): two at a time in half precision (``PAIRED``: one lop3 makes ``B + q``, one paired
    subtraction of ``B + zero`` leaves ``q - zero`` exactly, one paired multiplication
    rounds), or one at a time in float32 (the bits of ``2^23 + q`` less ``2^23 + zero``,
    exact): the same weights."""
    p = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, unpack_layout)))
    shifts = gl.expand_dims(gl.expand_dims((p * 4).to(gl.uint32), 0), 0)
    pairs = gl.expand_dims(q, 2) >> shifts
    if PAIRED:
        BF16: gl.constexpr = dtype == gl.bfloat16
        BASE: gl.constexpr = 0x4300 if BF16 else 0x6400  # the bits of B
        base_zero = BASE | zero.to(gl.uint32)
        scale_bits = scale.to(gl.uint16, bitcast=True).to(gl.uint32)
        base_zeros = gl.expand_dims(gl.expand_dims((base_zero << 16) | base_zero, 1), 2)
        scales = gl.expand_dims(gl.expand_dims((scale_bits << 16) | scale_bits, 1), 2)
        low, high = gl.inline_asm_elementwise(
            _PAIR_ASM_BF16 if BF16 else _PAIR_ASM_F16, "=h,=h,r,r,r",
            [pairs, base_zeros, scales], dtype=(dtype.value, dtype.value), is_pure=True, pack=1)
    else:
        zeros = gl.expand_dims(gl.expand_dims(zero.to(gl.float32) + 8388608.0, 1), 2)
        scales = gl.expand_dims(gl.expand_dims(scale.to(gl.float32), 1), 2)
        low = (((pairs & 15) | 0x4B000000).to(gl.float32, bitcast=True) - zeros) * scales
        high = ((((pairs >> 16) & 15) | 0x4B000000).to(gl.float32, bitcast=True) - zeros) * scales
        low, high = low.to(dtype), high.to(dtype)
    return gl.reshape(gl.join(low, high), [BLOCK_N, BLOCK_K])


@gluon.jit
def _step(i, scale, zero, acc, x_desc, x_smem, ready, w_desc, w_smem, w_ready, s_rows, z_rows,
          k0, num_k, off_m, off_n, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
          BLOCK_K: gl.constexpr, STAGES: gl.constexpr, WORD_STAGES: gl.constexpr,
          PAIRED: gl.constexpr, unpack_layout: gl.constexpr, a_layout: gl.constexpr,
          dtype: gl.constexpr):
    """Step ``i`` of the program's ``num_k`` steps over ``K``, step ``k0 + i`` of the whole
    (the module docstring): the weight tile made from the words of stage
    ``i % WORD_STAGES`` and ``scale``, ``zero``, its product issued, the word and activation
    stages the product before it read refilled; returns tile ``i + 1``'s scales and zero
    points, and ``acc``."""
    group_next = (k0 + gl.minimum(i + 1, num_k - 1)) * BLOCK_K // GROUP
    scale_next = gl.load(s_rows + group_next)
    zero_next = gl.load(z_rows + group_next)

    word_stage = i % WORD_STAGES
    mbarrier.wait(w_ready.index(word_stage), (i // WORD_STAGES) & 1)
    q = w_smem.index(word_stage).load(gl.SliceLayout(2, unpack_layout))
    w = _weight_tile(q.to(gl.uint32, bitcast=True), scale, zero, BLOCK_N, BLOCK_K, PAIRED,
                     unpack_layout, dtype)
    a = gl.convert_layout(w, a_layout)  # no data moves: the layouts place values alike
    stage = i % STAGES
    mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
    acc = warpgroup_mma(a, x_smem.index(stage).permute((1, 0)), acc, is_async=True)
    # The wait names the next scales, not the accumulator or the operand: an instruction
    # that defines those under a product in flight makes ptxas wait for every product.
    scale_next = warpgroup_mma_wait(num_outstanding=1, deps=(scale_next, ))

    # The product before this one is done: the stages it read take tiles further on.
    ahead = i + STAGES - 1
    mbarrier.expect(ready.index(ahead % STAGES), x_desc.block_type.nbytes, pred=ahead < num_k)
    tma.async_copy_global_to_shared(x_desc, [off_m, (k0 + ahead) * BLOCK_K],
                                    ready.index(ahead % STAGES), x_smem.index(ahead % STAGES),
                                    pred=ahead < num_k)
    _load_words(w_desc, w_smem, w_ready, off_n, k0, i + WORD_STAGES - 1, num_k, BLOCK_K,
                WORD_STAGES)
    return scale_next, zero_next, acc


@gluon.jit
def _load_words(w_desc, w_smem, w_ready, off_n, k0, step, num_k, BLOCK_K: gl.constexpr,
                WORD_STAGES: gl.constexpr):
    """Ask TMA for the packed words of the program's step ``step`` (none past its last)."""
    stage = step % WORD_STAGES
    mbarrier.expect(w_ready.index(stage), w_desc.block_type.nbytes, pred=step < num_k)
    tma.async_copy_global_to_shared(w_desc, [off_n, (k0 + step) * (BLOCK_K // 8)],
                                    w_ready.index(stage), w_smem.index(stage), pred=step < num_k)


@gluon.jit
def int4_wgmma_kernel(x_desc, w_desc, s_ptr, z_ptr, bias_ptr, out_ptr, partials_ptr,
                      locks_ptr, M, N, K, stride_sn, stride_om, GROUP: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                      STAGES: gl.constexpr, WORD_STAGES: gl.constexpr, SPLIT: gl.constexpr,
                      HAS_BIAS: gl.constexpr, PAIRED: gl.constexpr,
                      num_warps: gl.constexpr):
    """``out[m, n] = sum_k x[m, k] (q[n, k] - zero) scale (+ bias[n])``, ``x`` and the words
    ``q`` through the TMA descriptors ``x_desc`` (blocks of ``BLOCK_M x BLOCK_K``) and
    ``w_desc`` (``BLOCK_N x BLOCK_K / 8``); ``BLOCK_K`` divides ``K`` and ``GROUP``. Program
    (i, j) owns activation rows ``i * BLOCK_M`` and outputs ``j * BLOCK_N`` on (programs over
    rows first, so one weight tile's readers run together and its second read hits L2).
    Program (i, j, s) sums slice ``s`` of ``K``'s ``SPLIT`` slices of steps into
    ``partials[s]`` (float32, ``[SPLIT, M, N]``, rows ``stride_om`` apart like ``out``'s);
    the last of a tile's slices to finish adds them (``locks``: one int32 counter a tile of
    ``(i, j)``, 0 before the launch and after it)."""
    WORDS: gl.constexpr = BLOCK_K // 8
    dtype: gl.constexpr = x_desc.dtype
    off_m = gl.program_id(0) * BLOCK_M
    off_n = gl.program_id(1) * BLOCK_N

    unpack_layout: gl.constexpr = unpack_layout_of(BLOCK_N, WORDS, num_warps)
    n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, unpack_layout)))
    n_rows = gl.minimum(n, N - 1)
    s_rows = s_ptr + n_rows.to(gl.int64) * stride_sn
    z_rows = z_ptr + n_rows.to(gl.int64) * stride_sn

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    x_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [WORD_STAGES, BLOCK_N, WORDS], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [WORD_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(WORD_STAGES):
        mbarrier.init(w_ready.index(s), count=1)

    num_k = K // BLOCK_K // SPLIT
    k0 = gl.program_id(2) * num_k if SPLIT > 1 else 0
    for t in gl.static_range(WORD_STAGES - 1):
        _load_words(w_desc, w_smem, w_ready, off_n, k0, t, num_k, BLOCK_K, WORD_STAGES)
    for t in gl.static_range(STAGES - 1):
        mbarrier.expect(ready.index(t), x_desc.block_type.nbytes, pred=t < num_k)
        tma.async_copy_global_to_shared(x_desc, [off_m, (k0 + t) * BLOCK_K], ready.index(t),
                                        x_smem.index(t), pred=t < num_k)
    scale = gl.load(s_rows + k0 * BLOCK_K // GROUP)
    zero = gl.load(z_rows + k0 * BLOCK_K // GROUP)

    acc = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout))
    # Two steps a turn: the register operand of one step's product is read while the next
    # step makes its own, so the two live in different registers (one operand redefined
    # under a product in flight makes ptxas wait for every product).
    for i in range(0, num_k - 1, 2):
        scale, zero, acc = _step(i, scale, zero, acc, x_desc, x_smem, ready, w_desc, w_smem,
                                 w_ready, s_rows, z_rows, k0, num_k, off_m, off_n, GROUP, BLOCK_N,
                                 BLOCK_K, STAGES, WORD_STAGES, PAIRED, unpack_layout, a_layout,
                                 dtype)
        scale, zero, acc = _step(i + 1, scale, zero, acc, x_desc, x_smem, ready, w_desc, w_smem,
                                 w_ready, s_rows, z_rows, k0, num_k, off_m, off_n, GROUP, BLOCK_N,
                                 BLOCK_K, STAGES, WORD_STAGES, PAIRED, unpack_layout, a_layout,
                                 dtype)
    if num_k % 2:
        scale, zero, acc = _step(num_k - 1, scale, zero, acc, x_desc, x_smem, ready, w_desc,
                                 w_smem, w_ready, s_rows, z_rows, k0, num_k, off_m, off_n, GROUP,
                                 BLOCK_N, BLOCK_K, STAGES, WORD_STAGES, PAIRED, unpack_layout,
                                 a_layout, dtype)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
    for s in gl.static_range(WORD_STAGES):
        mbarrier.invalidate(w_ready.index(s))

    store_layout: gl.constexpr = store_layout_of(BLOCK_N, BLOCK_M, num_warps)
    result = gl.convert_layout(acc, store_layout)
    out_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, store_layout))
    out_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, store_layout))
    offsets = gl.expand_dims(out_m.to(gl.int64), 0) * stride_om + gl.expand_dims(out_n, 1)
    inside = gl.expand_dims(out_m < M, 0) & gl.expand_dims(out_n < N, 1)
    if SPLIT > 1:
        # Each slice's sums go to the float32 ``partials``; the tile's last slice to finish
        # (its counter in ``locks`` says which) adds them all in slice order and stores the
        # result, so the sum does not depend on timing, and sets the counter back to 0.
        gl.store(partials_ptr + gl.program_id(2) * M * stride_om + offsets, result, mask=inside)
        gl.thread_barrier()
        lock = locks_ptr + gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
        last = gl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            result = gl.load(partials_ptr + offsets, mask=inside, other=0.0, cache_modifier=".cg")
            for s in gl.static_range(1, SPLIT):
                result += gl.load(partials_ptr + s * M * stride_om + offsets, mask=inside,
                                  other=0.0, cache_modifier=".cg")
            gl.atomic_xchg(lock, 0)
        inside = inside & last
    if HAS_BIAS:
        bias = gl.load(bias_ptr + out_n, mask=out_n < N, other=0.0)
        result = result + gl.expand_dims(bias.to(gl.float32), 1)
    gl.store(out_ptr + offsets, result.to(out_ptr.dtype.element_ty), mask=inside)
