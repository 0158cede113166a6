"""A request's stream of deltas (``RequestStream``): with a stream interval N the consumer
gets the first delta at once, then one merged delta per N new tokens, the finish at once,
and an error at once; with N = 1, every delta as it comes."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.engine.async_engine import RequestStream
from pagedllm.outputs import CompletionOutput, RequestOutput


class _Engine:
    def abort(self, request_id: str) -> None:
        pass


def delta(tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], None, [CompletionOutput(
        0, "", tokens, finish_reason="length" if finished else None)], finished)


async def taken_after_each_put(stream: RequestStream, puts: list) -> list:
    """What the consumer holds after each put (None: still waiting)."""
    taken: list = []
    consumer = asyncio.ensure_future(stream.__anext__())
    for item in puts:
        stream._put(item)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        if consumer.done():
            try:
                taken.append(consumer.result().outputs[0].token_ids)
            except RuntimeError as exc:
                taken.append(str(exc))
            consumer = asyncio.ensure_future(stream.__anext__()) if not stream.finished else None
        else:
            taken.append(None)
    if consumer is not None:
        consumer.cancel()
    return taken


def test_an_interval_gathers_tokens_after_the_first_and_ends_at_once() -> None:
    stream = RequestStream(_Engine(), "r", 1, interval=3)
    puts = [delta([1]), delta([2]), delta([3]), delta([4]), delta([5, 6]), delta([7], True)]
    assert asyncio.run(taken_after_each_put(stream, puts)) == [
        [1], None, None, [2, 3, 4], None, [5, 6, 7]]


def test_an_error_wakes_the_consumer_at_once_after_the_tokens_before_it() -> None:
    stream = RequestStream(_Engine(), "r", 1, interval=4)
    puts = [delta([1]), delta([2]), RuntimeError("engine gone")]
    assert asyncio.run(taken_after_each_put(stream, puts)) == [[1], None, [2]]
    with pytest.raises(RuntimeError, match="engine gone"):
        asyncio.run(stream.__anext__())


def test_interval_one_hands_over_every_delta() -> None:
    stream = RequestStream(_Engine(), "r", 1)
    puts = [delta([1]), delta([]), delta([2]), delta([3], True)]
    assert asyncio.run(taken_after_each_put(stream, puts)) == [[1], [], [2], [3]]
