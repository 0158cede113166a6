"""Where a whole workload's time goes: every step under torch.profiler.

``pagedllm bench throughput --profile-run`` submits the workload again after the measured
run and profiles it to the end. It reports, for the prompt steps (some prompt still has
tokens to compute) and the decode steps (every prompt is in) apart:

- device time by kernel family (``kernel_family``: the products, decode and prefill
  attention, norms, SiLU-and-mul, the sampler, ...), in seconds and shares, and the
  kernels of no family by name (``unclassified``: what "other" holds);
- the device's idle time inside the profiled span (``common.device_idle``);
- decode steps by running batch, in buckets of 32 requests: how many steps, their mean
  host wall time and (CUDA) the device's mean idle time a step (``idle_by_step``). With the
  device busy (idle near zero) a step's wall time is its device time, so the buckets show
  how a step's cost grows with the batch, and the idle column which batches the host bounds.

Without CUDA the same tables come from the host's op times (each op's own time, so nested
ops are not counted twice): the plumbing is testable on a CPU, the figures mean little.
Profiling slows the host side, so the run's own throughput is not reported.
"""

from __future__ import annotations

import bisect
import collections
import time
from dataclasses import dataclass

from pagedllm.benchmarks.common import reported_seconds

PROMPT, DECODE = "prompt", "decode"
STEP_MARK = "pagedllm step: "  # record_function name of a profiled step: mark, phase, index
BATCH_BUCKET = 32

# (substring of the lower-cased kernel or op name, family); the first match wins.
FAMILIES = (
    ("_decode_kernel", "decode attention"),
    ("_longest_first_kernel", "decode attention"),
    ("_prefill_kernel", "prefill attention"),
    ("scaled_dot_product", "prefill attention"),
    ("write_kv", "rope + KV write"),
    ("rotary", "rope + KV write"),
    ("small_batch_matmul", "products (Triton, few rows)"),
    ("fp8_matmul", "products (Triton GEMM)"),
    ("int8_matmul", "products (Triton GEMM)"),
    ("int_matmul", "products (Triton GEMM)"),
    ("int4_wgmma", "products (Triton GEMM)"),
    ("split_sums", "products (Triton GEMM)"),
    ("dequantize", "weight dequantization"),
    ("quantize", "activation quantization"),
    ("llm_int8_rows", "activation quantization"),
    ("nvjet", "products (BLAS)"),
    ("gemm", "products (BLAS)"),
    ("cutlass", "products (BLAS)"),
    ("splitkreduce", "products (BLAS)"),
    ("aten::mm", "products (BLAS)"),
    ("aten::addmm", "products (BLAS)"),
    ("rms_norm", "RMSNorm"),
    ("silu", "SiLU-and-mul"),
    ("row_argmax", "sampler"),
    ("exponential", "sampler"),
    ("softmax", "sampler"),
    ("memcpy", "copies"),
    ("memset", "copies"),
    ("copy_", "copies"),
)


def kernel_family(name: str) -> str:
    """The family of a device kernel (or, without CUDA, a host op) by its name; "other"
    when no entry of ``FAMILIES`` matches."""
    lowered = name.lower()
    for key, family in FAMILIES:
        if key in lowered:
            return family
    return "other"


