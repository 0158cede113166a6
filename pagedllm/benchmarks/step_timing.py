"""Where a step's wall time goes, host side versus waiting for the device.

``StepTimer(llm)`` (or ``StepTimer(core=engine_core)``, the server's core process, which
has no front end) wraps, on one engine instance only, the calls a step is made of and
times each with the host clock (a few ``perf_counter`` calls per step: noise below 0.1%)::

    schedule      Scheduler.schedule
    prepare       InputBatch.update + prepare (flat host arrays)
    forward       ModelRunner._run_model: input copies + kernel launches or graph replay
                  (asynchronous on a GPU: the host returns before the device finishes)
    sample        logits + sampler launches (and, on the CPU, the sampling itself)
    wait          AsyncStepOutput.settle / get: waiting for a step's sampled ids to reach
                  the host (and checking a constrained step's tokens)
    update        Scheduler.update_from_output
    output        front end: detokenization, stop checks, RequestOutputs

``timeline()`` places the run in time, in seconds from the first request added: when half
the requests and when the last were added, when the first step with work was scheduled,
and when the last step's output was taken. The span between those two, less the steps'
summed time, is idle: time with no step running. Calls timed by ``track`` are reported
within that span (a server core: ``waiting`` for a request while it has none,
``messages`` applied, outputs ``send``), and so are the garbage collector's pauses, per
generation (they fall inside steps or between them).

On a GPU, ``wait`` is the device time the host could not hide; when it is near zero the
step is bound by host work. With asynchronous scheduling a step waits for the previous
step's ids, after launching its own. Steps are split into pure-decode steps (one token per
request) and the rest (prefill or mixed).
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict

from pagedllm.worker.async_output import AsyncStepOutput

PHASES = ("schedule", "prepare", "forward", "sample", "wait", "update", "output")


class StepTimer:
    """Context manager: times the phases of every step the engine runs inside it."""

    def __init__(self, llm=None, *, core=None) -> None:
        self.core = core if llm is None else llm.llm_engine.engine_core
        self.output_processor = None if llm is None else llm.llm_engine.output_processor
        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.counts: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)  # tokens scheduled, per step kind
        self._restore: list[tuple[object, str]] = []
        self._kind = "other"
        self._in_execute = False
        # perf_counter stamps of the timeline: first and last request added, first step
        # with work scheduled, last step output taken.
        self._adds: list[float] = []
        self._first_step: float | None = None
        self._last_update: float | None = None
        # label -> (start, end) stamps of the calls timed by ``track``.
        self.tracked: dict[str, list[tuple[float, float]]] = defaultdict(list)
        # Garbage collections while timing: (generation, start, end) stamps.
        self.collections: list[tuple[int, float, float]] = []
        self._gc_start = 0.0

    def __enter__(self) -> "StepTimer":
        core = self.core
        runner = core.model_runner
        self._wrap(core.scheduler, "schedule", "schedule", classify=True)
        self._wrap(runner.input_batch, "update", "prepare")
        self._wrap(runner.input_batch, "prepare", "prepare")
        self._wrap(runner, "_run_model", "forward")
        self._wrap(core.scheduler, "update_from_output", "update")
        if self.output_processor is not None:
            self._wrap(self.output_processor, "process_outputs", "output")
        self._wrap(runner, "execute_model_async", "_execute")
        self._wrap_wait()
        self._stamp(core, "add_request", self._adds.append)
        gc.callbacks.append(self._on_gc)
        return self

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.collections.append((info["generation"], self._gc_start, time.perf_counter()))

    def track(self, obj: object, name: str, label: str) -> None:
        """Also time ``obj.name`` calls under ``label`` (work between the steps, such as a
        server core's messages); ``timeline()`` reports their seconds within the steps'
        span. Call inside the ``with`` block."""
        calls = self.tracked[label]
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                calls.append((start, time.perf_counter()))

        setattr(obj, name, timed)
        self._restore.append((obj, name))

    def _stamp(self, obj: object, name: str, record) -> None:
        original = getattr(obj, name)

        def stamped(*args, **kwargs):
            record(time.perf_counter())
            return original(*args, **kwargs)

        setattr(obj, name, stamped)
        self._restore.append((obj, name))

    def timeline(self) -> dict:
        """Seconds from the first request added (see the module docstring); the steps'
        summed time and the span's rest, idle."""
        if not self._adds or self._first_step is None:
            return {}
        zero, first, last = self._adds[0], self._first_step, self._last_update
        busy = sum(row["steps"] * row["total_ms"] for row in self.summary().values()) / 1e3
        span = last - first

        def within(calls) -> float:  # seconds of (start, end) calls inside the span
            return round(sum(max(0.0, min(end, last) - max(start, first))
                             for start, end in calls), 4)

        tracked = {f"{label}_s": within(calls) for label, calls in self.tracked.items()}
        gcs = {g: [(start, end) for generation, start, end in self.collections if generation == g]
               for g in range(3)}
        return {"requests_added": len(self._adds),
                "half_added_s": round(self._adds[len(self._adds) // 2] - zero, 4),
                "last_add_s": round(self._adds[-1] - zero, 4),
                "first_step_s": round(self._first_step - zero, 4),
                "last_output_s": round(self._last_update - zero, 4),
                "steps_busy_s": round(busy, 4), "idle_s": round(span - busy, 4),
                **tracked, **{f"gc{g}_s": within(calls) for g, calls in gcs.items()},
                "gc2_collections": len(gcs[2])}

    def __exit__(self, *exc) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        for obj, name in reversed(self._restore):
            delattr(obj, name)  # back to the class attribute
        self._restore.clear()
        AsyncStepOutput.get, AsyncStepOutput.settle = self._original_wait

    def _wrap_wait(self) -> None:
        """Time ``AsyncStepOutput.settle`` and ``get`` (class attributes: outputs are new
        every step), ``settle`` inside ``get`` once."""
        self._original_wait = AsyncStepOutput.get, AsyncStepOutput.settle
        totals = self.totals
        waiting = False

        def timing(original):
            def timed(output):
                nonlocal waiting
                if waiting:
                    return original(output)
                waiting, start = True, time.perf_counter()
                try:
                    return original(output)
                finally:
                    waiting = False
                    elapsed = time.perf_counter() - start
                    totals[self._kind]["wait"] += elapsed
                    if self._in_execute:  # a forced wait inside the launch: not "sample"
                        totals[self._kind]["_wait_in_execute"] += elapsed
            return timed

        AsyncStepOutput.get = timing(self._original_wait[0])
        AsyncStepOutput.settle = timing(self._original_wait[1])

    def _wrap(self, obj: object, name: str, phase: str, classify: bool = False) -> None:
        original = getattr(obj, name)
        totals = self.totals

        def timed(*args, **kwargs):
            start = time.perf_counter()
            outer = self._in_execute
            self._in_execute = outer or phase == "_execute"
            try:
                result = original(*args, **kwargs)
            finally:
                self._in_execute = outer
            end = time.perf_counter()
            if classify:
                self._kind = _step_kind(result)
                self.counts[self._kind] += 1
                self.tokens[self._kind] += result.total_num_scheduled_tokens
                if self._first_step is None and self._kind != "empty":
                    self._first_step = start
            elif phase == "update":
                self._last_update = end
            totals[self._kind][phase] += end - start
            return result

        setattr(obj, name, timed)
        self._restore.append((obj, name))

    def summary(self) -> dict:
        """Per step kind: the steps, their mean tokens scheduled (a decode step's batch
        size), and the mean milliseconds of each phase."""
        result = {}
        for kind, phases in self.totals.items():
            steps = self.counts.get(kind, 0)
            if not steps:
                continue
            ms = {p: phases.get(p, 0.0) / steps * 1e3 for p in PHASES}
            # The rest of the launch: logits and sampler.
            ms["sample"] = (phases.get("_execute", 0.0) - phases.get("_wait_in_execute", 0.0)
                            ) / steps * 1e3 - ms["prepare"] - ms["forward"]
            ms = {p: round(v, 3) for p, v in ms.items()}
            result[kind] = {"steps": steps, "tokens": round(self.tokens[kind] / steps, 1),
                            **{f"{p}_ms": v for p, v in ms.items()},
                            "total_ms": round(sum(ms.values()), 3)}
        return result


def _step_kind(scheduler_output) -> str:
    n = scheduler_output.total_num_scheduled_tokens
    if n and n == len(scheduler_output.num_scheduled_tokens):
        return "decode"
    return "prefill_or_mixed" if n else "empty"


def format_summary(summary: dict) -> str:
    lines = [f"{'step kind':>17} {'steps':>6} " + " ".join(f"{p + ' ms':>11}" for p in PHASES)
             + f" {'total ms':>9}"]
    for kind, row in summary.items():
        lines.append(f"{kind:>17} {row['steps']:>6} "
                     + " ".join(f"{row[p + '_ms']:>11.3f}" for p in PHASES)
                     + f" {row['total_ms']:>9.3f}")
    return "\n".join(lines)
