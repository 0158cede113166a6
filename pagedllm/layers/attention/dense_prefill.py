"""Long prompts' attention through a library's fused kernel (cuDNN's on Hopper).

cuDNN's fused attention outruns the Triton prefill kernel on long prompts on Hopper
(docs/benchmarks.md, "Long prompts through cuDNN's fused attention"), but it reads
contiguous keys, not pages, knows only the causal mask aligned to the first query, and
builds a plan for each new shape (then cached by torch for the process). So a prompt
sequence of ``n`` new tokens after ``c`` cached ones is attended in at most two calls, in
``[tokens, heads, head_dim]`` layout, with ``c = c0 + r`` (``c0`` a multiple of
``CONTEXT_STEP``, ``r`` below it):

    own keys     keys ``[c0, c + n)``, causal, with ``r`` dummy queries (zeros) before the
                 ``n`` real ones: the mask aligned to the first query is then the
                 sequence's own (real query ``i`` sees keys up to ``c + i``);
    context      the ``n`` queries over keys ``[0, c0)``, no mask;

each returning its log-sum-exp, and the two are merged exactly (``merge_attention_parts``).
Both calls' query counts are padded at the end to a multiple of ``SHAPE_STEP`` (the own
keys too, zeros the causal mask hides), so the shapes a workload needs are few; and a
shape takes the path only once its plan has paid (``PLAN_COST_S``). Keys and values are
gathered from the sequence's pages (written by this step's cache write first, so the new
keys are the cache's own values, rotated) with one ``index_select`` of its blocks each.

``PAGEDLLM_DENSE_PREFILL`` chooses (read at import; ``DENSE_PREFILL`` may be reassigned):

    default    cudnn on GPUs of compute capability 9.x (where it was measured), else off
    off        the Triton prefill kernel for every prompt
    cudnn      cuDNN's attention (grouped key heads read in place)
    flash      torch's FlashAttention (key heads repeated to the query heads)
    math       float32 products in plain torch ops (a reference, for tests)

A prompt sequence takes the path where it computes what the Triton kernel computes and is
faster: at least ``MIN_TOKENS`` new tokens and ``MIN_KEYS`` keys in all, no sliding window
and no soft cap, the cache in the queries' dtype or FP8 (its keys and values widened
exactly in the gather, as the Triton kernels widen them), never while a CUDA graph is
captured, and its keys and values within ``MAX_GATHER_BYTES`` (the gathered copy is memory
the start-up profile does not count); the libraries' kernels also want fp16 or bf16 and a
head size of at most 128, a multiple of 8. The step's other prompts stay on the Triton
kernel (which skips the sequences taken here) and its decodes on the decode kernel. A
library call that fails (``refused``) turns the path off for the process, with a warning,
and its step runs the Triton kernel.
"""

from __future__ import annotations

import logging
import math
import os

import torch
import triton
import triton.language as tl

from pagedllm.layers.attention.backend import AttentionMetadata
from pagedllm.layers.attention.triton_common import uses_fp16_dot
from pagedllm.quantization.fp8 import FP8_DTYPE

logger = logging.getLogger(__name__)

CHOICES = ("default", "off", "cudnn", "flash", "math")

# A prompt sequence takes the path with at least MIN_TOKENS new tokens and MIN_KEYS keys
# in all (cached context included); below, the Triton kernel's one launch for the whole
# batch beats calls per sequence (docs/benchmarks.md).
MIN_TOKENS = 2048
MIN_KEYS = 4096

# Shapes: the own keys' cut below the context (tokens), and the padding of query counts.
CONTEXT_STEP = 1024
SHAPE_STEP = 256

# cuDNN builds a plan per new shape (torch then keeps it), so a shape without one is left
# to the Triton kernel until the time its calls would have saved reaches the plan's cost:
# a workload of ever new chunk shapes stays on the kernel, a recurring one moves. The
# plan's cost in seconds and the rates the saving is estimated from (TFLOP/s over the
# visible keys; the kernel's by the cache's bits) are an H200's, from docs/benchmarks.md.
PLAN_COST_S = 0.05
KERNEL_TFLOPS = {16: 380.0, 8: 260.0}
LIBRARY_TFLOPS = 590.0

# The largest gathered keys plus values of one sequence, bytes (65,536 tokens of
# Llama-3.1-8B's 8 KV heads of 128 in bf16).
MAX_GATHER_BYTES = 256 << 20


