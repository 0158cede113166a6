"""The engine core's model runner when the model is split over ranks (tensor-parallel
ranks, pipeline stages).

``make_model_runner(config)`` gives the engine core what executes its steps: with one
rank the ``ModelRunner`` itself, in this process; with several a ``MultiprocExecutor``,
which has the runner's interface (``initialize_kv_cache``, ``execute_model_async``,
``dtype``, ``kv_cache_dtype``, ``shutdown``) and drives one worker per rank
(``worker.py``): local processes ("mp"), or Ray actors ("ray", ``ray_executor.py``).

The scheduler stays single, in the engine core. Each step's plan is pickled once and
sent to every rank; the reporting rank's output comes back (the ranks sample the same
tokens, see ``worker.py``), and the grammar questions it asks while it launches or reads
a step are answered from the engine's grammars, to every sampling rank. The engine never waits on a rank without also watching the others: a rank
that dies, or reports an error, fails the engine at once with a ``WorkerError`` naming
it, and the other ranks are stopped, so a dead rank cannot leave the engine hanging in
a collective.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import socket
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Callable

import numpy as np

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.worker import reporting_rank

logger = logging.getLogger(__name__)

# Seconds a rank may take to stop before it is killed.
STOP_GRACE_S = 5.0


class WorkerError(RuntimeError):
    """A rank died or failed; the engine cannot go on."""


def make_model_runner(config: EngineConfig):
    """The ``ModelRunner`` (one rank) or the executor of the configured backend."""
    parallel = config.parallel_config
    if parallel.world_size == 1 and parallel.distributed_executor_backend != "ray":
        from pagedllm.worker.model_runner import ModelRunner

        return ModelRunner(config)
    from pagedllm.distributed.checks import check_parallel_start

    check_parallel_start(config)
    if parallel.distributed_executor_backend == "ray":
        from pagedllm.distributed.ray_executor import RayWorkers

        return MultiprocExecutor(config, RayWorkers(config))
    return MultiprocExecutor(config, LocalWorkers(config))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for the ranks' rendezvous)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class _RemoteStep:
    """A launched step whose output rank 0 sends; ``get()`` reads it (in launch order)."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor = executor
        self._output: ModelRunnerOutput | None = None

    @property
    def done(self) -> bool:
        return self._output is not None

    def get(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._next_output()
        return self._output


class _ReadyStep(_RemoteStep):
    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output


class MultiprocExecutor:
    """Drives ``workers`` (one connection per rank, rank 0 first; see ``LocalWorkers``
    and ``RayWorkers``): sends each message to every rank, reads rank 0's answers, and
    watches every rank while it waits."""

    def __init__(self, config: EngineConfig, workers) -> None:
        self.config = config
        self.workers = workers
        self.connections: list[Connection] = workers.connections
        self._outputs: deque[ModelRunnerOutput] = deque()
        self.reporter = reporting_rank(config)
        self._pipelined = config.parallel_config.pipeline_parallel_size > 1
        # The last stage's ranks, which sample and so take the grammars' answers.
        self._sampling = range(self.reporter, len(self.connections))
        # The grammars of the latest step (structured outputs), which answer the
        # reporting rank's questions.
        self._grammars = None
        self._closed = False
        try:
            info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.dtype = info["dtype"]
        self.kv_cache_dtype = info["kv_cache_dtype"]
        self.num_host_blocks = 0  # every rank holds as many (--swap-space), set with the cache
        logger.info("%d ranks ready (%s backend).", len(self.connections),
                    config.parallel_config.distributed_executor_backend)

    # -- the runner's interface -----------------------------------------------------------
    def initialize_kv_cache(self) -> int:
        self._send(("kv",))
        _, num_blocks, self.num_host_blocks = self._receive(self.reporter, "kv")
        return num_blocks

    def execute_model_async(self, scheduler_output: SchedulerOutput,
                            grammars: Callable | None = None) -> _RemoteStep:
        """Send the step to every rank and, without pipeline stages, wait until the
        reporting rank has launched it (answering its grammar questions meanwhile);
        ``get()`` on the result reads the step's output (answering them too)."""
        if grammars is not None:
            self._grammars = grammars
        self._send(("step", scheduler_output))
        if not self._pipelined:
            self._receive(self.reporter, "launched")
        if scheduler_output.is_empty:
            return _ReadyStep(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        return _RemoteStep(self)

    def shutdown(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every rank (given ``grace_s`` seconds to finish, then by force);
        idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn in self.connections:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        self.workers.stop(grace_s)

    # -- messages ---------------------------------------------------------------------------
    def _send(self, message: tuple, ranks: range | None = None) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank in ranks if ranks is not None else range(len(self.connections)):
            try:
                self.connections[rank].send_bytes(payload)
            except OSError as exc:
                self._fail(f"rank {rank} is gone ({exc})")

    def _answer(self, method: str, args: tuple) -> None:
        """Answer the reporting rank's grammar question to every sampling rank."""
        def allocate(rows: int, width: int) -> np.ndarray:
            return np.empty((rows, width), dtype=np.int32)

        grammars = self._grammars
        if method == "bitmask":
            answer = np.ascontiguousarray(grammars.bitmask(*args, allocate))
        elif method == "check":
            request_ids, token_ids, ranked = args
            answer = grammars.check(request_ids, token_ids, allocate,
                                    None if ranked is None else lambda: ranked)
        elif method == "masks_ahead":
            answer = np.ascontiguousarray(grammars.masks_ahead(*args, allocate))
        elif method == "sampled":
            answer = grammars.sampled(*args)
        else:
            self._fail(f"rank {self.reporter} asked the grammars {method!r}")
        self._send(("result", answer), self._sampling)

    def _wait_ready(self) -> dict:
        """The reporting rank's start-up report, once every rank has sent its own."""
        infos: dict[int, dict] = {}
        while len(infos) < len(self.connections):
            for ready in wait([*self.connections, *self.workers.sentinels]):
                if ready not in self.connections:
                    self._check(ready)
                rank = self.connections.index(ready)
                message = self._read(rank)
                if message[0] != "ready":
                    self._fail(f"rank {rank} sent {message[0]!r} at start-up")
                infos[rank] = message[1]
        return infos[self.reporter]

    def _next_output(self) -> ModelRunnerOutput:
        if not self._outputs:
            if not self._pipelined:
                # A launched step's output comes before its "launched" answer unless the
                # ranks keep it in flight until the next step: ask for it now.
                self._send(("flush",))
            self._receive(self.reporter, "output")
        return self._outputs.popleft()

    def _receive(self, rank: int, *tags: str) -> tuple:
        """The next message from ``rank`` whose tag is one of ``tags`` (the step outputs
        that come first are kept for ``_next_output``, the grammar questions answered),
        watching every rank for failures meanwhile."""
        conn = self.connections[rank]
        while True:
            for ready in wait([*self.connections, *self.workers.sentinels]):
                if ready is not conn:
                    self._check(ready)
            if not conn.poll():
                continue
            message = self._read(rank)
            if message[0] == "output":
                self._outputs.append(message[1])
                if "output" in tags:
                    return message
                continue
            if message[0] == "call":
                self._answer(message[1], message[2])
                continue
            if message[0] in tags:
                return message
            self._fail(f"rank {rank} sent {message[0]!r} where the engine "
                       f"expected {' or '.join(tags)}")

    def _check(self, ready) -> None:
        """A connection or process sentinel other than the one waited on is ready: a
        rank's error report, its end, or its process's exit."""
        if ready in self.connections:
            rank = self.connections.index(ready)
            if rank == self.reporter:
                return  # read by the caller
            self._read(rank)
            self._fail(f"rank {rank} sent a message out of turn")
        rank = self.workers.sentinels.index(ready)
        if self.connections[rank].poll():
            self._read(rank)  # its last words: an error report, or the end of the pipe
        self._fail(f"rank {rank} exited ({self.workers.describe_exit(rank)})")

    def _read(self, rank: int) -> tuple:
        try:
            message = self.connections[rank].recv()
        except (EOFError, OSError):
            self._fail(f"rank {rank} died "
                       f"({self.workers.describe_exit(rank)})")
        if message[0] == "error":
            _, kind, text = message
            if kind == "ValueError":
                self.shutdown(grace_s=0.0)  # the others wait for it in vain
                raise ValueError(text)
            self._fail(f"rank {rank} failed: {kind}: {text}")
        return message

    def _fail(self, reason: str) -> None:
        self.shutdown(grace_s=0.0)
        raise WorkerError(f"The engine stops: {reason}.")


class LocalWorkers:
    """One spawned process per rank on this host (``--distributed-executor-backend
    mp``), rank r on CUDA device r (of those visible), connected by pipes."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.distributed.worker import run_worker

        context = multiprocessing.get_context("spawn")
        size = config.parallel_config.world_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.processes: list[multiprocessing.Process] = []
        self.connections: list[Connection] = []
        for rank in range(size):
            ours, theirs = context.Pipe(duplex=True)
            process = context.Process(
                target=run_worker, name=f"pagedllm-tp-rank-{rank}", daemon=True,
                args=(theirs, rank, size, init_method, config,
                      rank if config.device == "cuda" else None))
            process.start()
            theirs.close()
            self.processes.append(process)
            self.connections.append(ours)
        self.sentinels = [process.sentinel for process in self.processes]

    def describe_exit(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(1.0)
        code = process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def stop(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` seconds in all for the ranks to exit, then kill the rest."""
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(1.0)
