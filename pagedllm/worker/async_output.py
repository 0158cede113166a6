"""A launched step's output on its way to the host, read without waiting for later steps.

With asynchronous scheduling the engine launches step N+1 before it reads step N's sampled
ids, so the host prepares the next step while the device computes. Reading the ids with
``tensor.tolist()`` would wait for everything queued on the stream, step N+1 included.
Instead, right after sampling, the ids are copied into a pinned host slot with a
non-blocking copy and an event is recorded behind the copy; ``get()`` waits for that event
alone. Two slots take turns, which is enough because the runner never has more than two
steps unresolved (see ``ModelRunner.execute_model_async``).

On the CPU everything runs eagerly: there is no slot and no event, and ``get()`` just reads
the ids.
"""

from __future__ import annotations

from typing import Callable

import torch

from pagedllm.core.outputs import ModelRunnerOutput

NUM_SLOTS = 2


def host_copy(tensor: torch.Tensor) -> Callable[[], list]:
    """Queue a copy of ``tensor`` (on the device) into pinned host memory, with an event
    behind it; returns a function that waits for that event alone and returns the values
    as nested lists. On the CPU it just reads them."""
    if tensor.device.type != "cuda":
        return tensor.tolist
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read() -> list:
        done.synchronize()
        return host.tolist()

    return read


class SampledIdsReadback:
    """Pinned host slots for the sampled ids of the steps in flight (CUDA only)."""

    def __init__(self, max_num_seqs: int) -> None:
        self._slots = [torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=True)
                       for _ in range(NUM_SLOTS)]
        self._events = [torch.cuda.Event() for _ in range(NUM_SLOTS)]
        self._next = 0

    def start(self, sampled: torch.Tensor) -> Callable[[], list[int]]:
        """Queue the copy of ``sampled`` (int64, on the device) to the host; returns a
        function that waits for the copy and returns the ids. The slot is reused two
        ``start`` calls later, so the function must be called before then."""
        slot, event = self._slots[self._next], self._events[self._next]
        self._next = (self._next + 1) % NUM_SLOTS
        n = sampled.shape[0]
        slot[:n].copy_(sampled, non_blocking=True)
        event.record()

        def read() -> list[int]:
            event.synchronize()
            return slot[:n].tolist()

        return read


class AsyncStepOutput:
    """The ``ModelRunnerOutput`` of a launched step; ``get()`` blocks until it is ready.

    ``check`` (optional) turns the step's sampled ids, once read, into its final ids: what
    must be settled before a later step's forward pass reads them. It runs once, on the
    first ``settle()`` (or ``get()``), so the runner can settle a step, launch the next one,
    and only then have ``finish`` turn the final ids (``None`` when the step samples
    nothing) into the output, on the first ``get()``. Both are dropped once run, with what
    they hold (a step's logits, kept for a check of its constrained rows).
    """

    def __init__(
        self,
        read_ids: Callable[[], list[int]] | None,
        finish: Callable[[list[int] | None], ModelRunnerOutput],
        check: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        self._read_ids = read_ids
        self._check = check
        self._finish = finish
        self._settled = False
        self._ids: list[int] | None = None
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> "AsyncStepOutput":
        result = cls(None, lambda _: output)
        result._settled = True
        result._output = output
        return result

    @property
    def done(self) -> bool:
        return self._output is not None

    def settle(self) -> None:
        """Read the step's ids and run ``check`` on them (once)."""
        if not self._settled:
            ids = None if self._read_ids is None else self._read_ids()
            if self._check is not None and ids is not None:
                ids = self._check(ids)
            self._ids, self._settled = ids, True
            self._read_ids = self._check = None

    def get(self) -> ModelRunnerOutput:
        if self._output is None:
            self.settle()
            self._output = self._finish(self._ids)
            self._finish, self._ids = None, None
        return self._output
