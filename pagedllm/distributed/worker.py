"""One rank: a process (or Ray actor) that runs a ``ModelRunner`` on its part of the
model (its tensor-parallel share of its pipeline stage's layers), driven by the engine
core's messages.

Every rank runs every step the same way: the same plan, the same inputs, the same whole
logits (gathered over the vocabulary) on the last stage, the same sampler with the same
seeded generators and the same global seed. So the last stage's ranks sample the same
tokens, and the earlier stages receive them from it (``parallel_state.recv_sampled_ids``);
every rank keeps the same request state. The first rank of the last stage reports (the
"reporting rank"); the last stage's ranks are the "sampling ranks".

Messages, pickled, over one duplex connection per rank (``multiprocessing.connection``:
a pipe for local processes, a socket for Ray actors). Engine -> rank:

* ``("kv",)``: size (the minimum over the ranks) and allocate the KV cache (and the
  host blocks of ``--swap-space``); the reporting rank answers ``("kv", num_blocks,
  num_host_blocks)``;
* ``("step", SchedulerOutput)``: launch the step; the reporting rank answers each step
  that computed tokens with ``("output", ModelRunnerOutput)`` once its sampled ids are
  read, in launch order (a rank keeps as many steps in flight as the engine does:
  ``steps_in_flight``, and none after a speculative step), and, without pipeline stages,
  ``("launched",)`` once it has launched the step and sent the older steps' outputs
  (with stages the engine does not wait: the next step goes to the first stage while the
  last one still works);
* ``("flush",)``: send the outputs of the steps kept in flight now (the engine reads a
  step before launching the next one: it is about to speculate);
* ``("result", value)`` (sampling ranks): the engine's answer to the grammar question the
  reporting rank asked;
* ``("stop",)``.

Rank -> engine: ``("ready", info)`` from each rank at start; the reporting rank's answers
above, and ``("call", method, args)`` when its runner asks the step's grammars
(structured outputs: ``bitmask``, ``check``, ``masks_ahead`` or ``sampled``, see
``pagedllm.structured.manager``; before ``bitmask`` it sends the outputs of older steps,
which the engine's grammars take first). A
rank waiting for an answer keeps the steps that arrive meanwhile for later (``Inbox``);
``("error", kind, text)`` from any rank that fails. A connection that closes is a rank
that died.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections import deque
from multiprocessing.connection import Connection

import numpy as np

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import SchedulerOutput

logger = logging.getLogger(__name__)


def reporting_rank(config: EngineConfig) -> int:
    """The rank whose outputs the engine reads: the first of the last pipeline stage."""
    parallel = config.parallel_config
    return parallel.world_size - parallel.tensor_parallel_size


def steps_in_flight(config: EngineConfig) -> int:
    """Steps the engine keeps launched before it reads the oldest one's output: the
    pipeline's stages (each stage works on another step), else 1 with asynchronous
    scheduling, else 0."""
    parallel = config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        return parallel.pipeline_parallel_size
    return 1 if config.scheduler_config.async_scheduling else 0


class Inbox:
    """The engine's messages to a rank, in order; ``result`` takes the next answer to a
    grammar question and keeps the messages before it (later steps) for ``next``."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._kept: deque[tuple] = deque()

    def next(self) -> tuple:
        return self._kept.popleft() if self._kept else self._conn.recv()

    def result(self):
        while True:
            message = self._conn.recv()
            if message[0] == "result":
                return message[1]
            self._kept.append(message)


