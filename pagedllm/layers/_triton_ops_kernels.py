"""The Triton kernels behind ``triton_ops.py`` (imported only when a CUDA tensor needs them).

Each program owns one row (RMSNorm: one token, or one token's head for per-head norms;
rotary: one token with all its heads; SiLU-and-mul: one ``BLOCK`` slice of one token), so
no kernel depends on another program's output and all of them can be captured in a CUDA
graph; the row argmax is the exception, two launches, the second reading the first's
per-part winners, and the small-batch product, whose last program to finish a column
block (or the launch) does its final step. Offsets are computed in int64.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pagedllm.layers._int_matmul_kernels import int_row_products, int_row_tile, int_weight_tile
from pagedllm.layers.launch_math import cdiv, next_power_of_2  # noqa: F401 - host helpers for launches


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """With ``PDL`` (set by ``pagedllm.layers.pdl.launch_options``): wait until the kernel
    before this one has completed and its writes are visible. Called before any load or
    store (the contract in ``pagedllm.layers.pdl``); without ``PDL`` it is nothing."""
    if PDL:
        gdc_wait()


@triton.jit
def release_next_kernel(PDL: tl.constexpr):
    """With ``PDL``: the next kernel's programs may be placed once every program of this
    one has come here (or ended). Its programs then hold their registers and shared memory
    while they wait, so a kernel that fills the GPU calls this after its main loop."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def follow_previous_kernel(PDL: tl.constexpr):
    """``wait_for_previous_kernel`` then ``release_next_kernel``: for short kernels."""
    wait_for_previous_kernel(PDL)
    release_next_kernel(PDL)


@triton.jit
def rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    scale_ptr,
    input_scale_ptr,
    row_scale_ptr,
    col_scale_ptr,
    stride_xt,
    stride_rt,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FP8_OUT: tl.constexpr,
    STATIC_INPUT: tl.constexpr,
    SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row per program. With ``FP8_OUT`` the normalised row (rounded to the input
    dtype, as without) is quantized as ``quantize_rows_kernel`` quantizes it: FP8
    into ``out`` and the row's float32 scale into ``scale``. ``SCALED``: ``x`` holds an
    FP8 product's sums before its scales (``scaled_sums``)."""
    follow_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    row_scale = 1.0
    if SCALED:
        row_scale = tl.load(row_scale_ptr + row)
    y = _rms_norm_row(
        x_ptr + row * stride_xt, residual_ptr + row * stride_rt,
        weight_ptr, out_ptr + row * N, residual_out_ptr + row * N, eps,
        N, BLOCK, HAS_RESIDUAL, "", not FP8_OUT, row_scale, col_scale_ptr, SCALED,
    )
    if FP8_OUT:
        cols = tl.arange(0, BLOCK)
        scale = fp8_row_scale(tl.max(tl.abs(y), 0), input_scale_ptr, STATIC_INPUT)
        tl.store(out_ptr + row * N + cols, to_fp8(y, scale), mask=cols < N)
        tl.store(scale_ptr + row, scale)


@triton.jit
def head_rms_norm_kernel(
    x_ptr,
    weight_ptr,
    later_weight_ptr,
    out_ptr,
    later_out_ptr,
    heads,
    later_from,
    stride_xt,
    stride_xh,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    """Every head of one token of ``x [T, heads, N]`` per program, each normalised as
    ``_rms_norm_row`` does: heads before ``later_from`` with ``weight`` into the contiguous
    ``out [T, later_from, N]``, the others with ``later_weight`` into ``later_out [T, heads -
    later_from, N]``. ``BLOCK_H >= heads``."""
    follow_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, BLOCK_H)
    first_group = head < later_from
    cols = tl.arange(0, BLOCK)
    col_valid = cols < N
    mask = (head < heads)[:, None] & col_valid[None, :]
    x = tl.load(x_ptr + token * stride_xt + (head * stride_xh)[:, None] + cols[None, :],
                mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=1) / N
    normed = (x * tl.math.rsqrt(mean_square + eps)[:, None]).to(dtype)
    first = tl.load(weight_ptr + cols, mask=col_valid, other=0.0)
    later = tl.load(later_weight_ptr + cols, mask=col_valid, other=0.0)
    w = tl.where(first_group[:, None], first[None, :], later[None, :])
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(dtype)
    dest = tl.where(first_group, out_ptr + (token * later_from + head) * N,
                    later_out_ptr + (token * (heads - later_from) + head - later_from) * N)
    tl.store(dest[:, None] + cols[None, :], y, mask=mask)


