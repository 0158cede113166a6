"""The API process's end of the engine core: starts the core process and talks to it over ZMQ.

See ``core_process`` for the wire protocol. Sends (requests, aborts) are plain non-blocking
ZMQ sends, so they can be made from any code on the event loop thread, including the
``finally`` of a cancelled request; receives are awaited on the event loop. A send never
fails for want of a peer: the sending socket connects (a connecting socket queues from the
moment it connects, a bound one has no queue until its peer arrives), so a request that
reaches an API process which has just attached waits for the link instead of failing.

The core process is started with the ``spawn`` method (a fresh interpreter: no inherited
threads, locks or CUDA state) and is not a daemon, so it may itself start processes.
It stops when told to, when its parent dies (it polls for that), or, as a last resort,
when ``shutdown`` terminates it.

API process 0 starts the core (``start``, with room for ``num_api_servers`` processes);
the others attach to it (``attach``, from the ``CoreHandle`` process 0 gives them). An
attached client never stops the core: its ``shutdown`` only closes its sockets, and it
learns that the core died from the core's process id.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request
from pagedllm.engine.core_process import (
    ABORT, ADD, ERROR, OUTPUTS, READY, SHUTDOWN, CoreInfo, StepResult, run_engine_core,
)

logger = logging.getLogger(__name__)

# Seconds between liveness checks of the core process while waiting for a message.
_LIVENESS_POLL_S = 1.0


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message says why and what to change."""


class EngineDeadError(RuntimeError):
    """The engine core process failed or exited while the server was running."""


@dataclass(frozen=True)
class CoreHandle:
    """What another API process needs to attach to a running core (picklable)."""

    ipc_dir: str
    index: int  # the attaching process's place among the API processes (1, 2, ...)
    core_pid: int
    info: CoreInfo


def input_address(ipc_dir: str) -> str:
    """The core's one input (it binds; every API process connects)."""
    return f"ipc://{ipc_dir}/input"


def output_address(ipc_dir: str, index: int) -> str:
    """API process ``index``'s output (it binds; the core connects)."""
    return f"ipc://{ipc_dir}/output-{index}"


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


class EngineCoreClient:
    """This API process's two sockets to the core, and the core process itself in process 0.
    Use ``await start(config)`` or ``attach(handle)``."""

    def __init__(self, ipc_dir: str, index: int) -> None:
        self.index = index
        self._ipc_dir = ipc_dir
        self.input_address = input_address(ipc_dir)
        self.output_address = output_address(ipc_dir, index)

        self._sync_context = zmq.Context()
        self._input = self._sync_context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the core drains fast
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.connect(self.input_address)
        self._async_context = zmq.asyncio.Context()
        self._output = self._async_context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self.output_address)

        self.process: multiprocessing.Process | None = None  # process 0 only
        self._core_pid: int | None = None
        self.info: CoreInfo | None = None
        self._closed = False
        self._finalizer: weakref.finalize | None = None

    @classmethod
    async def start(cls, config: EngineConfig, log_level: str = "INFO",
                    num_api_servers: int = 1) -> "EngineCoreClient":
        """Start the core process (with a socket pair for each of ``num_api_servers``
        processes) and wait until it is ready; raises ``EngineStartupError``."""
        ipc_dir = tempfile.mkdtemp(prefix="pagedllm-ipc-")
        os.chmod(ipc_dir, 0o700)
        client = cls(ipc_dir, 0)
        outputs = [output_address(ipc_dir, i) for i in range(num_api_servers)]
        client.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="pagedllm-engine-core",
            args=(config, input_address(ipc_dir), outputs, log_level),
        )
        client._finalizer = weakref.finalize(client, _cleanup, client.process, ipc_dir)
        client.process.start()
        client._core_pid = client.process.pid
        try:
            client.info = await client._wait_ready()
        except BaseException:
            client.close()
            raise
        return client

    @classmethod
    def attach(cls, handle: CoreHandle) -> "EngineCoreClient":
        """This process's client of a core another API process started (it is ready)."""
        client = cls(handle.ipc_dir, handle.index)
        client._core_pid = handle.core_pid
        client.info = handle.info
        return client

    def handle(self, index: int) -> CoreHandle:
        """What API process ``index`` needs to ``attach`` (process 0, once ready)."""
        assert self.info is not None and self._core_pid is not None
        return CoreHandle(self._ipc_dir, index, self._core_pid, self.info)

    def _core_alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self._core_pid is not None and _pid_alive(self._core_pid)

    def _exit_code(self) -> str:
        return "unknown" if self.process is None else str(self.process.exitcode)

    async def _wait_ready(self) -> CoreInfo:
        while True:
            if await self._output.poll(int(_LIVENESS_POLL_S * 1000)):
                tag, payload = pickle.loads(await self._output.recv())
                if tag == READY:
                    return payload
                if tag == ERROR:
                    raise EngineStartupError(payload)
                raise EngineStartupError(f"The engine core sent {tag!r} before it was ready.")
            if not self._core_alive():
                raise EngineStartupError(
                    f"The engine core process exited with code {self.process.exitcode} before it "
                    "was ready (its log above says why; a code of -9 usually means it ran out of "
                    "memory: lower --kv-cache-memory-gb or --max-model-len)."
                )

    # -- to the core --------------------------------------------------------------------
    def add_requests(self, requests: list[Request]) -> None:
        self._send(ADD, (self.index, requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(ABORT, list(request_ids))

    def _send(self, tag: str, payload) -> None:
        if self._closed:
            raise EngineDeadError("The engine core is shut down.")
        self._input.send(pickle.dumps((tag, payload), protocol=pickle.HIGHEST_PROTOCOL),
                         flags=zmq.NOBLOCK)

    # -- from the core ------------------------------------------------------------------
    async def get_output(self) -> StepResult:
        """The next step result; raises ``EngineDeadError`` if the core failed or exited."""
        while True:
            if await self._output.poll(int(_LIVENESS_POLL_S * 1000)):
                tag, payload = pickle.loads(await self._output.recv())
                if tag == OUTPUTS:
                    return payload
                if tag == ERROR:
                    raise EngineDeadError(f"The engine core failed: {payload}")
                raise EngineDeadError(f"Unexpected message {tag!r} from the engine core.")
            if not self._core_alive():
                raise EngineDeadError(
                    f"The engine core process exited unexpectedly (code {self._exit_code()})."
                )

    # -- shutdown -----------------------------------------------------------------------
    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the core to stop, wait for it, and terminate it if it does not (process 0;
        an attached client only closes its sockets)."""
        if self._closed:
            return
        if self.process is not None and self.process.is_alive():
            try:
                self._send(SHUTDOWN, None)
            except zmq.ZMQError:
                pass
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.process.join, timeout_s)
        self.close()

    def close(self) -> None:
        """Release sockets and make sure the core process is gone (blocks up to a few s)."""
        if self._closed:
            return
        self._closed = True
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_context.term()
        self._async_context.term()
        if self._finalizer is not None:
            self._finalizer()


def _cleanup(process: multiprocessing.Process, ipc_dir: str) -> None:
    if process.pid is not None and process.is_alive():
        process.terminate()
        process.join(3.0)
        if process.is_alive():
            process.kill()
            process.join(1.0)
    shutil.rmtree(ipc_dir, ignore_errors=True)