def _setting() -> str:
    value = os.environ.get("PAGEDLLM_DENSE_PREFILL", "default").strip().lower() or "default"
    if value not in CHOICES:
        raise ValueError(f"PAGEDLLM_DENSE_PREFILL={value!r}: give one of {', '.join(CHOICES)} "
                         "(a library's fused attention for long prompts).")
    return value


DENSE_PREFILL = _setting()


# Disabled for the process after a library call refused a step (``refused``).
_refused = False


def _backend(query: torch.Tensor) -> str:
    """The setting in force for ``query`` ("default" resolved; "off" where the libraries'
    kernels do not take its dtype or head size)."""
    setting = "off" if _refused else DENSE_PREFILL
    if setting == "default":
        cuda = query.is_cuda and torch.backends.cudnn.is_available()
        hopper = cuda and torch.cuda.get_device_capability(query.device)[0] == 9
        setting = "cudnn" if hopper else "off"
    if setting in ("cudnn", "flash") and (
            query.dtype not in (torch.float16, torch.bfloat16)
            or query.shape[-1] % 8 or query.shape[-1] > 128):
        return "off"
    return setting


def refused(error: RuntimeError) -> None:
    """Turn the library path off for this process after ``error`` from one of its calls
    (a shape or build the installed library does not take); the step falls back to the
    Triton kernel."""
    global _refused
    _refused = True
    logger.warning("Long prompts' fused attention (PAGEDLLM_DENSE_PREFILL=%s) failed and is "
                   "off from now on; the Triton prefill kernel takes its steps: %s",
                   DENSE_PREFILL, str(error).splitlines()[0] if str(error) else error)


def select(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
           sliding_window: int | None, logits_soft_cap: float | None) -> tuple[int, ...]:
    """The prompt sequences of this step that attend through ``dense_prefill`` (see the
    module docstring); the step's other prompts stay on the Triton kernel."""
    if (metadata.max_query_len < MIN_TOKENS or sliding_window is not None or logits_soft_cap
            or kv_cache.dtype not in (query.dtype, FP8_DTYPE)):
        return ()
    backend = _backend(query)
    if backend == "off":
        return ()
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        return ()
    # One token of K and of V as gathered (an FP8 cache's widened to 16 bits), bytes.
    token_bytes = 2 * math.prod(kv_cache.shape[-2:]) * query.element_size()
    seqs, shapes = _candidates(metadata, token_bytes)
    if not seqs or backend != "cudnn":
        return seqs
    model = (query.shape[1], kv_cache.shape[-2], query.shape[-1], query.dtype)
    ready = _plans.ready([(*shape, *model) for shape in shapes], kv_cache.element_size())
    return seqs if ready else ()


_last_candidates: tuple = (None, None, ((), ()))


def _candidates(metadata: AttentionMetadata, token_bytes: int) -> tuple[tuple[int, ...], list]:
    """The step's prompt sequences long enough for the path (``MIN_TOKENS``, ``MIN_KEYS``,
    ``MAX_GATHER_BYTES``) and the calls' shapes, ``(queries, keys, causal)``; found by the
    step's first layer and kept for the others (the same metadata and host lists)."""
    global _last_candidates
    qsl = metadata.query_start_loc_cpu
    key = (tuple(qsl), tuple(metadata.seq_lens_cpu), token_bytes, MIN_TOKENS, MIN_KEYS,
           CONTEXT_STEP, SHAPE_STEP, MAX_GATHER_BYTES)
    cached_metadata, cached_key, found = _last_candidates
    if cached_metadata is metadata and cached_key == key:
        return found
    seqs, shapes = [], []
    for b, seq_len in enumerate(metadata.seq_lens_cpu):
        query_len = qsl[b + 1] - qsl[b]
        if (query_len <= 1 or query_len < MIN_TOKENS or seq_len < MIN_KEYS
                or seq_len * token_bytes > MAX_GATHER_BYTES):
            continue
        seqs.append(b)
        cut, _, own_len, past_len = _layout(query_len, seq_len)
        shapes.append((own_len, own_len, True))
        if cut:
            shapes.append((past_len, cut, False))
    found = (tuple(seqs), shapes)
    _last_candidates = (metadata, key, found)
    return found