@dataclass
class RunProfile:
    """What ``profile_run`` measured. Times in seconds."""

    num_steps: dict[str, int]
    family_s: dict[str, dict[str, float]]  # phase -> family -> device (or host op) time
    device_idle: str  # one line, "" without CUDA
    decode_by_batch: list[dict]  # bucket rows, see batch_buckets
    other_s: dict[str, list[tuple[str, float]]]  # phase -> the "other" kernels, see unclassified

    def as_dict(self) -> dict:
        return {"num_steps": self.num_steps, "family_s": self.family_s,
                "device_idle": self.device_idle, "decode_by_batch": self.decode_by_batch,
                "other_s": {phase: [list(row) for row in rows]
                            for phase, rows in self.other_s.items()}}

    def table(self) -> str:
        lines = [f"whole-run profile: {self.num_steps[PROMPT]} prompt steps, "
                 f"{self.num_steps[DECODE]} decode steps; time by kernel family"]
        totals = {phase: sum(self.family_s[phase].values()) for phase in (PROMPT, DECODE)}
        families = sorted({f for phase in self.family_s.values() for f in phase},
                          key=lambda f: -sum(self.family_s[p].get(f, 0.0) for p in (PROMPT, DECODE)))
        lines.append(f"{'family':30s} {'prompt s':>9s} {'%':>6s} {'decode s':>9s} {'%':>6s}")
        for family in families + ["total"]:
            cells = []
            for phase in (PROMPT, DECODE):
                value = totals[phase] if family == "total" else self.family_s[phase].get(family, 0.0)
                share = 100 * value / totals[phase] if totals[phase] else 0.0
                cells.append(f"{value:9.3f} {share:6.1f}")
            lines.append(f"{family:30s} {' '.join(cells)}")
        for phase, rows in self.other_s.items():
            if rows:
                lines.append(f"other, {phase}: " + ", ".join(f"{name} {seconds:.3f} s"
                                                            for name, seconds in rows))
        if self.device_idle:
            lines.append(self.device_idle)
        lines.append("decode steps by running batch (host wall time and device idle per step):")
        lines.append(f"{'requests':>12s} {'steps':>6s} {'mean ms':>8s} {'total s':>8s} "
                     f"{'idle ms':>8s}")
        for row in self.decode_by_batch:
            idle = f"{row['idle_ms']:8.3f}" if "idle_ms" in row else f"{'-':>8s}"
            lines.append(f"{row['low']:5d}-{row['high']:<6d} {row['steps']:6d} "
                         f"{row['mean_ms']:8.2f} {row['total_s']:8.3f} {idle}")
        return "\n".join(lines)


def batch_buckets(steps: list[tuple], width: int = BATCH_BUCKET) -> list[dict]:
    """Decode steps ``(running requests, wall seconds[, device idle seconds])`` grouped by
    batch: rows of ``{"low", "high", "steps", "mean_ms", "total_s"}`` (and ``"idle_ms"``,
    the mean idle a step, when every step has one) for batches ``low..high`` (``width``
    wide: 1-32, 33-64, ...), in increasing order, empty buckets left out."""
    grouped: dict[int, list[tuple]] = collections.defaultdict(list)
    for batch, *times in steps:
        grouped[max(batch - 1, 0) // width].append(times)
    rows = []
    for k, v in sorted(grouped.items()):
        total_s = reported_seconds(sum(t[0] for t in v))
        row = {"low": k * width + 1, "high": (k + 1) * width, "steps": len(v),
               "mean_ms": round(1e3 * total_s / len(v), 3), "total_s": total_s}
        if all(len(t) > 1 for t in v):
            row["idle_ms"] = round(1e3 * sum(t[1] for t in v) / len(v), 3)
        rows.append(row)
    return rows


def idle_by_step(ranges: list[tuple[float, float]], intervals: list[tuple[float, float]]
                 ) -> list[float]:
    """The device's idle time charged to each step, in seconds, in the order of ``ranges``
    (the steps' device spans ``(start, end)``, sorted, not overlapping). An idle gap between
    ``intervals`` (kernels, overlapping or not; microseconds) is charged to the step whose
    span holds the gap's end, else to the next step: the step whose work the device waited
    for. Gaps before the first step's span or after the last are left out."""
    if not ranges:
        return []
    starts = [r[0] for r in ranges]
    idle = [0.0] * len(ranges)
    intervals = sorted(intervals)
    covered_until = intervals[0][0] if intervals else 0.0
    for start, end in intervals:
        if start > covered_until:
            i = bisect.bisect_right(starts, start) - 1
            if i < 0 or start > ranges[i][1]:
                i += 1
            if 0 <= i < len(ranges) and covered_until >= starts[0]:
                idle[i] += (start - covered_until) / 1e6
        covered_until = max(covered_until, end)
    return idle


def attribute(ranges: list[tuple[float, float, str]], events: list[tuple[float, float, str]],
              key=kernel_family) -> dict[str, dict[str, float]]:
    """Sum each event's duration into ``phase -> key(name)`` (by default its family) by the
    step range its start falls in. ``ranges``: ``(start, end, phase)``, not overlapping;
    ``events``: ``(start, end, name)``; times in microseconds, sums in seconds. Events
    outside every range are left out (work queued before the first step or after the last)."""
    ranges = sorted(ranges)
    starts = [r[0] for r in ranges]
    sums: dict[str, dict[str, float]] = {PROMPT: collections.Counter(), DECODE: collections.Counter()}
    for start, end, name in events:
        i = bisect.bisect_right(starts, start) - 1
        if i < 0 or start >= ranges[i][1]:
            continue
        sums[ranges[i][2]][key(name)] += (end - start) / 1e6
    return {phase: dict(families) for phase, families in sums.items()}


OTHER_SHOWN, OTHER_NAME_CHARS = 6, 60


def unclassified(ranges: list[tuple[float, float, str]], events: list[tuple[float, float, str]]
                 ) -> dict[str, list[tuple[str, float]]]:
    """The kernels of family "other" by name (the first ``OTHER_NAME_CHARS`` characters),
    attributed as ``attribute`` does: ``phase -> [(name, seconds), ...]``, the
    ``OTHER_SHOWN`` largest, largest first."""
    other = [e for e in events if kernel_family(e[2]) == "other"]
    sums = attribute(ranges, other, key=lambda name: name[:OTHER_NAME_CHARS])
    return {phase: sorted(((name, reported_seconds(seconds)) for name, seconds in names.items()),
                          key=lambda row: -row[1])[:OTHER_SHOWN]
            for phase, names in sums.items()}


def prompts_pending(scheduler) -> bool:
    """Whether a request still waits or has prompt tokens left to compute."""
    return bool(scheduler.num_waiting) or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)


