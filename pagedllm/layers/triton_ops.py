"""Fused elementwise ops for CUDA, as Triton kernels: RMSNorm (+ residual add), SiLU-and-mul,
rotary embedding, a token per row of logits (``gumbel_sample``, ``greedy_argmax``), and the
matrix-vector products of small decode batches (``small_batch_matmul``).

In torch each of these is a chain of small kernels (RMSNorm alone: add, cast, square,
mean, rsqrt, two multiplies, cast), each reading and writing the whole activation; here
each is one pass over memory. They matter twice: a prefill of 8k tokens moves hundreds of
megabytes through them per layer, and a decode step (inside a CUDA graph) is otherwise
hundreds of tiny launches.

Numerics follow the torch layers they replace: arithmetic in float32, with a rounding to
the activation dtype wherever torch rounds (the residual sum, the normalised value before
the weight, SiLU before the multiply), so results agree with the torch path to the last
bit in most elements and to one rounding step in the rest. Rotary rounds once at the end
(torch rounds each product), which is at least as accurate.

The layers call these only for CUDA tensors (``use_fused_ops``); the CPU keeps the torch
code, which is the exactness reference. ``PAGEDLLM_FUSED_OPS=0`` turns them off;
``PAGEDLLM_GEMV_MAX_ROWS=0`` turns off the small-batch matmul alone.
Under ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors (tests).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedllm.layers.pdl import launch_options
from pagedllm.switches import integer, switch

FUSED_OPS_ENV = "PAGEDLLM_FUSED_OPS"


@functools.cache
def fused_ops_enabled() -> bool:
    """``PAGEDLLM_FUSED_OPS`` is on (``1``, the default; ``0`` off) and triton is installed
    (the device aside)."""
    return switch(FUSED_OPS_ENV, True) and importlib.util.find_spec("triton") is not None


def use_fused_ops(x: torch.Tensor) -> bool:
    """True when ``x`` lives on a CUDA device and the fused kernels are enabled."""
    return x.is_cuda and fused_ops_enabled()


@functools.cache
def _kernels():
    """Import the kernels on first use, so CPU-only installs never import triton."""
    from pagedllm.layers import _triton_ops_kernels

    return _triton_ops_kernels


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """``count`` int32 counters on ``device``, all zero, for kernels whose last program to
    finish does the launch's final step (it counts its arrival and resets the counter).

    Invariant: every counter is zero between launches. All launches share the buffer,
    which is safe because launches on a stream run one after another. The buffer only
    grows, and a grown one is kept beside the old, which CUDA graphs may have captured.
    """
    device = torch.device(device)
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        size = max(4096, 1 << (count - 1).bit_length())
        buffers.append(torch.zeros(size, dtype=torch.int32, device=device))
    return buffers[-1]


def quantize_rows_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``pagedllm.quantization.fp8.quantize_rows`` in one pass per row: ``x [M, K]`` ->
    (float8_e4m3fn ``[M, K]``, float32 scales ``[M, 1]``), the same values (IEEE division)."""
    return _quantize_rows(x, input_scale, "fp8")


def quantize_rows_int8(x: torch.Tensor, input_scale: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``pagedllm.quantization.int8.quantize_rows_int8`` in one pass per row: ``x [M, K]``
    -> (int8 ``[M, K]``, float32 scales ``[M, 1]``), the same values."""
    return _quantize_rows(x, input_scale, "int8")


def quantize_rows_llm_int8(x: torch.Tensor, threshold: float, sums_scale: float,
                           weight_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantization.llm_int8``'s rows for its tensor-core product in one kernel: ``x [M,
    K]`` -> (int8 ``[R * M, K]``, float32 ``[R * M]``): the codes with their rows' largest
    magnitudes times ``sums_scale``, and with ``threshold > 0`` (R = 3, else 1) the
    outliers' two int8 rows with their scales times ``weight_scale``; the values of
    ``llm_int8.stacked_rows``."""
    rows, cols = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    stacked = 3 if threshold > 0 else 1
    out = torch.empty((stacked * rows, cols), dtype=torch.int8, device=x.device)
    scale = torch.empty(stacked * rows, dtype=torch.float32, device=x.device)
    if rows:
        k = _kernels()
        block = min(4096, k.next_power_of_2(cols))
        k.llm_int8_rows_kernel[(rows,)](
            x, out, scale, rows, cols, x.stride(0), threshold, sums_scale, weight_scale,
            BLOCK_K=block, OUTLIERS=threshold > 0, num_warps=_norm_warps(block),
            enable_fp_fusion=False, **launch_options(x.device),
        )
    return out, scale


def _quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None, w8a8: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    dtype = torch.int8 if w8a8 == "int8" else torch.float8_e4m3fn
    out = torch.empty((rows, cols), dtype=dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        k = _kernels()
        # A whole row per load (up to 16k columns): the second pass re-reads it from cache.
        block = min(16384, k.next_power_of_2(cols))
        k.quantize_rows_kernel[(rows,)](
            x, out, scale, input_scale if input_scale is not None else scale, cols,
            x.stride(0), BLOCK_K=block, STATIC_INPUT=input_scale is not None, W8A8=w8a8,
            num_warps=_norm_warps(block), **launch_options(x.device),
        )
    return out, scale


def _norm_warps(block: int, fp8_out: bool = False) -> int:
    """Warps of a one-program-a-row kernel over ``block`` columns. A row that also finds
    its largest magnitude and quantizes (FP8 output) takes 16 from 4,096 columns on (an
    H200 sweep, docs/benchmarks.md)."""
    if fp8_out and block >= 4096:
        return 16
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    fp8: bool = False,
    input_scale: torch.Tensor | None = None,
    sums_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """``RMSNorm`` over the last dimension in one kernel; see ``layers/layernorm.py``.

    ``x``: ``[T, N]``, or ``[T, H, N]`` without a residual (``head_rms_norm``); any strides
    with a unit last stride, e.g. the q slice of a fused qkv output. ``weight``: ``[N]`` in
    ``x``'s dtype. With ``residual`` (``[T, N]``) returns ``(norm(x + residual), x +
    residual)``, else ``norm(x)``; outputs are new contiguous tensors.

    With ``fp8`` (``[T, N]`` inputs) the normalised rows come quantized for an FP8
    product, as ``quantize_rows_fp8`` would quantize them (per row, or with the static
    ``input_scale``): a pair (float8_e4m3fn ``[T, N]``, float32 scales ``[T, 1]``) in
    place of ``norm(...)``.

    ``sums_scales=(row_scale, col_scale)`` (``[T, N]`` inputs): ``x`` holds an FP8
    product's sums before its scales (``Fp8Sums``), scaled here first.
    """
    if x.dim() == 3 and not fp8 and residual is None and sums_scales is None:
        return head_rms_norm(x, weight, eps)
    if x.dim() != 2:
        raise ValueError(f"rms_norm takes [T, N]{'' if fp8 else ' or [T, H, N]'} inputs "
                         f"(these without a residual), got shape {tuple(x.shape)}.")
    k = _kernels()
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8 else x.dtype, device=x.device)
    rows = x.shape[0]
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if fp8 else out
    normed = (out, scale) if fp8 else out
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"residual shape {tuple(residual.shape)} must equal x's {tuple(x.shape)} ([T, N])."
            )
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        residual_out = out  # unused
    if rows == 0:
        return (normed, residual_out) if residual is not None else normed
    block = k.next_power_of_2(n)
    row_scale, col_scale = _sums_scale_args(sums_scales, rows, n, scale)
    k.rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, residual_out,
        scale, input_scale if input_scale is not None else scale, row_scale, col_scale,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        eps,
        N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, FP8_OUT=fp8,
        STATIC_INPUT=input_scale is not None, SCALED=sums_scales is not None,
        num_warps=_norm_warps(block, fp8), **launch_options(x.device),
    )
    return (normed, residual_out) if residual is not None else normed


