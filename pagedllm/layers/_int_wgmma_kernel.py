"""A Hopper kernel for 4-bit weights in decode batches of 65 and more rows (imported only
when it launches): ``x [M, K] @ W.T`` with ``W`` in the stored layout of
``pagedllm.quantization.int_weights``, written in Gluon so that the weight tile made in
registers is ``wgmma``'s register operand, made while the previous tile's product runs.

The product is computed transposed, ``W x^T``: a program owns ``BLOCK_N`` outputs (the
``wgmma`` rows, whose operand comes from registers) by ``BLOCK_M`` activation rows (its
columns, read from shared memory), and walks ``K`` in ``BLOCK_K`` steps. Step ``i``:

1. the packed words of tile ``i`` (loaded during step ``i - 1``) are unpacked and scaled,
   ``(q - zero) * scale`` rounded once to the activation dtype (as
   ``_int_matmul_kernels.int_weight_tile`` makes them: the same weights bit for bit), and
   laid out as the register operand, while the words of tile ``i + 1`` load;
2. once the activation tile ``i`` has arrived (TMA, ``STAGES`` tiles in flight), ``wgmma``
   multiplies, asynchronously;
3. the step waits until only that product is in flight: the one before it is done, so its
   activation stage takes the copy of tile ``i + STAGES - 1``.

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

from pagedllm.layers._int_matmul_kernels import _PAIR_ASM_BF16, _PAIR_ASM_F16


def activation_descriptor(x: torch.Tensor, block_m: int, block_k: int) -> TensorDescriptor:
    """The TMA descriptor of ``x [M, K]`` (row-major, 16-byte aligned rows) in blocks of
    ``block_m x block_k``; rows past ``M`` read as zeros."""
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], dtype)
    return TensorDescriptor.from_tensor(x, [block_m, block_k], layout)


@gluon.jit
def _weight_tile(q, scale, zero, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 PAIRED: gl.constexpr, unpack_layout: gl.constexpr, dtype: gl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` weights ``(q - zero) * scale`` in ``dtype`` from the packed
    words ``q [BLOCK_N, BLOCK_K / 8]`` (``scale``, ``zero``: ``[BLOCK_N]``), rounded once:
    in float32 (the bits of ``2^23 + q`` less ``2^23 + zero``, exact), or two at a time in
    half precision (``PAIRED``: a word shifted by ``4p`` holds values ``2p`` and ``2p + 1``
    in bits 0-3 and 16-19; one lop3 makes ``B + q``, one paired subtraction of ``B + zero``
    leaves ``q - zero`` exactly, one paired multiplication rounds): the same weights."""
    if PAIRED:
        p = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, unpack_layout)))
        shifts = gl.expand_dims(gl.expand_dims((p * 4).to(gl.uint32), 0), 0)
        pairs = gl.expand_dims(q, 2) >> shifts
        BF16: gl.constexpr = dtype == gl.bfloat16
        BASE: gl.constexpr = 0x4300 if BF16 else 0x6400  # the bits of B
        base_zero = BASE | zero.to(gl.uint32)
        scale_bits = scale.to(gl.uint16, bitcast=True).to(gl.uint32)
        base_zeros = gl.expand_dims(gl.expand_dims((base_zero << 16) | base_zero, 1), 2)
        scales = gl.expand_dims(gl.expand_dims((scale_bits << 16) | scale_bits, 1), 2)
        low, high = gl.inline_asm_elementwise(
            _PAIR_ASM_BF16 if BF16 else _PAIR_ASM_F16, "=h,=h,r,r,r",
            [pairs, base_zeros, scales], dtype=(dtype.value, dtype.value), is_pure=True, pack=1)
        w = gl.join(low, high)
    else:
        # Value c of a word sits at bits 4 * (c // 2 + 4 * (c % 2)) (stored_slots).
        c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, unpack_layout)))
        shifts = gl.expand_dims(gl.expand_dims(((c // 2 + 4 * (c % 2)) * 4).to(gl.uint32), 0), 0)
        values = (gl.expand_dims(q, 2) >> shifts) & 15
        numbers = (values | 0x4B000000).to(gl.float32, bitcast=True) - gl.expand_dims(
            gl.expand_dims(zero.to(gl.float32) + 8388608.0, 1), 2)
        w = (numbers * gl.expand_dims(gl.expand_dims(scale.to(gl.float32), 1), 2)).to(dtype)
    return gl.reshape(w, [BLOCK_N, BLOCK_K])


@gluon.jit
def _step(i, q, scale, zero, acc, x_desc, x_smem, ready, w_tile, s_rows, z_rows, n, N, K,
          off_m, GROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          STAGES: gl.constexpr, PAIRED: gl.constexpr, unpack_layout: gl.constexpr,
          a_layout: gl.constexpr, dtype: gl.constexpr):
    """Step ``i`` of the loop over ``K`` (the module docstring): the weight tile made from
    ``q``, ``scale``, ``zero``, its product issued, the activation stage the product before
    it read refilled; returns tile ``i + 1``'s words, scales and zero points, and ``acc``."""
    num_k = K // BLOCK_K
    k_next = (i + 1) * BLOCK_K
    q_next = gl.load(w_tile + (i + 1) * (BLOCK_K // 8),
                     mask=gl.expand_dims(n < N, 1) & (k_next < K))
    group_next = gl.minimum(k_next, K - 1) // GROUP
    scale_next = gl.load(s_rows + group_next)
    zero_next = gl.load(z_rows + group_next)

    w = _weight_tile(q, scale, zero, BLOCK_N, BLOCK_K, PAIRED, unpack_layout, dtype)
    a = gl.convert_layout(w, a_layout)
    stage = i % STAGES
    mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
    acc = warpgroup_mma(a, x_smem.index(stage).permute((1, 0)), acc, is_async=True)
    # The wait names the next words, not the accumulator or the operand: an instruction that
    # defines those under a product in flight makes ptxas wait for every product.
    q_next = warpgroup_mma_wait(num_outstanding=1, deps=(q_next, ))

    ahead = i + STAGES - 1  # into the stage the product just waited for had read
    mbarrier.expect(ready.index(ahead % STAGES), x_desc.block_type.nbytes, pred=ahead < num_k)
    tma.async_copy_global_to_shared(x_desc, [off_m, ahead * BLOCK_K], ready.index(ahead % STAGES),
                                    x_smem.index(ahead % STAGES), pred=ahead < num_k)
    return q_next.to(gl.uint32, bitcast=True), scale_next, zero_next, acc


@gluon.jit
def int4_wgmma_kernel(x_desc, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K,
                      stride_wn, stride_sn, stride_om,
                      GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                      PAIRED: gl.constexpr, num_warps: gl.constexpr):
    """``out[m, n] = sum_k x[m, k] (q[n, k] - zero) scale (+ bias[n])``, ``x`` through the
    TMA descriptor ``x_desc`` (blocks of ``BLOCK_M x BLOCK_K``); ``BLOCK_K`` divides ``K``
    and ``GROUP``. Program (i, j) owns activation rows ``i * BLOCK_M`` and outputs
    ``j * BLOCK_N`` on (programs over rows first, so one weight tile's readers run together
    and its second read hits L2)."""
    WORDS: gl.constexpr = BLOCK_K // 8
    dtype: gl.constexpr = x_desc.dtype
    off_m = gl.program_id(0) * BLOCK_M
    off_n = gl.program_id(1) * BLOCK_N

    # A thread unpacks whole words: 8 values, or 4 pairs of them (PAIRED).
    unpack_layout: gl.constexpr = gl.BlockedLayout(
        [1, 1, 4 if PAIRED else 8], [32 // WORDS, WORDS, 1], [num_warps, 1, 1], [2, 1, 0])
    word_layout: gl.constexpr = gl.SliceLayout(2, unpack_layout)
    n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, word_layout))
    n_rows = gl.minimum(n, N - 1)
    words = gl.arange(0, WORDS, layout=gl.SliceLayout(0, word_layout))
    w_tile = w_ptr + gl.expand_dims(n_rows.to(gl.int64) * stride_wn, 1) + gl.expand_dims(words, 0)
    s_rows = s_ptr + n_rows.to(gl.int64) * stride_sn
    z_rows = z_ptr + n_rows.to(gl.int64) * stride_sn

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    x_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)

    num_k = K // BLOCK_K
    for t in gl.static_range(STAGES - 1):
        mbarrier.expect(ready.index(t), x_desc.block_type.nbytes, pred=t < num_k)
        tma.async_copy_global_to_shared(x_desc, [off_m, t * BLOCK_K], ready.index(t),
                                        x_smem.index(t), pred=t < num_k)
    q = gl.load(w_tile).to(gl.uint32, bitcast=True)
    scale = gl.load(s_rows)
    zero = gl.load(z_rows)

    acc = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout))
    # Two steps a turn: the register operand of one step's product is read while the next
    # step makes its own, so the two live in different registers (one operand redefined
    # under a product in flight makes ptxas wait for every product).
    for i in range(0, num_k - 1, 2):
        q, scale, zero, acc = _step(i, q, scale, zero, acc, x_desc, x_smem, ready, w_tile,
                                    s_rows, z_rows, n, N, K, off_m, GROUP, BLOCK_N, BLOCK_K,
                                    STAGES, PAIRED, unpack_layout, a_layout, dtype)
        q, scale, zero, acc = _step(i + 1, q, scale, zero, acc, x_desc, x_smem, ready, w_tile,
                                    s_rows, z_rows, n, N, K, off_m, GROUP, BLOCK_N, BLOCK_K,
                                    STAGES, PAIRED, unpack_layout, a_layout, dtype)
    if num_k % 2:
        q, scale, zero, acc = _step(num_k - 1, q, scale, zero, acc, x_desc, x_smem, ready,
                                    w_tile, s_rows, z_rows, n, N, K, off_m, GROUP, BLOCK_N,
                                    BLOCK_K, STAGES, PAIRED, unpack_layout, a_layout, dtype)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    # Stored through a layout whose threads hold runs of outputs: whole rows of ``out``.
    store_layout: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, num_warps], [0, 1])
    result = gl.convert_layout(acc, store_layout)
    out_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, store_layout))
    out_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, store_layout))
    if HAS_BIAS:
        bias = gl.load(bias_ptr + out_n, mask=out_n < N, other=0.0)
        result = result + gl.expand_dims(bias.to(gl.float32), 1)
    out = out_ptr + gl.expand_dims(out_m.to(gl.int64), 0) * stride_om + gl.expand_dims(out_n, 1)
    gl.store(out, result.to(dtype),
             mask=gl.expand_dims(out_m < M, 0) & gl.expand_dims(out_n < N, 1))
