"""The asyncio engine behind the server: the ``LLMEngine`` flow with the core in its own process.

In the API process: prompts are validated and turned into core ``Request``s (the
``InputProcessor``), sent to the core process, and the core's per-step outputs are
detokenized (the ``OutputProcessor``) and routed to one ``RequestStream`` per request.

    stream = engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    try:
        async for output in stream:   # RequestOutput deltas (new text and tokens)
            ...
    finally:
        stream.close()                # aborts the request if it has not finished

Invariants:
- ``add_request`` validates synchronously: a bad request raises ``ValueError`` before the
  core sees anything, so it never disturbs other requests.
- A request that is closed or aborted before it finishes is aborted in the core at once
  (its KV blocks are freed before the next step).
- If the core process dies, every open stream raises ``EngineDeadError`` and ``on_dead``
  is called; no request hangs.
- With ``max_num_waiting``, ``add_request`` raises ``EngineOverloadedError`` while that many
  core requests wait (submitted, not running: the core's last running count against the
  sequences still unfinished here), so the queue, and the memory it holds, stays bounded.
- With ``request_timeout_s``, a request still unfinished that long after its arrival is
  aborted (its blocks freed) and its stream raises ``RequestTimeoutError``.
- Once a request finishes or is aborted, nothing of it stays here (``num_tracked_requests``
  is 0 when no request is open).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import (
    CoreHandle, EngineCoreClient, EngineDeadError, EngineStartupError,
)
from pagedllm.engine.core_process import CoreInfo
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import InputProcessor, PromptType
from pagedllm.engine.tokenizer import Tokenizer
from pagedllm.metrics import ServerMetrics
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "RequestStream", "EngineDeadError", "EngineOverloadedError",
           "EngineStartupError", "RequestTimeoutError"]

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (``max_num_waiting``); the request was not accepted."""


class RequestTimeoutError(RuntimeError):
    """The request ran past ``request_timeout_s`` and was aborted."""


@dataclass
class _RequestTiming:
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    tokens_per_sequence: list[int] = field(default_factory=list)
    finished_sequences: set[int] = field(default_factory=set)


