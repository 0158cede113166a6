"""The API process's end of the engine core: starts the core process and talks to it over ZMQ.

See ``core_process`` for the wire protocol. Sends (requests, aborts) are plain non-blocking
ZMQ sends, so they can be made from any code on the event loop thread, including the
``finally`` of a cancelled request; receives are awaited on the event loop.

The core process is started with the ``spawn`` method (a fresh interpreter: no inherited
threads, locks or CUDA state) and is not a daemon, so it may itself start processes.
It stops when told to, when its parent dies (it polls for that), or, as a last resort,
when ``shutdown`` terminates it.
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


class EngineCoreClient:
    """Owns the core process and the two sockets to it. Use ``await start(config)``."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        self.config = config
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedllm-ipc-")
        os.chmod(self._ipc_dir, 0o700)
        self.input_address = f"ipc://{self._ipc_dir}/input"
        self.output_address = f"ipc://{self._ipc_dir}/output"

        self._sync_context = zmq.Context()
        self._input = self._sync_context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the core drains fast
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(self.input_address)
        self._async_context = zmq.asyncio.Context()
        self._output = self._async_context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self.output_address)

        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=run_engine_core, name="pagedllm-engine-core",
            args=(config, self.input_address, self.output_address, log_level),
        )
        self.info: CoreInfo | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self.process, self._ipc_dir)

    @classmethod
    async def start(cls, config: EngineConfig, log_level: str = "INFO") -> "EngineCoreClient":
        """Start the core process and wait until it is ready; raises ``EngineStartupError``."""
        client = cls(config, log_level)
        client.process.start()
        try:
            client.info = await client._wait_ready()
        except BaseException:
            client.close()
            raise
        return client

    async def _wait_ready(self) -> CoreInfo:
        while True:
            if await self._output.poll(int(_LIVENESS_POLL_S * 1000)):
                tag, payload = pickle.loads(await self._output.recv())
                if tag == READY:
                    return payload
                if tag == ERROR:
                    raise EngineStartupError(payload)
                raise EngineStartupError(f"The engine core sent {tag!r} before it was ready.")
            if not self.process.is_alive():
                raise EngineStartupError(
                    f"The engine core process exited with code {self.process.exitcode} before it "
                    "was ready (its log above says why; a code of -9 usually means it ran out of "
                    "memory: lower --kv-cache-memory-gb or --max-model-len)."
                )

    # -- to the core --------------------------------------------------------------------
    def add_requests(self, requests: list[Request]) -> None:
        self._send(ADD, requests)

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
            if not self.process.is_alive():
                raise EngineDeadError(
                    f"The engine core process exited unexpectedly (code {self.process.exitcode})."
                )

    # -- shutdown -----------------------------------------------------------------------
    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the core to stop, wait for it, and terminate it if it does not."""
        if self._closed:
            return
        if self.process.is_alive():
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
        self._finalizer()


def _cleanup(process: multiprocessing.Process, ipc_dir: str) -> None:
    if process.pid is not None and process.is_alive():
        process.terminate()
        process.join(3.0)
        if process.is_alive():
            process.kill()
            process.join(1.0)
    shutil.rmtree(ipc_dir, ignore_errors=True)