def profile_run(engine) -> RunProfile:
    """Step ``engine`` (an ``LLMEngine`` with requests added) until none is unfinished,
    under torch.profiler; see the module docstring."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pagedllm.benchmarks.common import device_idle

    cuda = torch.cuda.is_available()
    scheduler = engine.engine_core.scheduler
    steps: list[tuple[str, int, float]] = []  # (phase, running requests, wall seconds)
    num_steps = {PROMPT: 0, DECODE: 0}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        while engine.has_unfinished_requests():
            phase = PROMPT if prompts_pending(scheduler) else DECODE
            batch = len(scheduler.running)
            start = time.perf_counter()
            with torch.profiler.record_function(f"{STEP_MARK}{phase} {len(steps)}"):
                engine.step()
            num_steps[phase] += 1
            steps.append((phase, batch, time.perf_counter() - start))
        if cuda:
            torch.cuda.synchronize()
    device = DeviceType.CUDA if cuda else DeviceType.CPU
    ranges, events, range_steps = [], [], []
    for e in prof.events():
        if e.device_type != device:
            continue
        if e.name.startswith(STEP_MARK):
            phase, index = e.name[len(STEP_MARK):].split()
            ranges.append((e.time_range.start, e.time_range.end, phase))
            range_steps.append(int(index))
        elif cuda:
            events.append((e.time_range.start, e.time_range.end, e.name))
        else:  # a host op: its own time only, nested ops count for themselves
            events.append((e.time_range.start, e.time_range.start + e.self_cpu_time_total, e.name))
    kernels = [(s, t) for s, t, _ in events]
    idle = device_idle(kernels) if cuda and events else ""
    if cuda and events:  # a step that launched nothing has no device span, and no idle
        spans = sorted(zip(ranges, range_steps))
        step_idle = [0.0] * len(steps)
        for index, gap in zip((i for _, i in spans),
                              idle_by_step([(s, t) for (s, t, _), _ in spans], kernels)):
            step_idle[index] += gap
        steps = [(*step, gap) for step, gap in zip(steps, step_idle, strict=True)]
    decode_steps = [(batch, *times) for phase, batch, *times in steps if phase == DECODE]
    return RunProfile(num_steps, attribute(ranges, events), idle, batch_buckets(decode_steps),
                      unclassified(ranges, events))