@triton.jit
def _rms_norm_row(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    X_CACHE: tl.constexpr,
    STORE: tl.constexpr,
    row_scale=1.0,
    col_scale_ptr=None,
    SCALED: tl.constexpr = False,
):
    """One row of ``N`` values: ``out = norm(x (+ residual))``, rounded as ``RMSNorm``
    rounds, and the sum into ``residual_out``. ``X_CACHE`` is the load cache modifier of
    ``x`` (``".cg"`` when other programs of the same launch wrote it). Returns the
    normalised row in float32 (its values in the input dtype; 0 past ``N``), stored into
    ``out`` only with ``STORE``. ``SCALED``: ``x`` is first scaled by ``row_scale`` and
    ``col_scale [N]`` (float32) and rounded to its dtype (``scaled_sums``)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + cols, mask=mask, other=0.0, cache_modifier=X_CACHE)
    dtype = x.dtype
    x = x.to(tl.float32)
    if SCALED:
        x = scaled_sums(x, row_scale, col_scale_ptr, cols, mask, dtype)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + cols, mask=mask, other=0.0)
        s = (x + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + cols, s, mask=mask)
        x = s.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / N
    normed = (x * tl.math.rsqrt(mean_square + eps)).to(dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(dtype)
    if STORE:
        tl.store(out_ptr + cols, y, mask=mask)
    return y.to(tl.float32)


@triton.jit
def scaled_sums(sums, row_scale, col_scale_ptr, cols, mask, dtype: tl.constexpr):
    """An FP8 product's outputs from its sums (float32 of ``dtype`` values, columns
    ``cols``): ``sums * row_scale * col_scale[cols]`` rounded to ``dtype``, as the product
    with its scales applied rounds them (``pagedllm.quantization.fp8.Fp8Sums``)."""
    col_scale = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
    return (sums * row_scale * col_scale).to(dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_part(x_ptr, cols, mask, d, row_scale=1.0, col_scale_ptr=None,
                       SCALED: tl.constexpr = False):
    """``silu(gate) * up`` of one row's columns ``cols``, rounded as ``GatedActivation``
    rounds (SiLU to the input dtype, then the product): float32 of input-dtype values.
    ``SCALED``: the row holds an FP8 product's sums before its scales (``scaled_sums``;
    ``col_scale`` has ``2d`` values, the gate's then the up projection's)."""
    gate = tl.load(x_ptr + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + d + cols, mask=mask, other=0.0)
    return _silu_and_mul_of(gate, up, cols, mask, d, row_scale, col_scale_ptr, SCALED)


@triton.jit
def _silu_and_mul_of(gate, up, cols, mask, d, row_scale, col_scale_ptr, SCALED: tl.constexpr):
    """``_silu_and_mul_part`` of the loaded ``gate`` and ``up`` columns ``cols``."""
    dtype = gate.dtype
    g = gate.to(tl.float32)
    u = up.to(tl.float32)
    if SCALED:
        g = scaled_sums(g, row_scale, col_scale_ptr, cols, mask, dtype)
        u = scaled_sums(u, row_scale, col_scale_ptr + d, cols, mask, dtype)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)
    return (act.to(tl.float32) * u).to(dtype).to(tl.float32)


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, row_scale_ptr, col_scale_ptr, stride_x, stride_o, d,
                        BLOCK: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
    follow_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    row_scale = 1.0
    if SCALED:
        row_scale = tl.load(row_scale_ptr + row)
    y = _silu_and_mul_part(x_ptr + row * stride_x, cols, mask, d, row_scale, col_scale_ptr,
                           SCALED)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_and_mul_fp8_kernel(x_ptr, out_ptr, scale_ptr, input_scale_ptr, row_scale_ptr,
                            col_scale_ptr, stride_x, d, num_rows,
                            BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                            STATIC_INPUT: tl.constexpr, SCALED: tl.constexpr,
                            PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """Rows ``program_id, program_id + num_programs, ...`` of ``num_rows``:
    ``silu_and_mul_kernel``'s values, quantized as ``quantize_rows_kernel`` quantizes them,
    into FP8 ``out`` (contiguous rows of ``d``) and each row's float32 scale into ``scale``.
    A program walks its rows in one loop (one program a multiprocessor keeps each row in
    registers and takes the next once it is stored). ``ONE_PASS``
    (``d <= BLOCK``): a row is read once and kept in registers; wider rows take two
    passes, the second computing each part again (its inputs from cache). ``SCALED``: as
    in ``_silu_and_mul_part``. ``PREFETCH`` (one pass): each iteration loads the program's
    next row before it computes, reduces and stores the row loaded the iteration before,
    so a program's loads overlap its own arithmetic; the same bytes and scales."""
    follow_previous_kernel(PDL)
    if PREFETCH:
        _silu_and_mul_fp8_rows_ahead(x_ptr, out_ptr, scale_ptr, input_scale_ptr, row_scale_ptr,
                                     col_scale_ptr, stride_x, d, num_rows, BLOCK, STATIC_INPUT,
                                     SCALED)
        return
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        offset = row + tl.zeros([], tl.int64)  # 64-bit row offsets
        x_row = x_ptr + offset * stride_x
        out_row = out_ptr + offset * d
        row_scale = 1.0
        if SCALED:
            row_scale = tl.load(row_scale_ptr + row)
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            y = _silu_and_mul_part(x_row, cols, cols < d, d, row_scale, col_scale_ptr,
                                   SCALED)
            scale = fp8_row_scale(tl.max(tl.abs(y), 0), input_scale_ptr, STATIC_INPUT)
            tl.store(out_row + cols, to_fp8(y, scale), mask=cols < d)
        else:
            amax = tl.zeros([BLOCK], tl.float32)
            if not STATIC_INPUT:
                for c0 in range(0, d, BLOCK):
                    cols = c0 + tl.arange(0, BLOCK)
                    part = _silu_and_mul_part(x_row, cols, cols < d, d, row_scale,
                                              col_scale_ptr, SCALED)
                    amax = tl.maximum(amax, tl.abs(part))
            scale = fp8_row_scale(tl.max(amax, 0), input_scale_ptr, STATIC_INPUT)
            for c0 in range(0, d, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                y = _silu_and_mul_part(x_row, cols, cols < d, d, row_scale, col_scale_ptr,
                                       SCALED)
                tl.store(out_row + cols, to_fp8(y, scale), mask=cols < d)
        tl.store(scale_ptr + row, scale)


@triton.jit
def _gate_up_row(x_ptr, row_scale_ptr, row, num_rows, stride_x, d, cols, mask,
                 SCALED: tl.constexpr):
    """Row ``row``'s gate and up columns ``cols`` and its row scale (``SCALED``; else 1),
    or zeros and 1 past ``num_rows``."""
    x_row = x_ptr + (row + tl.zeros([], tl.int64)) * stride_x
    gate = tl.load(x_row + cols, mask=mask & (row < num_rows), other=0.0)
    up = tl.load(x_row + d + cols, mask=mask & (row < num_rows), other=0.0)
    row_scale = 1.0
    if SCALED:
        row_scale = tl.load(row_scale_ptr + row, mask=row < num_rows, other=1.0)
    return gate, up, row_scale


@triton.jit
def _silu_and_mul_fp8_rows_ahead(x_ptr, out_ptr, scale_ptr, input_scale_ptr, row_scale_ptr,
                                 col_scale_ptr, stride_x, d, num_rows, BLOCK: tl.constexpr,
                                 STATIC_INPUT: tl.constexpr, SCALED: tl.constexpr):
    """``silu_and_mul_fp8_kernel`` with ``ONE_PASS`` and ``PREFETCH``: the row loop with
    the next row's gate, up and row scale carried from one iteration to the next."""
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    step = tl.num_programs(0)
    gate, up, row_scale = _gate_up_row(x_ptr, row_scale_ptr, tl.program_id(0), num_rows,
                                       stride_x, d, cols, mask, SCALED)
    for row in range(tl.program_id(0), num_rows, step):
        gate_ahead, up_ahead, row_scale_ahead = _gate_up_row(
            x_ptr, row_scale_ptr, row + step, num_rows, stride_x, d, cols, mask, SCALED)
        y = _silu_and_mul_of(gate, up, cols, mask, d, row_scale, col_scale_ptr, SCALED)
        scale = fp8_row_scale(tl.max(tl.abs(y), 0), input_scale_ptr, STATIC_INPUT)
        tl.store(out_ptr + (row + tl.zeros([], tl.int64)) * d + cols, to_fp8(y, scale),
                 mask=mask)
        tl.store(scale_ptr + row, scale)
        gate, up, row_scale = gate_ahead, up_ahead, row_scale_ahead


@triton.jit
def rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_ot,
    stride_oh,
    heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    mask = (h < heads)[:, None] & d_mask[None, :]
    c = tl.load(cos_ptr + token * stride_ct + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + token * stride_ct + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    x_row = x_ptr + token * stride_xt + h[:, None] * stride_xh + d[None, :]
    y1, y2 = rotate_half(x_row, c, s, mask, HALF)
    dtype = x_ptr.dtype.element_ty
    o_row = out_ptr + token * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(o_row, y1.to(dtype), mask=mask)
    tl.store(o_row + HALF, y2.to(dtype), mask=mask)


@triton.jit
def rotate_half(x_row, c, s, mask, HALF: tl.constexpr):
    """Loads the head rows at ``x_row`` (halves ``HALF`` elements apart) and returns the
    rotated halves ``(x1 * c - x2 * s, x2 * c + x1 * s)`` in float32 (rounded once by the
    caller, where it stores them)."""
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def rotate_half_whole(x_row, d, c, s, mask, HALF: tl.constexpr, row_scale=1.0,
                      col_scale_row=None, SCALED: tl.constexpr = False):
    """``rotate_half`` as one tile over every column ``d`` of the heads at ``x_row``:
    ``x[d] * c - x[d + HALF] * s`` in the first half, ``x[d] * c + x[d - HALF] * s`` in the
    second (the same products as ``rotate_half``), in float32; ``c, s`` hold
    ``cos, sin[d % HALF]``. ``SCALED``: the heads hold an FP8 product's sums, whose
    values are ``scaled_sums`` of ``row_scale`` and the column scales at ``col_scale_row``
    (laid out as the heads' columns)."""
    first = d < HALF
    other = tl.where(first, d + HALF, d - HALF)
    x = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(x_row + other, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        dtype = x_row.dtype.element_ty
        x = scaled_sums(x, row_scale, col_scale_row, d, mask, dtype)
        partner = scaled_sums(partner, row_scale, col_scale_row, other, mask, dtype)
    return tl.where(first, x * c - partner * s, x * c + partner * s)


@triton.jit(do_not_specialize=["chunk"])
def row_argmax_partial_kernel(
    logits_ptr, stride_row, temperature_ptr, seeds_ptr, best_ptr, index_ptr,
    vocab_size, chunk, rows_ptr, bitmask_ptr, bitmask_stride,
    GUMBEL: tl.constexpr,
    BLOCK: tl.constexpr,
    LANES: tl.constexpr,
    MASKED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(row, part)``: the best score in columns ``[part * chunk, (part + 1) * chunk)``
    of ``row`` and its column, into ``best[row, part]`` and ``index[row, part]``.

    With ``MASKED``, program row ``r`` races logits row ``rows[r]`` (its temperature and
    seed too) over the columns bit ``c % 32`` of word ``c // 32`` of ``bitmask`` row ``r``
    allows (int32 words): the others score -inf, as if masked in the logits.

    The score is the logit, or with ``GUMBEL`` ``logit / T + g`` with the Gumbel noise of
    ``_gumbel_noise``: it depends on the row's seed and the column only, so the draw does
    not depend on the batch or the split. The first column wins a tie; a part with nothing
    above -inf reports its first column.

    Each ``BLOCK`` of columns is reduced to its best as it is read, or with ``LANES`` each
    lane keeps the best of the columns it reads and the lanes are reduced once at the end
    (the loop then holds no reduction and no barrier); the same winner either way."""
    follow_previous_kernel(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    source = row
    if MASKED:
        source = tl.load(rows_ptr + row).to(tl.int32)
        words = bitmask_ptr + row.to(tl.int64) * bitmask_stride
    base = logits_ptr + source.to(tl.int64) * stride_row
    inv_temperature, seed = _race_inputs(temperature_ptr, seeds_ptr, source, GUMBEL)
    lo = part * chunk
    hi = tl.minimum(lo + chunk, vocab_size)
    if LANES:
        lane_best = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_index = lo + tl.arange(0, BLOCK)
    else:
        best = tl.full([], float("-inf"), tl.float32)
        best_index = lo
    for start in range(lo, hi, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        valid = offsets < hi
        score = _race_score(base, start, valid, inv_temperature, seed, GUMBEL, BLOCK)
        if MASKED:
            word = tl.load(words + offsets // 32, mask=valid, other=0)
            score = tl.where(((word >> (offsets % 32)) & 1) != 0, score, float("-inf"))
        if LANES:  # a lane's earlier column keeps a tie
            better = score > lane_best
            lane_index = tl.where(better, offsets, lane_index)
            lane_best = tl.where(better, score, lane_best)
        else:
            block_best = tl.max(score, 0)
            block_index = tl.argmax(score, 0, tie_break_left=True) + start
            better = block_best > best
            best_index = tl.where(better, block_index, best_index)
            best = tl.where(better, block_best, best)
    if LANES:  # the earliest column among the lanes holding the best
        best = tl.max(lane_best, 0)
        best_index = tl.min(tl.where(lane_best == best, lane_index, hi), 0)
    tl.store(best_ptr + row * parts + part, best)
    tl.store(index_ptr + row * parts + part, best_index)


@triton.jit
def _race_inputs(temperature_ptr, seeds_ptr, source, GUMBEL: tl.constexpr):
    """Row ``source``'s ``1 / T`` and noise seed for ``_race_score`` (unread without ``GUMBEL``)."""
    inv_temperature = 1.0
    seed = 0
    if GUMBEL:
        inv_temperature = 1.0 / tl.load(temperature_ptr + source)
        seed = tl.load(seeds_ptr + source)
    return inv_temperature, seed


@triton.jit
def _race_score(base, start, valid, inv_temperature, seed, GUMBEL: tl.constexpr,
                BLOCK: tl.constexpr):
    """The race's scores of columns ``start .. start + BLOCK - 1`` of the row at ``base``
    (-inf where not ``valid``): the logit, or with ``GUMBEL`` ``logit / T + g`` (Gumbel
    noise of ``_gumbel_noise``). Every kernel that ranks a row's tokens by the race scores
    them here, so they rank alike to the last bit."""
    offsets = start + tl.arange(0, BLOCK)
    score = tl.load(base + offsets, mask=valid, other=float("-inf")).to(tl.float32)
    if GUMBEL:
        score = tl.where(valid, score * inv_temperature + _gumbel_noise(seed, start, BLOCK),
                         float("-inf"))
    return score


@triton.jit
def race_top_kernel(logits_ptr, stride_row, temperature_ptr, seeds_ptr, rows_ptr, best_ptr,
                    column_ptr, vocab_size, GUMBEL: tl.constexpr, BLOCK: tl.constexpr,
                    TOP: tl.constexpr):
    """Program ``(r, block)``: the ``TOP`` best race scores (``_race_score``) among columns
    ``block * BLOCK ..`` of logits row ``rows[r]``, best first (the first column of a tie
    first), and their columns, into ``best`` and ``column`` ``[R, blocks, TOP]``."""
    r = tl.program_id(0)
    block = tl.program_id(1)
    start = block * BLOCK
    source = tl.load(rows_ptr + r).to(tl.int32)
    inv_temperature, seed = _race_inputs(temperature_ptr, seeds_ptr, source, GUMBEL)
    offsets = start + tl.arange(0, BLOCK)
    score = _race_score(logits_ptr + source.to(tl.int64) * stride_row, start,
                        offsets < vocab_size, inv_temperature, seed, GUMBEL, BLOCK)
    out = (r.to(tl.int64) * tl.num_programs(1) + block) * TOP
    for j in tl.static_range(TOP):
        best = tl.max(score, 0)
        where = tl.argmax(score, 0, tie_break_left=True)
        tl.store(best_ptr + out + j, best)
        tl.store(column_ptr + out + j, start + where)
        score = tl.where(tl.arange(0, BLOCK) == where, float("-inf"), score)


@triton.jit
def _gumbel_noise(seed, start, BLOCK: tl.constexpr):
    """Gumbel noise ``-log(-log(u))`` of columns ``start .. start + BLOCK - 1`` (``start``
    and ``BLOCK`` multiples of 4): column ``c`` takes ``u``, the ``c % 4``-th of the four
    uniforms of one Philox draw ``rand4x(seed, c // 4)``, so a draw serves four columns."""
    groups = start // 4 + tl.arange(0, BLOCK // 4)
    u0, u1, u2, u3 = tl.rand4x(seed, groups)
    u = tl.join(tl.join(u0, u1), tl.join(u2, u3))  # [BLOCK // 4, 2, 2]: column order
    return tl.reshape(-tl.log(-tl.log(u)), [BLOCK])


@triton.jit(do_not_specialize=["parts"])
def row_argmax_reduce_kernel(best_ptr, index_ptr, out_ptr, parts, BLOCK_PARTS: tl.constexpr,
                             PDL: tl.constexpr):
    """Row ``row``'s winner over its ``parts <= BLOCK_PARTS`` parts (the earliest part wins
    a tie) -> int64."""
    follow_previous_kernel(PDL)
    row = tl.program_id(0)
    p = tl.arange(0, BLOCK_PARTS)
    valid = p < parts
    best = tl.load(best_ptr + row * parts + p, mask=valid, other=float("-inf"))
    winner = tl.argmax(best, 0, tie_break_left=True)
    index = tl.load(index_ptr + row * parts + winner)
    tl.store(out_ptr + row, index.to(tl.int64))


@triton.jit
def refuse_masked_tokens_kernel(logits_ptr, stride_row, rows_ptr, bitmask_ptr, bitmask_stride,
                                vocab_size, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program ``(r, part)``: -inf into columns ``[part * BLOCK, (part + 1) * BLOCK)`` of
    logits row ``rows[r]`` that bit ``c % 32`` of word ``c // 32`` of ``bitmask`` row ``r``
    refuses (int32 words). Allowed columns are neither read nor written."""
    follow_previous_kernel(PDL)
    r = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < vocab_size
    words = tl.load(bitmask_ptr + r.to(tl.int64) * bitmask_stride + offsets // 32,
                    mask=valid, other=-1)
    refused = ((words >> (offsets % 32)) & 1) == 0
    row = tl.load(rows_ptr + r).to(tl.int64)
    tl.store(logits_ptr + row * stride_row + offsets,
             tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
             mask=valid & refused)


@triton.jit
def _int_row_inputs(x_rows, perm_ptr, m_valid, k0, HAS_PERM: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row's inputs ``k0 .. k0 + BLOCK_K`` in float32 (``HAS_PERM``: the columns the
    permutation names there), ``[1, BLOCK_K]``."""
    k = k0 + tl.arange(0, BLOCK_K)
    if HAS_PERM:
        k = tl.load(perm_ptr + k)
    return tl.load(x_rows + k[None, :], mask=m_valid[:, None], other=0.0).to(tl.float32)


@triton.jit
def small_batch_matmul_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    norm_weight_ptr, residual_ptr, normed_ptr, residual_out_ptr, counter_ptr,
    stride_rm, eps, weight_scale_ptr, input_scale_ptr,
    zeros_ptr, perm_ptr, stride_sn, partial_ptr, k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    SILU_GATED: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    W8A8: tl.constexpr,
    STATIC_INPUT: tl.constexpr,
    AMAX_BLOCK: tl.constexpr,
    ROW_LOOP: tl.constexpr,
    INT_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_PERM: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[:M, n-block] = x[:M] @ weight[n-block].T (+ bias)``, one program per ``BLOCK_N``
    output columns and ``K`` slice (``SPLIT`` slices of ``k_per_split`` inputs, a multiple
    of ``BLOCK_K``; one slice: the whole of ``K``).

    ``USE_DOT``: tensor-core tiles of ``BLOCK_M`` (>= 16) rows; else ``BLOCK_M == 1`` and
    the products accumulate lane-wise in float32 and are summed once at the end. Rows of
    ``weight`` past ``N`` read row ``N - 1`` and are never stored.

    ``SPLIT > 1``: each program stores its slice's float32 sums in ``partial``
    (``[SPLIT, M, N]``, ``[SPLIT, M, 2N]`` gated) and counts its arrival on
    ``counter[1 + n-block]``; the last of a column block's programs resets that counter,
    adds the ``SPLIT`` sums in slice order (the result does not depend on which program
    came last) and finishes the columns as one program would: scales, bias, activation,
    store, norm. So a narrow output still spreads over every SM, in one launch.

    ``SILU_GATED``: ``weight`` is ``[gate; up]`` (``2N`` rows) and the program multiplies its
    columns of both, storing ``silu(gate) * up`` rounded as ``silu_and_mul_kernel`` rounds
    the two products (an MLP's gate/up projection with its activation, ``N`` wide).

    ``NORM_BLOCK > 0``: the RMSNorm with residual that follows the product rides on it. The
    program that finishes the last column block (an arrival count on ``counter[0]``, reset
    by that program) normalises the ``M`` rows of ``out + residual`` as ``rms_norm_kernel``
    does, into ``normed`` and ``residual_out`` (``[M, N]``, contiguous; ``NORM_BLOCK >= N``).

    ``W8A8``: a W8A8 product, ``weight_scale`` holding the weight rows' float32 scales.
    "fp8" (``pagedllm.quantization.fp8``): ``weight`` is float8_e4m3fn and each row of
    ``x`` is quantized here as ``quantize_rows`` does (a first pass over ``K`` finds its
    largest magnitude). "int8" (``pagedllm.quantization.int8``): ``weight`` is int8 and
    ``x`` comes quantized (int8 rows, their float32 scales at ``input_scale_ptr``; IEEE
    division a value would cost here more than the product). The products accumulate in
    float32 (an int8 tensor-core tile's exact int32 sums, then float32) and the sums are
    scaled by both scales. One row in float32 lanes with ``EVEN_K`` and no act-order: each
    lane loads the inputs of its own part of the weight tile (``x`` in the tile's shape,
    ``BLOCK_N`` copies of the row from L1; FP8 quantizes them itself), so the loop
    exchanges nothing through shared memory and has no barrier. "" (empty): no quantized
    product.
    ``STATIC_INPUT``: every row of ``x`` is quantized with the one float32 at
    ``input_scale_ptr`` instead (static activation scales). ``AMAX_BLOCK``: the columns
    the largest-magnitude pass reads at once (each of its loads waits for the one before).
    ``ROW_LOOP`` (the launch sets it for one row and for lane-wise tiles): one row at a
    time, each ``AMAX_BLOCK`` wide (a row of up to 8k columns in one load); else
    ``BLOCK_M`` rows at a time, ``AMAX_BLOCK`` (the K tile) wide.

    ``INT_BITS`` (4 or 8): integer weights in the stored layout of
    ``pagedllm.quantization.int_weights`` (W4A16, W8A16): ``weight`` is the packed
    ``qweight [N, K / (32 / INT_BITS)]``, ``weight_scale`` the ``scales`` and ``zeros``
    the zero points (``[N, K / GROUP]``, row stride ``stride_sn``); ``BLOCK_K`` divides
    ``GROUP`` and ``K``. On tensor cores a weight is ``(q - zero) * scale``
    (``int_weight_tile``) rounded to ``x``'s dtype; one row sums ``(q - zero) * x`` per
    column and tile and scales the sum (``int_row_products``: three instructions a weight),
    each iteration loading the next tile (words, scales, zero points, inputs) before it
    multiplies the one loaded the iteration before, so the loads of one overlap the
    arithmetic of the other (the last iteration loads its own tile again).
    ``HAS_PERM``: act-order, stored column ``k`` multiplies ``x[perm[k]]``.
    ``PDL``: launched early (``pagedllm.layers.pdl``); the next kernel is released after
    the main loop, so its waiting programs take no room from this one's.
    """
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    n_rows = tl.minimum(n, N - 1).to(tl.int64)
    w_rows = weight_ptr + n_rows[:, None] * stride_wn
    up_rows = w_rows + N * stride_wn
    m = tl.arange(0, BLOCK_M)
    m_valid = m < M
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    # Integer weights, one row: sums per column (int_row_products), else lane-wise sums.
    INT_ROWS: tl.constexpr = INT_BITS > 0 and not USE_DOT
    # W8A8, one row, float32 lanes: x loaded in the weight tile's shape (BLOCK_N copies of
    # the row).
    ROW_TILE_X: tl.constexpr = W8A8 != "" and not USE_DOT and EVEN_K and not HAS_PERM
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    elif INT_ROWS:
        acc = tl.zeros([BLOCK_N], tl.float32)
        # The bits of 1.0f in a register (K >> 31 is 0; K is never specialized to a
        # constant as M == 1 is): one and/or instruction, not two.
        one_bits = ((K >> 31) | 0x3F800000).to(tl.uint32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros_like(acc)
    if W8A8 == "fp8":
        amax = tl.zeros([BLOCK_M], tl.float32)
    if W8A8 == "fp8" and not STATIC_INPUT:
        if ROW_LOOP:
            for r in range(0, M):
                row_max = tl.zeros([AMAX_BLOCK], tl.float32)
                for k0 in range(0, K, AMAX_BLOCK):
                    k = k0 + tl.arange(0, AMAX_BLOCK)
                    xa = tl.load(x_ptr + r * stride_xm + k, mask=k < K, other=0.0)
                    row_max = tl.maximum(row_max, tl.abs(xa.to(tl.float32)))
                amax = tl.where(m == r, tl.max(row_max, 0), amax)
        else:
            for k0 in range(0, K, AMAX_BLOCK):
                k = k0 + tl.arange(0, AMAX_BLOCK)
                xa = tl.load(x_rows + k[None, :], mask=m_valid[:, None] & (k < K)[None, :],
                             other=0.0)
                amax = tl.maximum(amax, tl.max(tl.abs(xa.to(tl.float32)), 1))
    if W8A8 == "fp8":
        x_scale = tl.zeros([BLOCK_M], tl.float32) + fp8_row_scale(amax, input_scale_ptr,
                                                                   STATIC_INPUT)
        x_inverse = fp8_inverse_scale(x_scale)
    elif W8A8 == "int8":
        x_scale = tl.load(input_scale_ptr + m, mask=m_valid, other=1.0)
    else:
        x_scale = tl.full([BLOCK_M], 1.0, tl.float32)  # unused
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if INT_ROWS:  # the first tile, loaded ahead of the loop
        x_next = _int_row_inputs(x_rows, perm_ptr, m_valid, k_start, HAS_PERM, BLOCK_K)
        q_next, scale_next, zero_next = int_row_tile(w_rows, weight_scale_ptr, zeros_ptr, n_rows,
                                                     stride_sn, k_start, INT_BITS, GROUP, BLOCK_K)
        q_up_next, scale_up_next, zero_up_next = q_next, scale_next, zero_next
        if SILU_GATED:
            q_up_next, scale_up_next, zero_up_next = int_row_tile(
                up_rows, weight_scale_ptr + N * stride_sn, zeros_ptr + N * stride_sn, n_rows,
                stride_sn, k_start, INT_BITS, GROUP, BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        if INT_ROWS:
            # This tile came one iteration ahead; the next one's loads now.
            x, q, scale, zero = x_next, q_next, scale_next, zero_next
            q_up, scale_up, zero_up = q_up_next, scale_up_next, zero_up_next
            ahead = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K)  # the last tile: again
            x_next = _int_row_inputs(x_rows, perm_ptr, m_valid, ahead, HAS_PERM, BLOCK_K)
            q_next, scale_next, zero_next = int_row_tile(
                w_rows, weight_scale_ptr, zeros_ptr, n_rows, stride_sn, ahead, INT_BITS,
                GROUP, BLOCK_K)
            if SILU_GATED:
                q_up_next, scale_up_next, zero_up_next = int_row_tile(
                    up_rows, weight_scale_ptr + N * stride_sn, zeros_ptr + N * stride_sn,
                    n_rows, stride_sn, ahead, INT_BITS, GROUP, BLOCK_K)
            acc += int_row_products(q, scale, zero, x, one_bits, INT_BITS, BLOCK_K)
            if SILU_GATED:
                acc_up += int_row_products(q_up, scale_up, zero_up, x, one_bits, INT_BITS, BLOCK_K)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            if HAS_PERM:
                columns = tl.load(perm_ptr + k)
            else:
                columns = k
            if INT_BITS > 0:  # tensor cores: weights rounded to x's dtype
                w = int_weight_tile(w_rows, weight_scale_ptr, zeros_ptr, n_rows, stride_sn, k0,
                                     INT_BITS, GROUP, BLOCK_N, BLOCK_K, True,
                                     x_ptr.dtype.element_ty)
                if SILU_GATED:
                    w_up = int_weight_tile(up_rows, weight_scale_ptr + N * stride_sn,
                                            zeros_ptr + N * stride_sn, n_rows, stride_sn, k0,
                                            INT_BITS, GROUP, BLOCK_N, BLOCK_K, True,
                                            x_ptr.dtype.element_ty)
                x_mask = m_valid[:, None]
            elif EVEN_K:
                w = tl.load(w_rows + k[None, :])
                if SILU_GATED:
                    w_up = tl.load(up_rows + k[None, :])
                x_mask = m_valid[:, None]
            else:
                k_valid = k < K
                w = tl.load(w_rows + k[None, :], mask=k_valid[None, :], other=0.0)
                if SILU_GATED:
                    w_up = tl.load(up_rows + k[None, :], mask=k_valid[None, :], other=0.0)
                x_mask = m_valid[:, None] & k_valid[None, :]
            if ROW_TILE_X:  # each lane loads its own inputs: no exchange through shared memory
                x = tl.load(x_rows + (k[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)))
            else:
                x = tl.load(x_rows + columns[None, :], mask=x_mask, other=0.0)
            if W8A8 == "fp8":
                x = tl.clamp(x.to(tl.float32) * x_inverse[:, None], -448.0, 448.0).to(tl.float8e4nv)
            if USE_DOT and W8A8 == "int8":  # exact int32 sums a tile
                acc += tl.dot(x, tl.trans(w), out_dtype=tl.int32).to(tl.float32)
                if SILU_GATED:
                    acc_up += tl.dot(x, tl.trans(w_up), out_dtype=tl.int32).to(tl.float32)
            elif USE_DOT:
                acc += tl.dot(x, tl.trans(w))
                if SILU_GATED:
                    acc_up += tl.dot(x, tl.trans(w_up))
            else:
                acc += w.to(tl.float32) * x.to(tl.float32)
                if SILU_GATED:
                    acc_up += w_up.to(tl.float32) * x.to(tl.float32)
    release_next_kernel(PDL)
    if USE_DOT:
        out = acc
        up = acc_up
    elif INT_ROWS:
        out = acc[None, :]
        up = acc_up[None, :]
    else:
        out = tl.sum(acc, 1)[None, :]
        up = tl.sum(acc_up, 1)[None, :]
    if SPLIT == 1:
        _small_batch_finish(
            out, up, m, n, m_valid, n_valid, M, N, out_ptr, stride_om, bias_ptr,
            weight_scale_ptr, x_scale, norm_weight_ptr, residual_ptr,
            normed_ptr, residual_out_ptr, counter_ptr, stride_rm, eps,
            HAS_BIAS, SILU_GATED, NORM_BLOCK, W8A8)
    else:
        # Every program's partial sums, then the column block's last program finishes.
        width = 2 * N if SILU_GATED else N
        slot = partial_ptr + m.to(tl.int64)[:, None] * width + n[None, :]
        valid = m_valid[:, None] & n_valid[None, :]
        tl.store(slot + split * M * width, out, mask=valid)
        if SILU_GATED:
            tl.store(slot + split * M * width + N, up, mask=valid)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + 1 + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.store(counter_ptr + 1 + pid, 0)
            out = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, SPLIT):
                out += tl.load(slot + s * M * width, mask=valid, other=0.0, cache_modifier=".cg")
                if SILU_GATED:
                    up += tl.load(slot + s * M * width + N, mask=valid, other=0.0,
                                  cache_modifier=".cg")
            _small_batch_finish(
                out, up, m, n, m_valid, n_valid, M, N, out_ptr, stride_om, bias_ptr,
                weight_scale_ptr, x_scale, norm_weight_ptr, residual_ptr,
                normed_ptr, residual_out_ptr, counter_ptr, stride_rm, eps,
                HAS_BIAS, SILU_GATED, NORM_BLOCK, W8A8)


@triton.jit
def _small_batch_finish(
    out, up, m, n, m_valid, n_valid, M, N, out_ptr, stride_om, bias_ptr, weight_scale_ptr,
    x_scale, norm_weight_ptr, residual_ptr, normed_ptr, residual_out_ptr, counter_ptr,
    stride_rm, eps,
    HAS_BIAS: tl.constexpr,
    SILU_GATED: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    W8A8: tl.constexpr,
):
    """A column block's float32 sums -> its outputs: the W8A8 scales, the bias, the SiLU
    gate, the store, and (``NORM_BLOCK``) the norm by the last column block to arrive."""
    if W8A8 != "":
        w_scale = tl.load(weight_scale_ptr + tl.minimum(n, N - 1))
        out = out * x_scale[:, None] * w_scale[None, :]
        if SILU_GATED:
            up = up * x_scale[:, None] * tl.load(weight_scale_ptr + N + tl.minimum(n, N - 1))[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        if SILU_GATED:
            up += tl.load(bias_ptr + N + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    if SILU_GATED:
        dtype = out_ptr.dtype.element_ty
        gate = out.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        out = act.to(tl.float32) * up.to(dtype).to(tl.float32)
    tl.store(
        out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_valid[:, None] & n_valid[None, :],
    )
    if NORM_BLOCK > 0:
        # Every thread's stores are issued before one thread releases them with the count.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            tl.store(counter_ptr, 0)
            for row in range(0, M):  # M <= 16 rows: the offsets fit in int32
                _rms_norm_row(
                    out_ptr + row * stride_om, residual_ptr + row * stride_rm,
                    norm_weight_ptr, normed_ptr + row * N, residual_out_ptr + row * N, eps,
                    N, NORM_BLOCK, True, ".cg", True,
                )


@triton.jit
def split_sums_kernel(part_ptr, bias_ptr, out_ptr, N, stride_split, stride_pm, stride_om,
                      SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                      PDL: tl.constexpr):
    """Row ``program_id(0)``, columns ``program_id(1) * BLOCK`` on, of a split-K product
    from its ``SPLIT`` float32 slices (``part[s, row]``): added in slice order, plus the
    bias, rounded once to ``out``'s dtype."""
    follow_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    part = part_ptr + row * stride_pm + cols
    sums = tl.load(part, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        sums += tl.load(part + s * stride_split, mask=mask, other=0.0)
    if HAS_BIAS:
        sums += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, sums.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm_output_tile(pid_m, pid_n, M, N, a_ptr, stride_am, b_ptr, stride_bn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Output tile ``(pid_m, pid_n)`` of ``a [M, K] @ b[N, K].T``: its rows ``m`` and columns
    ``n``, their masks, and the row pointers of ``a`` (``[BLOCK_M, 1]``) and of ``b``
    (``[1, BLOCK_N]``) to add a K offset to."""
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + n.to(tl.int64)[None, :] * stride_bn
    return m, n, m < M, n < N, a_rows, b_cols


@triton.jit
def store_scaled_tile(sums, m, n, m_valid, n_valid, a_scale_ptr, b_scale_ptr, bias_ptr,
                      out_ptr, stride_om, HAS_BIAS: tl.constexpr):
    """A W8A8 output tile: its float32 ``sums`` times the rows' scales ``a_scale[m]`` and the
    columns' ``b_scale[n]``, plus ``bias[n]``, rounded to ``out``'s dtype and stored."""
    a_s = tl.load(a_scale_ptr + m, mask=m_valid, other=0.0)
    b_s = tl.load(b_scale_ptr + n, mask=n_valid, other=0.0)
    out = sums * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def fp8_row_scale(amax, input_scale_ptr, STATIC_INPUT: tl.constexpr):
    """A row's float32 FP8 scale: its largest magnitude ``amax`` / 448 (IEEE division; at
    least 1e-12), or with ``STATIC_INPUT`` the one float32 at ``input_scale_ptr`` (``amax``
    unused)."""
    if STATIC_INPUT:
        scale = tl.load(input_scale_ptr)
    else:
        scale = tl.maximum(tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0), 1e-12)
    return scale


@triton.jit
def fp8_inverse_scale(scale):
    """``1 / scale`` in float32 with IEEE rounding: what FP8 quantization multiplies by."""
    return tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def to_fp8(x, scale):
    """float32 ``x`` times ``scale``'s IEEE reciprocal (``fp8_inverse_scale``), clamped to
    +-448, rounded to float8_e4m3fn: ``quantization.fp8.quantize_rows``' values. One
    division a scale, not one an element."""
    return tl.clamp(x * fp8_inverse_scale(scale), -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def int8_row_scale(amax, input_scale_ptr, STATIC_INPUT: tl.constexpr):
    """A row's float32 INT8 scale: its largest magnitude ``amax`` over 127.5 (IEEE
    division; 1 for a row of zeros), or with ``STATIC_INPUT`` the one float32 at
    ``input_scale_ptr``."""
    if STATIC_INPUT:
        scale = tl.load(input_scale_ptr)
    else:
        scale = tl.math.div_rn(amax, tl.zeros_like(amax) + 127.5)
        scale = tl.where(scale > 0, scale, 1.0)
    return scale


@triton.jit
def to_int8(x, scale):
    """float32 ``x`` divided by ``scale`` with IEEE rounding, halves rounded to even
    (adding and removing 1.5 * 2**23, exact below 2**22), clamped to [-128, 127]:
    ``quantization.int8.quantize_rows_int8``'s values."""
    q = tl.clamp(tl.math.div_rn(x, tl.zeros_like(x) + scale), -129.0, 128.0)
    q = (q + 12582912.0) - 12582912.0
    return tl.clamp(q, -128.0, 127.0).to(tl.int8)


@triton.jit
def quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, input_scale_ptr, K, stride_xm,
                         BLOCK_K: tl.constexpr, STATIC_INPUT: tl.constexpr,
                         W8A8: tl.constexpr, PDL: tl.constexpr):
    """Row ``row`` of ``x`` -> ``out[row]`` (contiguous rows of ``K``) and its float32 scale
    ``scale[row]``: ``W8A8`` "fp8", float8_e4m3fn as ``quantization.fp8.quantize_rows``
    computes it (``fp8_row_scale``, ``to_fp8``), or "int8", int8 as
    ``quantization.int8.quantize_rows_int8`` does (``int8_row_scale``, ``to_int8``)."""
    follow_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros([BLOCK_K], tl.float32)
    if not STATIC_INPUT:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
    if W8A8 == "int8":
        scale = int8_row_scale(tl.max(amax, 0), input_scale_ptr, STATIC_INPUT)
    else:
        scale = fp8_row_scale(tl.max(amax, 0), input_scale_ptr, STATIC_INPUT)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        if W8A8 == "int8":
            quantized = to_int8(x, scale)
        else:
            quantized = to_fp8(x, scale)
        tl.store(out_ptr + row * K + k, quantized, mask=k < K)
    tl.store(scale_ptr + row, scale)


@triton.jit
def llm_int8_rows_kernel(x_ptr, out_ptr, scale_ptr, M, K, stride_xm, threshold, sums_scale,
                         weight_scale, BLOCK_K: tl.constexpr, OUTLIERS: tl.constexpr,
                         PDL: tl.constexpr):
    """bitsandbytes' LLM.int8 quantization of row ``row`` of ``x``, as
    ``quantization.llm_int8.stacked_rows`` computes it: ``out[row]`` its int8 codes
    ``round(h * (127 / r))`` (``h`` the float16 values; 0 at the outliers, ``|h| >=
    threshold``), ``scale[row]`` ``r * sums_scale``, ``r`` the largest magnitude of the
    others. With ``OUTLIERS``, the outliers (float32 values, 0 elsewhere) as two int8 rows
    (``llm_int8._int8_rows``, then again on what the first leaves): ``out[M + row]``,
    ``out[2 M + row]``, their scales times ``weight_scale`` at ``scale[M + row]``,
    ``scale[2 M + row]``. Three passes over the row (the largest magnitudes, the codes, the
    rest's codes). Launched without floating-point contraction: each product is rounded
    before it is rounded to an integer, as in torch."""
    follow_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros([BLOCK_K], tl.float32)
    amax_outliers = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0)
        h = tl.abs(x.to(tl.float16).to(tl.float32))
        if OUTLIERS:
            outlier = h >= threshold
            amax = tl.maximum(amax, tl.where(outlier, 0.0, h))
            amax_outliers = tl.maximum(amax_outliers, tl.where(outlier, tl.abs(x.to(tl.float32)),
                                                               0.0))
        else:
            amax = tl.maximum(amax, h)
    row_max = tl.max(amax, 0)
    inverse = tl.math.div_rn(tl.zeros_like(row_max) + 127.0, tl.where(row_max > 0, row_max, 1.0))
    inverse = tl.where(row_max > 0, inverse, 0.0)
    high_scale = tl.math.div_rn(tl.max(amax_outliers, 0), tl.zeros_like(row_max) + 127.0)
    high_safe = tl.where(high_scale > 0, high_scale, 1.0)
    amax_rest = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0)
        h = x.to(tl.float16).to(tl.float32)
        if OUTLIERS:
            outlier = tl.abs(h) >= threshold
            h = tl.where(outlier, 0.0, h)
        q = (h * inverse + 12582912.0) - 12582912.0  # halves to even (|q| <= 127)
        tl.store(out_ptr + row * K + k, q.to(tl.int8), mask=k < K)
        if OUTLIERS:
            values = tl.where(outlier, x.to(tl.float32), 0.0)
            high = _round_clamped(tl.math.div_rn(values, tl.zeros_like(values) + high_safe))
            tl.store(out_ptr + (M + row) * K + k, high.to(tl.int8), mask=k < K)
            amax_rest = tl.maximum(amax_rest, tl.abs(values - high * high_scale))
    tl.store(scale_ptr + row, row_max * sums_scale)
    if OUTLIERS:
        low_scale = tl.math.div_rn(tl.max(amax_rest, 0), tl.zeros_like(row_max) + 127.0)
        low_safe = tl.where(low_scale > 0, low_scale, 1.0)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + k, mask=k < K, other=0.0)
            h = tl.abs(x.to(tl.float16).to(tl.float32))
            values = tl.where(h >= threshold, x.to(tl.float32), 0.0)
            high = _round_clamped(tl.math.div_rn(values, tl.zeros_like(values) + high_safe))
            rest = values - high * high_scale
            low = _round_clamped(tl.math.div_rn(rest, tl.zeros_like(rest) + low_safe))
            tl.store(out_ptr + (2 * M + row) * K + k, low.to(tl.int8), mask=k < K)
        tl.store(scale_ptr + M + row, high_scale * weight_scale)
        tl.store(scale_ptr + 2 * M + row, low_scale * weight_scale)


@triton.jit
def _round_clamped(v):
    """float32 ``v`` rounded to the nearest integer (halves to even), clamped to +-127."""
    v = tl.clamp(v, -128.0, 128.0)
    return tl.clamp((v + 12582912.0) - 12582912.0, -127.0, 127.0)