class _GrammarProxy:
    """The runner's view of a step's grammars on a rank: the reporting rank forwards each
    question to the engine, and every sampling rank takes the engine's answer."""

    def __init__(self, conn: Connection, inbox: Inbox, asks: bool, flush,
                 defers_masks: bool = False) -> None:
        self._conn, self._inbox, self._asks, self._flush = conn, inbox, asks, flush
        self.defers_masks = defers_masks  # as the engine's StepGrammars

    def _ask(self, method: str, *args):
        if self._asks:
            if method == "bitmask":
                self._flush()  # the engine's grammars take the older steps' tokens first
            self._conn.send(("call", method, args))
        return self._inbox.result()

    @staticmethod
    def _copy(array: np.ndarray | None, allocate):
        if array is None:
            return None
        out = allocate(*array.shape)
        out[...] = array
        return out

    def bitmask(self, request_ids: list[str], allocate):
        return self._copy(self._ask("bitmask", request_ids), allocate)

    __call__ = bitmask

    def check(self, request_ids: list[str], token_ids: list[int], allocate, candidates=None):
        ranked = None if candidates is None else candidates()  # the engine's process checks
        refused, bitmask, substituted = self._ask("check", request_ids, token_ids, ranked)
        return refused, self._copy(bitmask, allocate), substituted

    def masks_ahead(self, request_ids: list[str], allocate):
        return self._copy(self._ask("masks_ahead", request_ids), allocate)

    def sampled(self, request_ids: list[str], token_ids: list[int], allocate=None) -> None:
        self._ask("sampled", request_ids, token_ids)  # filled in the engine's own arrays


def run_worker(conn: Connection, rank: int, world_size: int, init_method: str,
               config: EngineConfig, device_index: int | None) -> None:
    """The rank's whole life: join the group, build the runner, serve messages until
    ``("stop",)`` or the engine's end of the connection closes. A failure is reported as
    ``("error", kind, text)`` before the process ends."""
    try:
        _serve(conn, rank, world_size, init_method, config, device_index)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the engine is gone
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the engine
        logger.error("Tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        try:
            conn.send(("error", type(exc).__name__, str(exc) or type(exc).__name__))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        from pagedllm.distributed.parallel_state import destroy_distributed

        destroy_distributed()


def _serve(conn: Connection, rank: int, world_size: int, init_method: str,
           config: EngineConfig, device_index: int | None) -> None:
    import torch

    from pagedllm.distributed.parallel_state import init_distributed
    from pagedllm.structured.manager import masks_ahead_wanted
    from pagedllm.worker.model_runner import ModelRunner

    if config.device == "cuda":
        torch.cuda.set_device(device_index or 0)
    else:  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_distributed(rank, world_size, config.parallel_config.tensor_parallel_size,
                     init_method, config.device)
    runner = ModelRunner(config)
    conn.send(("ready", {"dtype": runner.dtype, "kv_cache_dtype": runner.kv_cache_dtype}))
    reports = rank == reporting_rank(config)
    # The last pipeline stage reads each step's ids as soon as it has launched it (the
    # engine waits for them to plan the step's requests again); the others keep as many
    # steps in flight as the engine.
    last_stage = rank >= reporting_rank(config)
    depth = steps_in_flight(config)
    keep = 0 if last_stage and config.parallel_config.pipeline_parallel_size > 1 else depth
    unresolved: deque = deque()  # launched steps that computed tokens, oldest first

    def resolve(keep: int) -> None:
        while len(unresolved) > keep:
            output = unresolved.popleft().get()
            if reports:
                conn.send(("output", output))

    inbox = Inbox(conn)
    grammars = _GrammarProxy(conn, inbox, reports, lambda: resolve(0),
                             masks_ahead_wanted(config))
    acknowledges = reports and config.parallel_config.pipeline_parallel_size == 1
    while True:
        message = inbox.next()
        tag = message[0]
        if tag == "stop":
            return
        if tag == "kv":
            num_blocks = runner.initialize_kv_cache()
            if reports:
                conn.send(("kv", num_blocks, runner.num_host_blocks))
        elif tag == "step":
            so: SchedulerOutput = message[1]
            launched = runner.execute_model_async(so, grammars)
            if not so.is_empty:
                unresolved.append(launched)
            # The engine reads a speculative step's output before it plans the next one.
            resolve(0 if so.is_empty or so.speculative else keep)
            if acknowledges:
                conn.send(("launched",))
        elif tag == "flush":
            resolve(0)
        else:
            raise RuntimeError(f"Unknown message {tag!r} from the engine.")