class RequestStream:
    """The outputs of one request, as an async iterator of ``RequestOutput`` deltas.

    Deltas that pile up while the consumer is busy are merged into one, so a slow client
    gets fewer, larger chunks and never a growing backlog of small ones. With ``interval``
    N > 1 the consumer is woken for the first delta at once and then only once N new tokens
    (all choices together) have come, the request has finished, or an error is queued: a
    streamed response sends a chunk every N tokens instead of every token.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str, n: int, interval: int = 1) -> None:
        self.request_id = request_id
        self.n = n
        self._engine = engine
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._waiter: asyncio.Future | None = None  # set while the consumer waits
        self._interval = interval
        self._pending_tokens = 0  # in the queued deltas
        self._started = False  # a delta was taken
        self.finished = False

    def _due(self) -> bool:
        """Whether the consumer takes what is queued now (see the class docstring)."""
        if not self._items:
            return False
        if self._interval == 1 or not self._started or self._pending_tokens >= self._interval:
            return True
        last = self._items[-1]
        return isinstance(last, BaseException) or last.finished

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        if self._interval > 1 and not isinstance(item, BaseException):
            self._pending_tokens += sum(len(c.token_ids) for c in item.outputs)
        if self._waiter is not None and self._due():
            waiter, self._waiter = self._waiter, None
            if not waiter.done():
                waiter.set_result(None)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._due():
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item = self._items.popleft()
        while (not isinstance(item, BaseException) and not item.finished and self._items
               and not isinstance(self._items[0], BaseException)):  # an error: the next call
            item = _merge_deltas(item, self._items.popleft())
        self._pending_tokens = 0  # what is left is an error, or nothing
        self._started = True
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request if it has not finished; idempotent."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Use ``await AsyncEngine.start(config)``; ``await shutdown()`` when done."""

    def __init__(self, config: EngineConfig, client: EngineCoreClient, tokenizer: Tokenizer | None,
                 metrics: ServerMetrics | None = None, max_num_waiting: int | None = None,
                 request_timeout_s: float | None = None, stream_interval: int = 1) -> None:
        """``max_num_waiting``: core requests that may wait at once (None: unbounded);
        ``request_timeout_s``: seconds from arrival a request may take (None: no limit);
        ``stream_interval``: new tokens a stream gathers before its consumer wakes, after
        the first (``RequestStream``)."""
        self.config = config
        self.max_num_waiting = max_num_waiting
        self.request_timeout_s = request_timeout_s
        self.stream_interval = stream_interval
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(config.model_config, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        self.metrics = metrics
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self.dead_error: EngineDeadError | None = None
        self._client = client
        self._streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _RequestTiming] = {}
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self._num_running = 0  # core requests running, as of the core's last step
        if metrics is not None:
            metrics.tracked_requests = self.num_tracked_requests
        self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    @classmethod
    async def start(cls, config: EngineConfig, metrics: ServerMetrics | None = None,
                    log_level: str = "INFO", num_api_servers: int = 1,
                    **limits) -> "AsyncEngine":
        """Load the tokenizer, start the core process and wait until it is ready (with room
        for ``num_api_servers`` API processes: the others ``attach``).

        With ``skip_tokenizer_init`` (token-id mode) no tokenizer is loaded: ``tokenizer`` is
        None, prompts must be token ids and outputs carry empty text. Raises
        ``EngineStartupError`` (or ``ValueError`` for a bad tokenizer) with a message that
        says what to change.
        """
        tokenizer = _load_tokenizer(config)
        client = await EngineCoreClient.start(config, log_level=log_level,
                                              num_api_servers=num_api_servers)
        return cls(config, client, tokenizer, metrics, **limits)

    @classmethod
    async def attach(cls, config: EngineConfig, handle: CoreHandle,
                     metrics: ServerMetrics | None = None, **limits) -> "AsyncEngine":
        """This API process's engine over a core another process started (``start``)."""
        return cls(config, EngineCoreClient.attach(handle), _load_tokenizer(config), metrics,
                   **limits)

    def core_handle(self, index: int) -> CoreHandle:
        """What API process ``index`` passes to ``attach``."""
        return self._client.handle(index)

    @property
    def info(self) -> CoreInfo:
        return self._client.info

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None

    @property
    def num_waiting(self) -> int:
        """This process's core requests submitted and not running (queued, preempted, or not
        yet seen by the core)."""
        return max(0, self.output_processor.num_unfinished_sequences() - self._num_running)

    def num_tracked_requests(self) -> int:
        """Requests with any state in this process (stream, detokenizer, timing, deadline)."""
        return len(set(self._streams) | set(self._timings) | set(self._deadlines)
                   | self.output_processor.request_ids())

    # -- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Validate and submit a request; raises ``ValueError`` (user error),
        ``EngineOverloadedError`` or ``EngineDeadError``."""
        if self.dead_error is not None:
            raise self.dead_error
        if self.max_num_waiting is not None and self.num_waiting >= self.max_num_waiting:
            if self.metrics is not None:
                self.metrics.on_rejected()
            raise EngineOverloadedError(
                f"The server is overloaded: {self.num_waiting} requests are waiting, the most "
                f"it queues (--max-num-waiting {self.max_num_waiting}). Retry later.")
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        processed, requests = self.input_processor.process(
            request_id, prompt, params, arrival_time=arrival_time, priority=priority)
        self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids, params,
            output_kind="delta", arrival_time=arrival_time,
        )
        stream = RequestStream(self, request_id, params.n, self.stream_interval)
        self._streams[request_id] = stream
        self._timings[request_id] = _RequestTiming(
            arrival_time, len(processed.prompt_token_ids), tokens_per_sequence=[0] * params.n,
        )
        if self.request_timeout_s is not None:
            delay = max(0.0, arrival_time + self.request_timeout_s - time.monotonic())
            self._deadlines[request_id] = asyncio.get_running_loop().call_later(
                delay, self._expire, request_id)
        try:
            self._client.add_requests(requests)
        except Exception as exc:
            self._forget(request_id)
            raise EngineDeadError(f"Could not send the request to the engine core: {exc}") from exc
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate; leaving the loop early aborts the request."""
        stream = self.add_request(request_id, prompt, params, priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Stop a request: the core frees its blocks before its next step. Idempotent."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.finished = True
        timing = self._timings.get(request_id)
        core_ids = self._forget(request_id)
        if timing is not None and self.metrics is not None:
            for index in range(len(timing.tokens_per_sequence)):
                if index not in timing.finished_sequences:
                    self.metrics.on_sequence_finished("abort")
        if core_ids and self.dead_error is None:
            try:
                self._client.abort_requests(core_ids)
            except Exception:  # the core is going away; nothing left to free
                logger.debug("Could not send an abort for %s", request_id, exc_info=True)

    def _expire(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        self.abort(request_id)
        stream.finished = False  # the consumer still reads the error
        stream._put(RequestTimeoutError(
            f"The request ran longer than the server's limit of {self.request_timeout_s:g} "
            "seconds (--request-timeout) and was aborted."))

    def _drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._timings.pop(request_id, None)
        deadline = self._deadlines.pop(request_id, None)
        if deadline is not None:
            deadline.cancel()

    def _forget(self, request_id: str) -> list[str]:
        self._drop(request_id)
        return self.output_processor.abort_request(request_id)

    # -- outputs ------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                result = await self._client.get_output()
                outputs, to_abort = self.output_processor.process_outputs(result.outputs)
                if to_abort:
                    self._client.abort_requests(to_abort)
                now = time.monotonic()
                new_tokens = 0
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is None:
                        continue
                    new_tokens += self._record(output, now)
                    stream._put(output)
                    if output.finished:
                        self._drop(output.request_id)
                if new_tokens and self.metrics is not None:
                    self.metrics.on_new_tokens(new_tokens)
                self._num_running = result.num_running
                if self.metrics is not None:
                    self.metrics.on_step(result.stats, result.queue_times)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            self._fail_all(exc)
        except Exception as exc:  # a bug here must not leave requests hanging
            logger.exception("The output loop failed")
            self._fail_all(EngineDeadError(f"The engine's output loop failed: {exc!r}"))

    def _record(self, output: RequestOutput, now: float) -> int:
        """Update the request's timing and metrics; returns its new tokens (the caller
        counts them once per step)."""
        timing = self._timings.get(output.request_id)
        if timing is None or self.metrics is None:
            return 0
        new_tokens = 0
        for completion in output.outputs:
            new_tokens += len(completion.token_ids)
            timing.tokens_per_sequence[completion.index] += len(completion.token_ids)
            if completion.finish_reason is not None and completion.index not in timing.finished_sequences:
                timing.finished_sequences.add(completion.index)
                self.metrics.on_sequence_finished(completion.finish_reason)
        if new_tokens and timing.first_token_time is None:
            timing.first_token_time = now
            self.metrics.on_first_token(timing.num_prompt_tokens, now - timing.arrival_time)
        if output.finished:
            longest = max(timing.tokens_per_sequence)
            tpot = None
            if timing.first_token_time is not None and longest > 1:
                tpot = (now - timing.first_token_time) / (longest - 1)
            self.metrics.on_request_finished(now - timing.arrival_time, tpot)
        return new_tokens

    def _fail_all(self, error: EngineDeadError) -> None:
        logger.error("%s", error)
        self.dead_error = error
        for stream in list(self._streams.values()):
            stream._put(error)
        for request_id in list(self._streams) + list(self._deadlines):
            self._drop(request_id)
        if self.on_dead is not None:
            self.on_dead(error)

    # -- shutdown -----------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Abort what is still running, stop the core process and release its resources."""
        for request_id in list(self._streams):
            stream = self._streams.get(request_id)
            self.abort(request_id)
            if stream is not None:
                stream._put(EngineDeadError("The server is shutting down."))
        self._output_task.cancel()
        try:
            await self._output_task
        except asyncio.CancelledError:
            pass
        await self._client.shutdown()


def _load_tokenizer(config: EngineConfig) -> Tokenizer | None:
    """The model's tokenizer; None in token-id mode (``skip_tokenizer_init``)."""
    model_config = config.model_config
    if model_config.skip_tokenizer_init:
        return None
    return Tokenizer.from_pretrained(model_config.tokenizer_path, revision=model_config.revision)


def _merge_deltas(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """One delta holding ``first`` then ``second`` (same request)."""
    by_index: dict[int, CompletionOutput] = {c.index: c for c in first.outputs}
    for new in second.outputs:
        old = by_index.get(new.index)
        if old is None:
            by_index[new.index] = new
            continue
        by_index[new.index] = CompletionOutput(
            index=new.index,
            text=old.text + new.text,
            token_ids=old.token_ids + new.token_ids,
            cumulative_logprob=new.cumulative_logprob,
            logprobs=None if old.logprobs is None and new.logprobs is None
            else (old.logprobs or []) + (new.logprobs or []),
            finish_reason=new.finish_reason,
            stop_reason=new.stop_reason,
        )
    prompt_logprobs = first.prompt_logprobs
    if second.prompt_logprobs:
        prompt_logprobs = (prompt_logprobs or []) + second.prompt_logprobs
    return RequestOutput(
        request_id=second.request_id, prompt=second.prompt,
        prompt_token_ids=second.prompt_token_ids, prompt_logprobs=prompt_logprobs,
        outputs=[by_index[i] for i in sorted(by_index)], finished=second.finished,
        num_cached_tokens=max(first.num_cached_tokens, second.num_cached_tokens),
        metrics=second.metrics,
    )
