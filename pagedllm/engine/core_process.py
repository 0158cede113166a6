"""The engine core in its own process: a loop around ``EngineCore.step()`` fed over ZMQ.

The server runs the core here so that HTTP, JSON, tokenization and detokenization (all in
the API process) never hold the GIL the model loop needs::

    API process (EngineCoreClient)                     core process (this module)
      PUSH  ── ("add", [Request]) ("abort", [ids]) ("shutdown", None) ──>  PULL
      PULL  <── ("ready", CoreInfo) ("outputs", StepResult) ("error", str) ──  PUSH

Both sockets are ZMQ ``ipc://`` endpoints inside a private (0700) temporary directory the
API process creates and binds, so only the same user can reach them. Messages are pickled
tuples of the plain dataclasses in ``pagedllm.core`` (no tensors ever cross): pickle
because ``Request`` and ``SamplingParams`` are ordinary Python objects the core already
uses, with no schema to keep in step.

Loop invariants:
- With no unfinished request the loop blocks in ``poll`` (a timeout of ``IDLE_POLL_S`` lets
  it notice a dead parent) and burns no CPU.
- With requests running it drains every pending message without blocking before each step,
  so an abort lands before the next step and the aborted request's blocks are free at once.
- Every step's outputs go back in one message together with a scheduler stats snapshot;
  a message that changes state without a step (an abort when idle) is answered with a
  stats-only message, so metrics never show a request that is gone.
- A failure while starting (a KV cache too small for one request, a bad checkpoint) or
  while stepping is sent as ``("error", message)`` before the process exits non-zero.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import EngineCoreOutput, SchedulerStats
from pagedllm.core.request import Request

logger = logging.getLogger(__name__)

# Seconds an idle core waits for a message before checking that its parent is alive.
IDLE_POLL_S = 1.0
# Seconds between parent checks while busy (the parent could die mid-generation).
BUSY_PARENT_CHECK_S = 2.0

# Message tags, API process -> core.
ADD, ABORT, SHUTDOWN = "add", "abort", "shutdown"
# Message tags, core -> API process.
READY, OUTPUTS, ERROR = "ready", "outputs", "error"


@dataclass
class CoreInfo:
    """What the API process learns about the core once it is ready (for logs and metrics)."""

    model: str
    dtype: str
    device: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    kv_cache_dtype: str  # the cache's element type, e.g. "bfloat16" or "float8_e4m3fn"

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of ``max_model_len`` tokens fit in the KV cache at once."""
        return self.num_kv_tokens / self.max_model_len


@dataclass
class StepResult:
    """One step's outputs, the scheduler's state after it, and queueing delays it revealed."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None
    # Seconds from arrival to first scheduling, one per core request first scheduled
    # in this step.
    queue_times: list[float] = field(default_factory=list)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    log_level: str = "INFO") -> None:
    """Process entry point: build the core, report ready (or the error), then serve steps."""
    import zmq

    # Ctrl-C reaches the whole process group; the API process decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format="%(levelname)s %(name)s [engine core]: %(message)s")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 10_000)
    outputs.connect(output_address)
    exit_code = 0
    core = None
    try:
        try:
            core = _build_core(config)
        except BaseException as exc:  # noqa: BLE001 - every startup failure must reach the parent
            logger.error("Engine core failed to start:\n%s", traceback.format_exc())
            outputs.send(pickle.dumps((ERROR, _describe(exc))))
            exit_code = 1
            return
        info = CoreInfo(
            model=config.model_config.path.name,
            dtype=str(core.model_runner.dtype).replace("torch.", ""),
            device=config.device,
            num_kv_blocks=core.num_kv_blocks,
            block_size=config.cache_config.block_size,
            max_model_len=config.model_config.max_model_len,
            kv_cache_dtype=core.kv_cache_dtype,
        )
        outputs.send(pickle.dumps((READY, info)))
        try:
            _CoreLoop(core, inputs, outputs).run()
        except BaseException as exc:  # noqa: BLE001
            logger.error("Engine core failed:\n%s", traceback.format_exc())
            outputs.send(pickle.dumps((ERROR, _describe(exc))))
            exit_code = 1
    finally:
        if core is not None:
            core.shutdown()
        inputs.close(linger=0)
        outputs.close()
        context.term()
        if exit_code:
            sys.exit(exit_code)


def _build_core(config: EngineConfig):
    from pagedllm.engine.engine_core import EngineCore

    return EngineCore(config)


def _describe(exc: BaseException) -> str:
    """A user-facing line: ValueErrors already say what to change; others need their type."""
    if isinstance(exc, ValueError) and str(exc):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class _CoreLoop:
    def __init__(self, core, inputs, outputs) -> None:
        import zmq

        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        # Core requests not scheduled yet, for their queue time (arrival -> first scheduled).
        self.unscheduled: dict[str, Request] = {}
        self.parent = multiprocessing.parent_process()
        self.parent_pid = os.getppid()
        self.next_parent_check = time.monotonic() + BUSY_PARENT_CHECK_S

    def run(self) -> None:
        while True:
            busy = self.core.has_unfinished_requests()
            keep_going, changed = self._handle_messages(block=not busy)
            if not keep_going:
                return
            if self.core.has_unfinished_requests():
                step_outputs = self.core.step()
                self._send(step_outputs)
                if not self._parent_alive_while_busy():
                    logger.warning("The API process is gone; the engine core stops.")
                    return
            elif changed:
                self._send([])

    # -- messages -----------------------------------------------------------------------
    def _handle_messages(self, block: bool) -> tuple[bool, bool]:
        """Apply every pending message. Returns (keep running, state changed)."""
        timeout_ms = int(IDLE_POLL_S * 1000) if block else 0
        changed = False
        while True:
            if not self.poller.poll(timeout_ms):
                if block and not changed and not self._parent_alive():
                    logger.warning("The API process is gone; the engine core stops.")
                    return False, changed
                if block and not changed:
                    continue  # still idle: keep waiting
                return True, changed
            tag, payload = pickle.loads(self.inputs.recv())
            timeout_ms = 0
            if tag == ADD:
                for request in payload:
                    self.core.add_request(request)
                    self.unscheduled[request.request_id] = request
            elif tag == ABORT:
                self.core.abort_requests(payload)
                for request_id in payload:
                    self.unscheduled.pop(request_id, None)
            elif tag == SHUTDOWN:
                return False, changed
            else:
                raise RuntimeError(f"Unknown message {tag!r} from the API process.")
            changed = True

    def _send(self, step_outputs: list[EngineCoreOutput]) -> None:
        result = StepResult(step_outputs, self.core.get_stats(), self._collect_queue_times())
        self.outputs.send(pickle.dumps((OUTPUTS, result), protocol=pickle.HIGHEST_PROTOCOL))

    def _collect_queue_times(self) -> list[float]:
        if not self.unscheduled:
            return []
        times = []
        for request_id, request in list(self.unscheduled.items()):
            if request.first_scheduled_time is not None:
                times.append(max(0.0, request.first_scheduled_time - request.arrival_time))
                del self.unscheduled[request_id]
            elif request.is_finished():
                del self.unscheduled[request_id]
        return times

    # -- parent liveness ----------------------------------------------------------------
    def _parent_alive(self) -> bool:
        if self.parent is not None:
            return self.parent.is_alive()
        return os.getppid() == self.parent_pid

    def _parent_alive_while_busy(self) -> bool:
        now = time.monotonic()
        if now < self.next_parent_check:
            return True
        self.next_parent_check = now + BUSY_PARENT_CHECK_S
        return self._parent_alive()