class _PlanLedger:
    """Which cuDNN shapes have plans, and what the calls of those without one would have
    saved so far (seconds)."""

    def __init__(self) -> None:
        self.built: set[tuple] = set()
        self.saved: dict[tuple, float] = {}

    def ready(self, shapes: list[tuple], cache_bytes: int) -> bool:
        """Whether a call's shapes all have plans, or those without one have now saved,
        together, what their plans cost (they then count as built); each missing shape is
        credited with this call's saving on it first."""
        missing = [shape for shape in dict.fromkeys(shapes) if shape not in self.built]
        kernel = KERNEL_TFLOPS[16 if cache_bytes > 1 else 8]
        for shape in missing:
            q_len, k_len, causal, heads, _, dim, _ = shape
            flops = 4 * q_len * (k_len / 2 if causal else k_len) * dim * heads
            self.saved[shape] = self.saved.get(shape, 0.0) + flops * (
                1 / kernel - 1 / LIBRARY_TFLOPS) / 1e12
        if sum(self.saved[shape] for shape in missing) < PLAN_COST_S * len(missing):
            return False
        self.built.update(missing)
        return True


_plans = _PlanLedger()


def _layout(n: int, seq_len: int) -> tuple[int, int, int, int]:
    """A prompt sequence's calls (module docstring): the context's cut, the dummy queries
    before the ``n`` real ones, the own call's length (queries and keys), the context
    call's query count."""
    cut = (seq_len - n) // CONTEXT_STEP * CONTEXT_STEP
    dummies = seq_len - n - cut
    return cut, dummies, _round_up(dummies + n, SHAPE_STEP), _round_up(n, SHAPE_STEP)


def dense_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, metadata: AttentionMetadata, seqs: tuple[int, ...],
                  scale: float, out: torch.Tensor, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> None:
    """Attention of prompt sequences ``seqs`` (``select``) into their rows of ``out``.

    ``query: [T, H, D]`` rotated; ``key_cache, value_cache: [blocks, page, Hkv, D]``
    (``paged_kv_views``) holding every sequence's keys and values, this step's included;
    ``H`` a multiple of ``Hkv``. An FP8 cache's values are gathered widened (exactly) to
    the dtype the Triton kernels multiply them in (``uses_fp16_dot``), the queries cast to
    it, ``k_scale`` folded into the score scale and ``v_scale`` applied to the output.
    Other rows of ``out`` are left alone."""
    backend = _backend(query)
    dtype = (torch.float16 if uses_fp16_dot(query.dtype, key_cache.dtype) else query.dtype)
    query = query.to(dtype)
    scale *= k_scale
    qsl = metadata.query_start_loc_cpu
    for b in seqs:
        seq_len, start, end = metadata.seq_lens_cpu[b], qsl[b], qsl[b + 1]
        n = end - start
        cut, dummies, own_len, past_len = _layout(n, seq_len)
        key, value = _gather(key_cache, value_cache, block_tables[b], seq_len, cut + own_len,
                             dtype)
        q = _padded(query[start:end], dummies, max(own_len, dummies + past_len))
        own, own_lse = _attend(backend, q[:own_len], key[cut:cut + own_len],
                               value[cut:cut + own_len], scale, causal=True)
        own, own_lse = own[dummies:dummies + n], own_lse[:, dummies:dummies + n]
        if cut == 0:
            out[start:end].copy_(own if v_scale == 1.0 else own * v_scale)
            continue
        past, past_lse = _attend(backend, q[dummies:dummies + past_len], key[:cut], value[:cut],
                                 scale, causal=False)
        merge_attention_parts(own, own_lse, past[:n], past_lse[:, :n], out[start:end], v_scale)


def warm_up(query_dtype: torch.dtype, kv_cache: torch.Tensor, num_heads: int) -> bool:
    """Make the path's first real call cheap: initialise the library (its first call is
    the slowest by far) and compile the merge kernel for a model's attention
    (``kv_cache: [2, blocks, page, Hkv, D]``, the queries' dtype and head count), on tiny
    tensors. Returns whether the path is on for that model (a library that refuses the
    call turns it off, as ``refused`` says)."""
    tokens, kv_heads, dim = SHAPE_STEP, kv_cache.shape[-2], kv_cache.shape[-1]
    query = torch.zeros((tokens, num_heads, dim), dtype=query_dtype, device=kv_cache.device)
    backend = _backend(query)
    if backend == "off" or kv_cache.dtype not in (query_dtype, FP8_DTYPE):
        return False
    dtype = torch.float16 if uses_fp16_dot(query_dtype, kv_cache.dtype) else query_dtype
    keys = torch.zeros((tokens, kv_heads, dim), dtype=dtype, device=kv_cache.device)
    try:
        own, own_lse = _attend(backend, query.to(dtype), keys, keys, 1.0, causal=True)
    except RuntimeError as error:
        refused(error)
        return False
    merge_attention_parts(own, own_lse, own, own_lse, query, 1.0)
    return True


