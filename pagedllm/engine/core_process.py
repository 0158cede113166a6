"""The engine core in its own process: a loop around ``EngineCore.step()`` fed over ZMQ.

The server runs the core here so that HTTP, JSON, tokenization and detokenization (all in
the API process) never hold the GIL the model loop needs::

    API process i (EngineCoreClient)                      core process (this module)
      PUSH  ── ("add", (i, [Request])) ("abort", [ids]) ("shutdown", None) ──>  PULL
      PULL  <── ("ready", CoreInfo) ("outputs", StepResult) ("error", str) ──  PUSH i

With ``--api-server-count N`` there are N API processes: the core's one PULL socket takes
every process's messages (it binds, they connect), and it has one PUSH socket per process
(each process binds its own, the core connects). Each step's outputs go
to the process that added the request (``ADD`` names it); the scheduler stats go to all.
``READY`` goes to process 0 (which started the core); ``ERROR`` to all; ``SHUTDOWN`` comes
from process 0 only.

All sockets are ZMQ ``ipc://`` endpoints inside a private (0700) temporary directory
process 0 creates, so only the same user can reach them. Every sending socket connects and
every receiving one binds: a connecting PUSH queues from the moment it connects, so no send
fails or blocks because its peer is still starting. Messages are pickled
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

import contextlib
import itertools
import json
import logging
import multiprocessing
import operator
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field, fields

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import EngineCoreOutput, SchedulerStats
from pagedllm.core.request import Request
from pagedllm.engine import gc_tuning

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
    # Requests of the receiving API process in the running batch (all of them when there
    # is one API process).
    num_running: int = 0

    def __reduce__(self):
        """Pickled with each output as a plain tuple of its fields: the core pickles every
        step's outputs between steps, and tuples pickle about 2.5x faster than dataclass
        instances (and unpickle 3x faster)."""
        return (_unpack_step_result, (list(map(_output_fields, self.outputs)), self.stats,
                                      self.queue_times, self.num_running))


_output_fields = operator.attrgetter(*(f.name for f in fields(EngineCoreOutput)))


def _unpack_step_result(rows: list[tuple], stats: SchedulerStats | None,
                        queue_times: list[float], num_running: int) -> StepResult:
    return StepResult(list(itertools.starmap(EngineCoreOutput, rows)), stats, queue_times,
                      num_running)


def run_engine_core(config: EngineConfig, input_address: str,
                    output_addresses: list[str], log_level: str = "INFO") -> None:
    """Process entry point: build the core, report ready (or the error), then serve steps.

    ``input_address``: where the core binds the socket every API process sends to;
    ``output_addresses``: one per API process, in the processes' order."""
    import zmq

    # Ctrl-C reaches the whole process group; the API process decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format="%(levelname)s %(name)s [engine core]: %(message)s")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.bind(input_address)
    outputs = []
    for address in output_addresses:
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 10_000)
        socket.setsockopt(zmq.SNDHWM, 0)  # a process still starting gets its messages later
        socket.connect(address)
        outputs.append(socket)

    def to_all(message: bytes) -> None:
        for socket in outputs:
            socket.send(message)

    exit_code = 0
    core = None
    try:
        try:
            core = _build_core(config)
        except BaseException as exc:  # noqa: BLE001 - every startup failure must reach the parent
            logger.error("Engine core failed to start:\n%s", traceback.format_exc())
            to_all(pickle.dumps((ERROR, _describe(exc))))
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
        gc_tuning.tune_for_serving()
        outputs[0].send(pickle.dumps((READY, info)))
        try:
            loop = _CoreLoop(core, inputs, outputs)
            with _step_timing(loop):
                loop.run()
        except BaseException as exc:  # noqa: BLE001
            logger.error("Engine core failed:\n%s", traceback.format_exc())
            to_all(pickle.dumps((ERROR, _describe(exc))))
            exit_code = 1
    finally:
        if core is not None:
            core.shutdown()
        inputs.close(linger=0)
        for socket in outputs:
            socket.close()
        context.term()
        if exit_code:
            sys.exit(exit_code)


# A JSON path: the core times the phases of its steps (benchmarks/step_timing.py) and
# writes their means there when it stops, with the seconds its steps took in all and the
# run's timeline.
STEP_TIMING_ENV = "PAGEDLLM_CORE_STEP_TIMING_JSON"