def _sums_scale_args(sums_scales: tuple[torch.Tensor, torch.Tensor] | None, rows: int,
                     columns: int, unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' ``row_scale`` and ``col_scale`` arguments for ``sums_scales`` (float32,
    one per row and one per column, any shapes of those sizes), or ``unused`` twice."""
    if sums_scales is None:
        return unused, unused
    row_scale, col_scale = (t.reshape(-1) for t in sums_scales)
    if (row_scale.numel(), col_scale.numel()) != (rows, columns) or not (
            row_scale.dtype == col_scale.dtype == torch.float32):
        raise ValueError(f"sums_scales: {rows} row and {columns} column float32 scales, got "
                         f"{row_scale.numel()} and {col_scale.numel()} "
                         f"({row_scale.dtype}, {col_scale.dtype}).")
    return row_scale.contiguous(), col_scale.contiguous()


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  later_weight: torch.Tensor | None = None, later_from: int | None = None):
    """``RMSNorm`` of each head of ``x`` (``[T, H, N]``, a unit last stride, any token and
    head strides, e.g. heads of a fused qkv output) with ``weight`` (``[N]``, ``x``'s
    dtype), rounded as ``RMSNorm`` rounds: a new contiguous ``[T, H, N]``. With
    ``later_weight`` and ``later_from``, the heads from ``later_from`` on take
    ``later_weight`` (q's and k's norms in one launch) and the result is the pair of new
    contiguous ``[T, later_from, N]`` and ``[T, H - later_from, N]``."""
    if x.dim() != 3:
        raise ValueError(f"head_rms_norm takes [T, H, N] inputs, got shape {tuple(x.shape)}.")
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, heads, n = x.shape
    split = later_weight is not None
    if split != (later_from is not None) or (split and not 0 <= later_from <= heads):
        raise ValueError(f"head_rms_norm: give later_weight with later_from in 0..{heads} "
                         f"(got later_from={later_from!r}).")
    first_heads = later_from if split else heads
    out = torch.empty((num_tokens, first_heads, n), dtype=x.dtype, device=x.device)
    later_out = (torch.empty((num_tokens, heads - first_heads, n), dtype=x.dtype, device=x.device)
                 if split else out)  # not written without later heads
    if num_tokens and heads:
        # One token's heads a program: one head a program (one launch for q, another for
        # k) left most of its warps idle (docs/benchmarks.md, "Qwen3's q and k norms").
        k = _kernels()
        block, block_h = k.next_power_of_2(n), k.next_power_of_2(heads)
        k.head_rms_norm_kernel[(num_tokens,)](
            x, weight, later_weight if split else weight, out, later_out,
            heads, first_heads, x.stride(0), x.stride(1), eps,
            N=n, BLOCK=block, BLOCK_H=block_h, num_warps=_norm_warps(block * block_h),
            **launch_options(x.device),
        )
    return (out, later_out) if split else out


class SiluFp8Launch(NamedTuple):
    """Launch of ``silu_and_mul_fp8_kernel``: ``block`` columns a pass, warps,
    ``programs_per_sm`` (0: one program a row; else at most that many programs a
    multiprocessor, each walking its share of the rows), and ``prefetch`` (1: where each
    program walks more than ``SILU_PREFETCH_MIN_ROWS`` rows, it loads its next row while
    it finishes the one before; rows of at most ``block``)."""

    block: int
    num_warps: int
    programs_per_sm: int
    prefetch: int = 0


SILU_FP8_LAUNCH_ENV = "PAGEDLLM_SILU_FP8_LAUNCH"
# Rows a program must walk for loading the next one ahead to pay (H100: 512 and 8,192 rows
# of 14,336 columns 6% and 14% faster, 64 and 256 rows 5-15% slower; docs/benchmarks.md).
SILU_PREFETCH_MIN_ROWS = 3


@functools.cache
def silu_fp8_launch(d: int) -> SiluFp8Launch:
    """SiLU-and-mul with FP8 output over rows of ``d``: a whole row in registers up to 16k
    columns (wider: two passes). Rows of more than 8k columns (an 8B model's MLP) take 32
    warps and one program a multiprocessor, which walks its rows (a row's registers leave
    room for no second program) and load each next row ahead (docs/benchmarks.md);
    narrower rows one program each. Or
    ``PAGEDLLM_SILU_FP8_LAUNCH="BLOCK,warps,programs_per_sm[,prefetch]"``."""
    value = os.environ.get(SILU_FP8_LAUNCH_ENV, "").strip()
    if value:
        try:
            launch = SiluFp8Launch(*(int(v) for v in value.split(",")))
        except (TypeError, ValueError):
            launch = None
        if launch is None or launch.block < 16 or launch.block & (launch.block - 1) or (
                launch.num_warps not in (1, 2, 4, 8, 16, 32)) or launch.programs_per_sm < 0 \
                or launch.prefetch not in (0, 1):
            raise ValueError(f"{SILU_FP8_LAUNCH_ENV}={value!r}: give BLOCK,warps,"
                             "programs_per_sm[,prefetch] (BLOCK a power of two >= 16, warps a "
                             "power of two up to 32, programs_per_sm >= 0: 0 = one program a "
                             "row; prefetch 0 or 1), e.g. 16384,32,1.")
        return launch
    if 8192 < d <= 16384:
        return SiluFp8Launch(16384, 32, 1, 1)
    block = min(16384, 1 << max(d - 1, 0).bit_length())
    return SiluFp8Launch(block, _norm_warps(block), 0)


def silu_and_mul(gate_up: torch.Tensor, *, fp8: bool = False,
                 input_scale: torch.Tensor | None = None,
                 sums_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 launch: SiluFp8Launch | None = None):
    """``silu(gate_up[..., :d]) * gate_up[..., d:]`` for a 2-D ``[T, 2d]`` input -> ``[T, d]``.

    With ``fp8``: that product quantized for an FP8 product, as ``quantize_rows_fp8``
    would quantize it (per row, or with the static ``input_scale``): a pair
    (float8_e4m3fn ``[T, d]``, float32 scales ``[T, 1]``). ``sums_scales=(row_scale,
    col_scale)``: ``gate_up`` holds an FP8 product's sums before its scales
    (``Fp8Sums``), scaled here first. ``launch``: the FP8 kernel's launch instead of
    ``silu_fp8_launch``'s (to measure others)."""
    k = _kernels()
    if gate_up.dim() != 2:
        raise ValueError(f"silu_and_mul takes [T, 2d], got shape {tuple(gate_up.shape)}.")
    if launch is not None and not fp8:
        raise ValueError("silu_and_mul: launch= sets the FP8 kernel's launch; pass fp8=True.")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    num_tokens, width = gate_up.shape
    d = width // 2
    out = torch.empty((num_tokens, d), dtype=torch.float8_e4m3fn if fp8 else gate_up.dtype,
                      device=gate_up.device)
    row_scale, col_scale = _sums_scale_args(sums_scales, num_tokens, width, out)
    if fp8:
        scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=gate_up.device)
        if num_tokens:
            launch = launch or silu_fp8_launch(d)
            if launch.prefetch and d > launch.block:
                raise ValueError(f"silu_and_mul: a launch that loads rows ahead takes rows of "
                                 f"at most its block ({launch.block}), got {d}.")
            programs = num_tokens
            if launch.programs_per_sm:
                programs = min(num_tokens, launch.programs_per_sm * _sm_count(gate_up.device))
            prefetch = launch.prefetch and num_tokens > SILU_PREFETCH_MIN_ROWS * programs
            k.silu_and_mul_fp8_kernel[(programs,)](
                gate_up, out, scale, input_scale if input_scale is not None else scale,
                row_scale, col_scale, gate_up.stride(0), d, num_tokens, BLOCK=launch.block,
                ONE_PASS=d <= launch.block, STATIC_INPUT=input_scale is not None,
                SCALED=sums_scales is not None, PREFETCH=prefetch,
                num_warps=launch.num_warps,
                **launch_options(gate_up.device),
            )
        return out, scale
    if num_tokens == 0:
        return out
    block = 1024
    k.silu_and_mul_kernel[(num_tokens, k.cdiv(d, block))](
        gate_up, out, row_scale, col_scale, gate_up.stride(0), out.stride(0), d, BLOCK=block,
        SCALED=sums_scales is not None, num_warps=4,
        **launch_options(gate_up.device),
    )
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope of ``x: [T, H, D]`` by ``cos, sin: [T, D // 2]`` -> new ``[T, H, D]``.

    Same convention as ``RotaryEmbedding.apply``:
    ``[x1 | x2] -> [x1 * cos - x2 * sin | x2 * cos + x1 * sin]``.
    """
    k = _kernels()
    num_tokens, heads, head_dim = x.shape
    half = head_dim // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((num_tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    k.rotary_kernel[(num_tokens,)](
        x, cos, sin, out,
        x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
        heads,
        HALF=half,
        BLOCK_H=k.next_power_of_2(heads),
        BLOCK_HALF=k.next_power_of_2(half),
        num_warps=4,
    )
    return out


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``logits [B, V]`` (any float dtype) -> int64 ``[B]``: the
    first index of the row's maximum, as torch returns it. Two short passes over the
    vocabulary split across the GPU (torch reduces a row in one block: 27 us for a batch of
    one at a 128k vocabulary). Rows with NaN logits are the exception: NaN never wins here."""
    return _row_argmax(logits, None, None)


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits [B, V]``, drawn from ``softmax(logits / temperature)``
    in one pass over the logits -> int64 ``[B]``.

    The exponential race of the torch sampler, ``argmax(p_i / q_i)`` with ``q_i ~ Exp(1)``,
    is ``argmax(logits_i / T - log q_i)``: the Gumbel-max trick, which needs no softmax.
    Row ``b``'s noise comes from ``seeds[b]`` (int64 in [0, 2^31)) and the token index
    only, so a row's draw does not depend on the batch. ``temperature [B]`` float32 > 0;
    logits may hold -inf (masked tokens are never drawn).
    """
    return _row_argmax(logits, temperature, seeds)


def masked_row_argmax(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                      temperature: torch.Tensor | None = None,
                      seeds: torch.Tensor | None = None) -> torch.Tensor:
    """``greedy_argmax`` (or with ``temperature`` and ``seeds``, ``gumbel_sample``) of
    ``logits[rows]`` with the tokens ``bitmask`` disallows at -inf, in one pass without
    building those rows -> int64 ``[R]``: ``rows`` int64 ``[R]``; ``bitmask`` int32
    ``[R, ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32`` of row ``r`` allowing token
    ``t`` of ``logits[rows[r]]``; ``temperature`` and ``seeds`` ``[B]`` as the full batch's
    (read at ``rows``). The same winner as masking the rows' logits first."""
    return _row_argmax(logits, temperature, seeds, rows, bitmask)


def refuse_masked_tokens_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
                           ) -> torch.Tensor:
    """Set to -inf, in place, the tokens of ``logits[rows]`` that ``bitmask`` disallows ->
    ``logits``: ``logits [B, V]`` (any float dtype, unit column stride), ``rows`` int64
    ``[R]`` (distinct), ``bitmask`` int32 ``[R, ceil(V / 32)]`` as in ``masked_row_argmax``.
    One launch that writes only the refused tokens and reads no logit."""
    num_rows, vocab_size = rows.shape[0], logits.shape[1]
    if logits.stride(-1) != 1:
        raise ValueError("refuse_masked_tokens_ needs logits with unit column stride.")
    if num_rows == 0:
        return logits
    if bitmask.stride(-1) != 1:
        bitmask = bitmask.contiguous()
    k = _kernels()
    k.refuse_masked_tokens_kernel[(num_rows, k.cdiv(vocab_size, MASK_BLOCK))](
        logits, logits.stride(0), rows, bitmask, bitmask.stride(0), vocab_size,
        BLOCK=MASK_BLOCK, num_warps=4, **launch_options(logits.device),
    )
    return logits


def race_top(logits: torch.Tensor, rows: torch.Tensor, count: int,
             temperature: torch.Tensor | None = None, seeds: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and columns (float32 and int64 ``[R, C]``) among which lie the ``count`` best
    tokens of ``logits[rows]`` by the score ``greedy_argmax`` ranks them by (the logit) or,
    with ``temperature`` and ``seeds`` (``[B]``, as the full batch's, read at ``rows``),
    ``gumbel_sample``'s: each block of ``ARGMAX_BLOCK`` columns' ``count`` best, scored as
    those kernels score them (the same values to the last bit), so the best allowed token
    among them, when there is one, is ``masked_row_argmax``'s winner under that mask."""
    k = _kernels()
    num_rows, vocab_size = rows.shape[0], logits.shape[1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    blocks = k.cdiv(vocab_size, ARGMAX_BLOCK)
    count = min(count, ARGMAX_BLOCK)
    best = torch.empty(num_rows, blocks * count, dtype=torch.float32, device=logits.device)
    column = torch.empty(num_rows, blocks * count, dtype=torch.int32, device=logits.device)
    if num_rows:
        gumbel = temperature is not None
        k.race_top_kernel[(num_rows, blocks)](
            logits, logits.stride(0), temperature if gumbel else best,
            seeds if gumbel else best, rows, best, column, vocab_size, GUMBEL=gumbel,
            BLOCK=ARGMAX_BLOCK, TOP=count, num_warps=8)
    return best, column.long()


ARGMAX_BLOCK = 2048
# Columns a program of ``refuse_masked_tokens_`` covers (128 int32 mask words).
MASK_BLOCK = 4096
# Each lane keeps its best through the loop, the lanes reduced once (``row_argmax_partial_kernel``'s
# ``LANES``; ``PAGEDLLM_ARGMAX_LANES=0``: each block reduced as it is read). On by default:
# the Gumbel draw of 512 rows of 128k bf16 logits takes 238 us against 287 on an H200.
ARGMAX_LANES = switch("PAGEDLLM_ARGMAX_LANES", True)
# Programs a multiprocessor gets at least, rows split into parts to reach it: four keep
# enough loads in flight for the greedy pass (512 rows: 112 us at four, 198 at two).
ARGMAX_PROGRAMS_PER_SM = 4
# Parts a row splits into at most; the reduce kernel's one tile for any batch, so a batch of
# any size reuses the kernels compiled for the first.
ARGMAX_MAX_PARTS = 64


def _row_argmax(logits: torch.Tensor, temperature: torch.Tensor | None,
                seeds: torch.Tensor | None, rows: torch.Tensor | None = None,
                bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """The winner of each row (of ``rows`` of ``logits`` under ``bitmask``, when given: see
    ``masked_row_argmax``), scored by the logit or (with ``temperature`` and ``seeds``) by
    the Gumbel race. Each row splits into parts of whole blocks so that the batch fills
    about two programs per SM; a second launch picks each row's best part."""
    k = _kernels()
    vocab_size = logits.shape[1]
    masked = rows is not None
    num_rows = rows.shape[0] if masked else logits.shape[0]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if masked and bitmask.stride(-1) != 1:
        bitmask = bitmask.contiguous()
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    blocks = k.cdiv(vocab_size, ARGMAX_BLOCK)
    target_programs = ARGMAX_PROGRAMS_PER_SM * _sm_count(logits.device)
    parts = max(1, min(blocks, ARGMAX_MAX_PARTS, k.cdiv(target_programs, num_rows)))
    chunk = k.cdiv(blocks, parts) * ARGMAX_BLOCK
    parts = k.cdiv(vocab_size, chunk)
    best = torch.empty(num_rows, parts, dtype=torch.float32, device=logits.device)
    index = torch.empty(num_rows, parts, dtype=torch.int32, device=logits.device)
    gumbel = temperature is not None
    k.row_argmax_partial_kernel[(num_rows, parts)](
        logits, logits.stride(0),
        temperature if gumbel else best, seeds if gumbel else best,
        best, index, vocab_size, chunk,
        rows if masked else index, bitmask if masked else index,
        bitmask.stride(0) if masked else 0,
        GUMBEL=gumbel, BLOCK=ARGMAX_BLOCK, LANES=ARGMAX_LANES, MASKED=masked, num_warps=8,
        **launch_options(logits.device),
    )
    k.row_argmax_reduce_kernel[(num_rows,)](
        best, index, out, parts, BLOCK_PARTS=ARGMAX_MAX_PARTS, **launch_options(logits.device),
    )
    return out


def sum_split_partials(partials: torch.Tensor, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """A split-K product's result from its float32 slices ``[SPLIT, M, N]``, in one launch:
    added in slice order (the result does not depend on timing), plus ``bias``, rounded once
    to ``dtype``."""
    split, rows, width = partials.shape
    if partials.stride(-1) != 1:
        partials = partials.contiguous()
    out = torch.empty((rows, width), dtype=dtype, device=partials.device)
    block = min(1024, _kernels().next_power_of_2(width))
    if rows:
        _kernels().split_sums_kernel[(rows, _kernels().cdiv(width, block))](
            partials, bias if bias is not None else out, out, width, partials.stride(0),
            partials.stride(1), out.stride(0), SPLIT=split, BLOCK=block,
            HAS_BIAS=bias is not None, **launch_options(partials.device))
    return out


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few parts, so tests cross part boundaries
    return torch.cuda.get_device_properties(device).multi_processor_count


GEMV_MAX_ROWS_ENV = "PAGEDLLM_GEMV_MAX_ROWS"
GEMV_TILE_ENV = "PAGEDLLM_GEMV_TILE"
DEFAULT_GEMV_MAX_ROWS = 8


@functools.cache
def gemv_max_rows() -> int:
    """Batches of at most this many rows multiply through ``small_batch_matmul`` on CUDA
    (``PAGEDLLM_GEMV_MAX_ROWS``, default ``DEFAULT_GEMV_MAX_ROWS``; 0 turns it off)."""
    return integer(GEMV_MAX_ROWS_ENV, DEFAULT_GEMV_MAX_ROWS, 0, 16)


# FP8 weights take the small-batch product for one row only: from two rows the FP8
# GEMMs (cuBLASLt, the split-K tiles) are faster (docs/benchmarks.md, "FP8 decode of 2-8
# sequences on the FP8 GEMMs").
FP8_GEMV_MAX_ROWS = 1


def use_small_batch_matmul(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight.T`` should run as ``small_batch_matmul``: a CUDA half-precision
    ``[M, K]`` input with ``1 <= M <= gemv_max_rows()`` and a row-major weight of its dtype,
    an FP8 weight on a GPU with FP8 tensor cores (``M <= FP8_GEMV_MAX_ROWS``), an INT8 W8A8
    weight (int8) or packed integer weights (int32)."""
    fp8 = weight.dtype == torch.float8_e4m3fn
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= (min(FP8_GEMV_MAX_ROWS, gemv_max_rows()) if fp8
                                else gemv_max_rows())
        and x.dtype in (torch.float16, torch.bfloat16)
        and (weight.dtype in (x.dtype, torch.int32, torch.int8)
             or (fp8 and fp8_dot_supported(x.device)))
        and weight.stride(-1) == 1
        and use_fused_ops(x)
    )


@functools.cache
def is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is a Hopper GPU (compute capability 9.x: ``wgmma`` and TMA)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def fp8_dot_supported(device: torch.device) -> bool:
    """FP8 tensor-core products (compute capability 8.9 and higher); the interpreter too."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class GemvTile(NamedTuple):
    """Launch shape of ``small_batch_matmul``: ``block_n`` output columns and ``block_k``
    inputs per step, tensor-core tiles of 16 rows (``use_dot``) or one row lane-wise, and
    ``split`` slices of ``K`` per column block (split-K, finished inside the launch)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool
    split: int = 1


@dataclass(frozen=True)
class IntWeights:
    """What an integer-weight product needs besides the packed ``qweight``: the stored
    layout's ``scales`` and ``zeros`` (``[N, groups]``), the bits, the group size (-1: one
    group per row) and an act-order ``perm`` of the input columns
    (``pagedllm.quantization.int_weights``)."""

    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    perm: torch.Tensor | None = None


GEMV_FP8_TILE_ENV = "PAGEDLLM_GEMV_FP8_TILE"
GEMV_INT_TILE_ENV = "PAGEDLLM_GEMV_INT_TILE"


@functools.cache
def small_batch_matmul_config(rows: int, n: int, k: int, fp8: bool = False, int_bits: int = 0,
                              group: int = 0, int8: bool = False) -> GemvTile | None:
    """The tile of ``small_batch_matmul`` for ``rows x k @ k x n``.

    From timings on an H200 of Llama-3.1-8B's one-row projections, back to back inside a CUDA
    graph with the weights out of L2 (``scripts/check_kernels_gpu.py --gemv-graph``), all
    tensor-core tiles: 32 x 512 for outputs up to 4,096 wide (o_proj 11.5 us against
    cuBLAS's 12.6, down 30.9 against 31.3), 64 x 512 up to 16k (qkv 15.1 against 15.3),
    and narrow 128-wide K tiles with many programs above (gate/up 58.1 against 64.9; the
    LM head). ``--gemv-sweep`` gave the same order at 4 and 8 rows. ``fp8``: FP8 weights,
    whose tiles ``_fp8_tile`` holds; ``int_bits``: packed integer weights in groups of
    ``group`` inputs (``_int_tile``; None when no tile fits the groups); ``int8``: INT8
    W8A8 weights (``_int8_tile``).

    ``PAGEDLLM_GEMV_TILE="BLOCK_N,BLOCK_K,num_warps,num_stages,dot|fma[,SPLIT]"`` overrides
    it for every weight, ``PAGEDLLM_GEMV_FP8_TILE`` for FP8 weights only and
    ``PAGEDLLM_GEMV_INT_TILE`` for integer ones (``fma`` only for one row), to measure
    candidates on whole workloads.
    """
    envs = (GEMV_TILE_ENV,)
    if fp8:
        envs = (GEMV_FP8_TILE_ENV, GEMV_TILE_ENV)
    elif int_bits:
        envs = (GEMV_INT_TILE_ENV, GEMV_TILE_ENV)
    for env in envs:
        value = os.environ.get(env, "").strip()
        if value:
            tile = _parse_tile(env, value, rows)
            if int_bits and not _int_tile_fits(tile, k, group):
                return None
            return tile
    if fp8:
        return _fp8_tile(rows, n, k)
    if int8:
        return _int8_tile(n, k)
    if int_bits:
        return _int_tile(rows, n, k, group)
    if n <= 4096:
        return GemvTile(32, 512, 4, 3, True)
    if n < 16384:
        return GemvTile(64, 512, 4, 3, True)
    return GemvTile(64, 128, 4, 3, True)


def _fp8_tile(rows: int, n: int, k: int) -> GemvTile:
    """FP8 weights: one row multiplies lane-wise in narrow 16-wide tiles, K split in two
    for the narrow outputs, except the wide gate/up (tensor cores, 128 x 256); several
    rows take tensor-core tiles, narrow outputs 128 x 256 with K split in four. Chosen by
    ``scripts/gemv_quant_sweep.py`` on an H200 (docs/benchmarks.md, "FP8 on tensor cores"
    and "Quantized decode of a few sequences")."""
    steps = -(-k // 512)
    if n >= 16384:
        return GemvTile(128, 256, 4 if rows == 1 else 8, 3, True)
    if rows == 1:
        if n > 4096 and k <= 8192:
            return GemvTile(16, 512, 4, 1, False)
        return GemvTile(16, 512, 4, 3, False, 2 if steps % 2 == 0 else 1)
    if n > 4096:
        return GemvTile(64, 512, 8, 3, True)
    return GemvTile(128, 256, 8, 3, True, 4 if -(-k // 256) % 4 == 0 else 1)


def _int8_tile(n: int, k: int) -> GemvTile:
    """INT8 W8A8 weights, their rows quantized before the launch: tensor-core tiles (int8
    products, 0.7-1 instruction a weight) at one row too; K split for the narrow outputs.
    From ``scripts/gemv_quant_sweep.py --kinds int8`` on an H200 (Llama-3.1-8B's projections,
    one and four rows, docs/benchmarks.md): gate/up 31.4 us (bf16 60.2), down 22.7 (30.5),
    qkv 11.2 (14.7), o_proj 8.9 (10.7)."""
    steps = -(-k // 256)
    if n >= 16384:
        return GemvTile(128, 256, 4, 3, True)
    if k > 8192:
        split = 4
    elif n > 4096:
        split = 2
    else:
        return GemvTile(64, 256, 4, 3, True, 4 if steps % 4 == 0 and steps >= 8 else 1)
    return GemvTile(32, 256, 4, 3, True, split if steps % split == 0 and steps >= 2 * split else 1)


def _int_tile(rows: int, n: int, k: int, group: int) -> GemvTile | None:
    """Integer weights (``scripts/gemv_quant_sweep.py`` on an H200, Llama-3.1-8B's
    projections in groups of 128, inside CUDA graphs, weights out of L2).

    One row, lane-wise (``int_row_products``, each tile loaded an iteration ahead), ``K``
    in eight slices: 128 x 128 tiles (qkv 9.3 us with 8 warps against bf16's 14.8, o_proj
    8.3 against 10.8, gate/up 31.0 with 4 warps against 64.1); a long ``K`` (down, 14,336)
    in 64 x 128 tiles and slices of 1,024 inputs (19.8 against 30.7). Alone, 4 warps a
    128 x 128 tile everywhere and gate/up in four slices time 8% less; in the decode step
    (L1) they are 1.2% slower, so the step's figures chose (docs/benchmarks.md). Several
    rows on tensor cores in 64 x 128 tiles (qkv 18.2 against 15.7 at 4 rows), narrow
    outputs in eight slices, wide ones (gate/up) in four. The steps are the largest power
    of two up to the tile's which divides the group and ``K``; each slice is at least two
    steps long."""
    if rows == 1:
        long_k = k > 8192
        block_n, block_k = (64, 128) if long_k else (128, 128)
        warps = 8 if block_n == 128 and n <= 8192 else 4
        wanted = k // 1024 if long_k else 8
    else:
        block_n, block_k, warps = 64, 128, 4
        blocks = -(-n // block_n)
        wanted = 8 if blocks < 200 else 4 if blocks < 1000 else 1
    block_k = next((b for b in (128, 64, 32, 16)
                    if b <= block_k and k % b == 0 and group % b == 0), None)
    if block_k is None:
        return None
    steps = k // block_k
    split = max(s for s in range(1, wanted + 1) if steps % s == 0 and (s == 1 or steps >= 2 * s))
    return GemvTile(block_n, block_k, warps, 3, rows > 1, split)


def int_small_batch_tile(rows: int, n: int, k: int, ints: IntWeights) -> GemvTile | None:
    """The small-batch tile of ``rows x k @ k x n`` over the integer weights ``ints``, or
    None when no tile fits their groups (the caller takes ``int_matmul``'s path)."""
    group = k if ints.group_size == -1 else ints.group_size
    return small_batch_matmul_config(rows, n, k, int_bits=ints.bits, group=group)


def _int_tile_fits(tile: GemvTile, k: int, group: int) -> bool:
    """Whether ``tile`` tiles integer weights of ``K`` inputs in groups of ``group``: its
    steps lie in one group and its slices hold whole steps."""
    return (k % tile.block_k == 0 and group % tile.block_k == 0
            and (k // tile.block_k) % tile.split == 0)


def _parse_tile(env: str, value: str, rows: int) -> GemvTile:
    try:
        fields = value.split(",")
        mode = fields[4]
        block_n, block_k, num_warps, num_stages, *split = (int(v) for v in fields[:4] + fields[5:])
        if len(split) > 1:
            raise ValueError
    except (ValueError, IndexError):
        raise ValueError(f"{env}={value!r}: give BLOCK_N,BLOCK_K,num_warps,"
                         "num_stages,dot|fma[,SPLIT] (e.g. 32,256,4,4,dot).") from None
    if mode not in ("dot", "fma") or min(block_n, block_k) < 16 or (split and split[0] < 1):
        raise ValueError(f"{env}={value!r}: the mode is dot or fma, the "
                         "blocks are powers of two >= 16 and SPLIT is at least 1.")
    return GemvTile(block_n, block_k, num_warps, num_stages, mode == "dot" or rows > 1,
                    split[0] if split else 1)


def small_batch_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_gated: bool = False,
    norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
    weight_scale: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    int_weights: IntWeights | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x @ weight.T + bias`` for ``x: [M, K]`` with ``M <= 16``, ``weight: [N, K]`` -> ``[M, N]``.

    A decode step of a few sequences is a matrix-vector product per layer: its time is the
    time to read the weight once, and BLAS libraries split ``K`` into a second reduction
    pass for the narrow shapes. Here one program owns ``BLOCK_N`` output columns over the
    whole of ``K`` or, for narrow outputs, over one of ``split`` slices of it, the slices'
    sums added in a fixed order by the column block's last program in the same launch;
    products accumulate in float32, and a row's result does not depend on the other rows
    of the batch.

    ``silu_gated=True``: ``weight`` stacks ``[gate; up]`` (``2N`` rows) and the result is
    ``silu_and_mul(x @ weight.T + bias)``, ``[M, N]``: the activation of an MLP rides on its
    gate/up product, one launch and one round trip of the ``[M, 2N]`` product less.

    ``norm=(norm_weight, eps, residual)``: returns ``rms_norm(product, norm_weight, eps,
    residual)``, the pair ``(normed, product + residual)``, from the same launch: its last
    program to finish normalises the rows (the RMSNorm after an attention output or MLP
    down projection, one launch less).

    ``weight_scale``: ``weight`` is FP8 (float8_e4m3fn) or int8, with one float32 scale per
    row, and the product is W8A8, ``x``'s rows quantized per token inside the kernel
    (``pagedllm.quantization.fp8``; int8 rows by ``quantize_rows_int8`` before the launch,
    ``pagedllm.quantization.int8``, and the FP8 weights' tiles, the same bytes); the result
    is in ``x``'s dtype. ``input_scale``
    (one float32, with ``weight_scale``): ``x`` is quantized with that static scale instead.

    ``int_weights``: ``weight`` is the packed int32 ``qweight`` of integer weights (W4A16,
    W8A16), dequantized in the kernel as the loads stream in. Raises ValueError when no
    tile fits its groups (``small_batch_matmul_config`` returns None: use the
    ``int_matmul`` path).
    """
    k = _kernels()
    rows, in_features = x.shape
    out_features = weight.shape[0] // 2 if silu_gated else weight.shape[0]
    w8a8 = "" if weight_scale is None else "int8" if weight.dtype == torch.int8 else "fp8"
    packed = (in_features * int_weights.bits + 31) // 32 if int_weights else in_features
    if rows > 16 or weight.shape[1] != packed or (silu_gated and weight.shape[0] % 2):
        raise ValueError(f"small_batch_matmul takes [M <= 16, K] @ [N, K].T (N even when "
                         f"silu_gated), got {tuple(x.shape)} and {tuple(weight.shape)}.")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if w8a8 == "int8" and rows:  # the rows quantized once, their scales per row
        x, input_scale = quantize_rows_int8(x, input_scale)
    if norm is not None:
        norm_weight, eps, residual = norm
        if silu_gated or residual.shape != out.shape or norm_weight.shape != (out_features,):
            raise ValueError(f"norm= needs a plain product and a residual of its shape "
                             f"{tuple(out.shape)}, got {tuple(residual.shape)}.")
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        normed, residual_out = torch.empty_like(out), torch.empty_like(out)
        norm_args = (norm_weight, residual, normed, residual_out)
        norm_strides = (residual.stride(0), eps)
    else:
        norm_args, norm_strides = (weight, weight, out, out), (0, 0.0)  # unused
    if weight_scale is not None and (weight_scale.numel() != weight.shape[0]
                                     or weight_scale.dtype != torch.float32):
        raise ValueError(f"weight_scale must hold one float32 scale per weight row "
                         f"({weight.shape[0]}), got {tuple(weight_scale.shape)} {weight_scale.dtype}.")
    if int_weights is None:
        kind = {"fp8": {"fp8": True}, "int8": {"int8": True}, "": {}}[w8a8]
        tile = GemvTile(*small_batch_matmul_config(rows, weight.shape[0], in_features, **kind))
        group = 0
    else:
        group = in_features if int_weights.group_size == -1 else int_weights.group_size
        tile = int_small_batch_tile(rows, weight.shape[0], in_features, int_weights)
        if tile is None:
            raise ValueError(f"no small-batch tile fits K={in_features} in groups of {group}.")
        tile = GemvTile(*tile)
        if int_weights.scales.stride() != int_weights.zeros.stride() or (
                int_weights.scales.stride(-1) != 1):
            raise ValueError("scales and zeros must be contiguous [N, groups] tensors of one "
                             "shape.")
    if rows == 0:
        return out if norm is None else (normed, residual_out)
    block_n = tile.block_n
    if silu_gated:  # two weight tiles per program: the same bytes in flight as the plain tile
        block_n = max(16, block_n // 2)
    blocks = k.cdiv(out_features, block_n)
    steps = k.cdiv(in_features, tile.block_k)
    if steps % tile.split:
        raise ValueError(f"tile {tile}: SPLIT must divide the {steps} steps of K={in_features}.")
    partial = out
    if tile.split > 1:
        width = 2 * out_features if silu_gated else out_features
        partial = torch.empty((tile.split, rows, width), dtype=torch.float32, device=x.device)
    # FP8: the largest-magnitude pass over the rows. One row (and lane-wise tiles) row by
    # row in loads of up to 8k columns; several rows on tensor cores the tile's rows at a
    # time in K tiles (docs/benchmarks.md, "FP8 on tensor cores": the row-by-row pass is
    # slower there).
    row_loop = not tile.use_dot or rows == 1
    wide = max(tile.block_k, min(8192, k.next_power_of_2(in_features)))
    amax_block = wide if row_loop else tile.block_k
    if int_weights is None:
        scale_args = (weight_scale if weight_scale is not None else out,
                      input_scale if input_scale is not None else out, out, out, 0)
    else:
        perm = int_weights.perm
        scale_args = (int_weights.scales, out, int_weights.zeros,
                      perm if perm is not None else out, int_weights.scales.stride(0))
    k.small_batch_matmul_kernel[(blocks, tile.split)](
        x, weight, bias if bias is not None else out, out,
        rows, out_features, in_features, x.stride(0), weight.stride(0), out.stride(0),
        *norm_args, arrival_counters(x.device, 1 + blocks), *norm_strides,
        *scale_args, partial, steps // tile.split * tile.block_k,
        BLOCK_M=16 if tile.use_dot else 1,
        BLOCK_N=block_n,
        BLOCK_K=tile.block_k,
        HAS_BIAS=bias is not None,
        EVEN_K=in_features % tile.block_k == 0,
        USE_DOT=tile.use_dot,
        SILU_GATED=silu_gated,
        NORM_BLOCK=k.next_power_of_2(out_features) if norm is not None else 0,
        W8A8=w8a8,
        STATIC_INPUT=w8a8 == "fp8" and input_scale is not None,
        AMAX_BLOCK=amax_block,
        ROW_LOOP=row_loop,
        INT_BITS=int_weights.bits if int_weights is not None else 0,
        GROUP=group,
        HAS_PERM=int_weights is not None and int_weights.perm is not None,
        SPLIT=tile.split,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **launch_options(x.device),
    )
    return out if norm is None else (normed, residual_out)