def _round_up(x: int, step: int) -> int:
    return -(-x // step) * step


def _gather(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
            seq_len: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's ``seq_len`` keys and values from its pages, ``[length, Hkv, D]`` each
    in ``dtype`` (``length >= seq_len``), zero past ``seq_len`` (a page's unwritten slots
    may hold anything, and a masked key's value still meets a zero weight)."""
    page = key_cache.shape[1]
    blocks = block_table[:triton.cdiv(seq_len, page)]
    rows = []
    for cache in (key_cache, value_cache):
        fp8 = cache.dtype == FP8_DTYPE
        if fp8:  # moved as bytes (any layout: an FP8 cache's values are slot-major)
            cache = cache.view(torch.uint8)
        buf = cache.new_empty((triton.cdiv(length, page), *cache.shape[1:]))
        torch.index_select(cache, 0, blocks, out=buf[:blocks.shape[0]])
        buf = buf.flatten(0, 1)[:length]
        if fp8:
            buf = buf.view(FP8_DTYPE).to(dtype)
        buf[seq_len:].zero_()
        rows.append(buf)
    return rows[0], rows[1]


def _padded(x: torch.Tensor, before: int, length: int) -> torch.Tensor:
    """``x`` after ``before`` zero rows, zeros after it up to ``length`` rows (``x``
    itself where nothing is added)."""
    if before == 0 and length == x.shape[0]:
        return x
    padded = x.new_zeros((length, *x.shape[1:]))
    padded[before:before + x.shape[0]] = x
    return padded


def _attend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q: [n, H, D]`` over ``k, v: [m, Hkv, D]`` (causal from the first
    query when ``causal``): the output ``[n, H, D]`` (any strides) and each row's natural
    log-sum-exp of its scaled scores, ``[H, n]`` float32, contiguous along ``n``."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, tokens, D]
    if backend == "cudnn":
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    elif backend == "flash":
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:  # math
        k, v = (x.repeat_interleave(groups, dim=1).float() for x in (k, v))
        scores = q.float() @ k.transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(
                torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                float("-inf"))
        lse = scores.logsumexp(-1)
        o = (torch.softmax(scores, -1) @ v).to(q.dtype)
    return o[0].transpose(0, 1), lse.reshape(lse.shape[1], -1)


def merge_attention_parts(a: torch.Tensor, a_lse: torch.Tensor, b: torch.Tensor,
                          b_lse: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
    """``out = scale (a e^a_lse + b e^b_lse) / (e^a_lse + e^b_lse)`` row by row: the
    attention over two disjoint sets of keys from each part's output and log-sum-exp.
    ``a, b, out: [n, H, D]`` (a unit stride along ``D``); ``a_lse, b_lse: [H, n]``
    float32."""
    n, heads, dim = out.shape
    _merge_kernel[(n,)](
        a, a_lse, b, b_lse, out, scale, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        a_lse.stride(0), b_lse.stride(0), out.stride(0), out.stride(1), heads, dim,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
    )


@triton.jit
def _merge_kernel(a_ptr, a_lse_ptr, b_ptr, b_lse_ptr, out_ptr, scale, stride_at, stride_ah,
                  stride_bt, stride_bh, stride_alse, stride_blse, stride_ot, stride_oh,
                  HEADS, HEAD_DIM, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token ``program_id(0)``, every head: weights from the two log-sum-exps in float32."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    a_lse = tl.load(a_lse_ptr + h * stride_alse + t, mask=h < HEADS, other=0.0)
    b_lse = tl.load(b_lse_ptr + h * stride_blse + t, mask=h < HEADS, other=0.0)
    top = tl.maximum(a_lse, b_lse)
    wa = tl.exp(a_lse - top)
    wb = tl.exp(b_lse - top)
    total = (wa + wb) / scale
    mask = (h < HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    a = tl.load(a_ptr + t * stride_at + h[:, None] * stride_ah + d[None, :], mask=mask)
    b = tl.load(b_ptr + t * stride_bt + h[:, None] * stride_bh + d[None, :], mask=mask)
    merged = (a.to(tl.float32) * (wa / total)[:, None] + b.to(tl.float32) * (wb / total)[:, None])
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=mask)