@contextlib.contextmanager
def _step_timing(loop: "_CoreLoop"):
    path = os.environ.get(STEP_TIMING_ENV)
    if not path:
        yield
        return
    from pagedllm.benchmarks.step_timing import StepTimer

    with StepTimer(core=loop.core) as timer:
        timer.track(loop, "_wait_for_message", "waiting")
        timer.track(loop, "_handle_messages", "messages")
        timer.track(loop, "_send", "send")
        try:
            yield
        finally:
            summary = timer.summary()
            steps_s = sum(row["steps"] * row["total_ms"] for row in summary.values()) / 1e3
            with open(path, "w") as file:
                json.dump({"step_timing": summary, "steps_s": round(steps_s, 6),
                           "timeline": timer.timeline()}, file)


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
        # With several API processes: each unfinished core request's process.
        self.owners: dict[str, int] = {}
        self.parent = multiprocessing.parent_process()
        self.parent_pid = os.getppid()
        self.next_parent_check = time.monotonic() + BUSY_PARENT_CHECK_S

    def run(self) -> None:
        while True:
            if not self.core.has_unfinished_requests() and not self._wait_for_message():
                logger.warning("The API process is gone; the engine core stops.")
                return
            keep_going, changed = self._handle_messages()
            if not keep_going:
                return
            if self.core.has_unfinished_requests():
                step_outputs = self.core.step()
                self._send(step_outputs)
                if not self._parent_alive_while_busy():
                    logger.warning("The API process is gone; the engine core stops.")
                    return
            elif changed:
                self._send(None)

    # -- messages -----------------------------------------------------------------------
    def _wait_for_message(self) -> bool:
        """Wait until a message is pending; False if the API process died meanwhile."""
        timeout_ms = int(IDLE_POLL_S * 1000)
        while not self.poller.poll(timeout_ms):
            if not self._parent_alive():
                return False
        return True

    def _handle_messages(self) -> tuple[bool, bool]:
        """Apply every pending message, without waiting. Returns (keep running, state
        changed)."""
        changed = False
        while True:
            if not self.poller.poll(0):
                return True, changed
            tag, payload = pickle.loads(self.inputs.recv())
            if tag == ADD:
                client, requests = payload
                for request in requests:
                    self.core.add_request(request)
                    self.unscheduled[request.request_id] = request
                    if len(self.outputs) > 1:
                        self.owners[request.request_id] = client
            elif tag == ABORT:
                self.core.abort_requests(payload)
                for request_id in payload:
                    self.unscheduled.pop(request_id, None)
                    self.owners.pop(request_id, None)
            elif tag == SHUTDOWN:
                return False, changed
            else:
                raise RuntimeError(f"Unknown message {tag!r} from the API process.")
            changed = True

    def _send(self, step_outputs: list[EngineCoreOutput] | None) -> None:
        """A step's outputs (None: a stats-only message), each to its API process."""
        stats = self.core.get_stats()
        queue_times = self._collect_queue_times()
        if len(self.outputs) == 1:
            result = StepResult(step_outputs or [], stats, queue_times[0], stats.num_running)
            self.outputs[0].send(pickle.dumps((OUTPUTS, result), protocol=pickle.HIGHEST_PROTOCOL))
            return
        per_client: list[list[EngineCoreOutput]] = [[] for _ in self.outputs]
        for output in step_outputs or []:
            owner = self.owners.get(output.request_id, 0)
            per_client[owner].append(output)
            if output.finish_reason is not None:
                self.owners.pop(output.request_id, None)
        running = [0] * len(self.outputs)
        for request in self.core.scheduler.running:
            running[self.owners.get(request.request_id, 0)] += 1
        for client, socket in enumerate(self.outputs):
            result = StepResult(per_client[client], stats, queue_times[client], running[client])
            socket.send(pickle.dumps((OUTPUTS, result), protocol=pickle.HIGHEST_PROTOCOL))

    def _collect_queue_times(self) -> list[list[float]]:
        """Per API process, the queue times of its requests first scheduled since the last
        call."""
        times: list[list[float]] = [[] for _ in self.outputs]
        if not self.unscheduled:
            return times
        for request_id, request in list(self.unscheduled.items()):
            if request.first_scheduled_time is not None:
                times[self.owners.get(request_id, 0)].append(
                    max(0.0, request.first_scheduled_time - request.arrival_time))
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
