"""One tensor-parallel rank: a process (or Ray actor) that runs a ``ModelRunner`` on its
part of the model, driven by the engine core's messages.

Every rank runs every step the same way: the same plan, the same inputs, the same whole
logits (gathered over the vocabulary), the same sampler with the same seeded generators
and the same global seed. So every rank samples the same tokens and keeps the same
request state, and no sampled id needs to cross between ranks; only rank 0 reports.

Messages, pickled, over one duplex connection per rank (``multiprocessing.connection``:
a pipe for local processes, a socket for Ray actors). Engine -> rank:

* ``("kv",)``: size (the minimum over the ranks) and allocate the KV cache; rank 0
  answers ``("kv", num_blocks)``;
* ``("step", SchedulerOutput)``: launch the step; rank 0 answers each step that computed
  tokens with ``("output", ModelRunnerOutput)`` once its sampled ids are read (in launch
  order; with asynchronous scheduling one step stays in flight, as in ``EngineCore``);
* ``("bitmask", array)``: the constrained rows' token bitmask rank 0 asked for;
* ``("stop",)``.

Rank -> engine: ``("ready", info)`` from each rank at start; rank 0's answers above, plus,
in a step with constrained requests (``ConstrainedRequests``), ``("bitmask", request_ids)``
when the runner asks for their masks (after sending the outputs of older steps, which the
engine reads first) and ``("launched",)`` when the step is launched; ``("error", kind,
text)`` from any rank that fails. A connection that closes is a rank that died.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections import deque
from multiprocessing.connection import Connection

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import SchedulerOutput

logger = logging.getLogger(__name__)


class ConstrainedRequests:
    """The running requests with structured outputs, tracked from the plans alone, so the
    engine and every rank agree on which steps may ask for a bitmask."""

    def __init__(self) -> None:
        self._ids: set[str] = set()

    def update(self, so: SchedulerOutput) -> bool:
        """Take one step's plan; whether it schedules a constrained request."""
        self._ids -= so.finished_req_ids
        self._ids -= so.preempted_req_ids
        self._ids.update(new.request_id for new in so.scheduled_new_reqs
                         if new.sampling_params.structured_outputs is not None)
        return bool(self._ids) and any(r in self._ids for r in so.num_scheduled_tokens)


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
        from pagedllm.distributed.parallel_state import destroy_tensor_parallel

        destroy_tensor_parallel()


def _serve(conn: Connection, rank: int, world_size: int, init_method: str,
           config: EngineConfig, device_index: int | None) -> None:
    import torch

    from pagedllm.distributed.parallel_state import init_tensor_parallel
    from pagedllm.worker.model_runner import ModelRunner

    if config.device == "cuda":
        torch.cuda.set_device(device_index or 0)
    else:  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_tensor_parallel(rank, world_size, init_method, config.device)
    runner = ModelRunner(config)
    conn.send(("ready", {"dtype": runner.dtype, "kv_cache_dtype": runner.kv_cache_dtype}))
    reports = rank == 0
    constrained = ConstrainedRequests()
    unresolved: deque = deque()  # launched steps that computed tokens, oldest first
    async_scheduling = config.scheduler_config.async_scheduling

    def resolve(keep: int) -> None:
        while len(unresolved) > keep:
            output = unresolved.popleft().get()
            if reports:
                conn.send(("output", output))

    def grammar_bitmask(request_ids: list[str], allocate):
        if reports:
            resolve(0)  # the engine reads the older steps' outputs before it fills masks
            conn.send(("bitmask", request_ids))
        tag, bitmask = conn.recv()
        if tag != "bitmask":
            raise RuntimeError(f"Expected the step's bitmask from the engine, got {tag!r}.")
        out = allocate(*bitmask.shape)
        out[...] = bitmask
        return out

    while True:
        message = conn.recv()
        tag = message[0]
        if tag == "stop":
            return
        if tag == "kv":
            num_blocks = runner.initialize_kv_cache()
            if reports:
                conn.send(("kv", num_blocks))
        elif tag == "step":
            so: SchedulerOutput = message[1]
            may_ask = constrained.update(so)
            launched = runner.execute_model_async(so, grammar_bitmask)
            if may_ask and reports:
                conn.send(("launched",))
            if not so.is_empty:
                unresolved.append(launched)
            resolve(1 if async_scheduling and not so.is_empty else 0)
        else:
            raise RuntimeError(f"Unknown message {tag!r} from the engine.")
