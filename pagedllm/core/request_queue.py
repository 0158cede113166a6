"""The waiting queue, one small class per scheduling policy. Pure Python.

The scheduler admits from the head (``peek`` / ``pop``) and puts a preempted request back
with ``prepend``. Policies:

- ``fcfs``: arrival order; a preempted request goes to the very front, ahead of requests
  that arrived after it and never ran.
- ``priority``: lower ``priority`` first, then earlier ``arrival_time``, then insertion
  order. A preempted request re-enters at its place in that order, which is ahead of every
  later arrival of equal priority.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterator

from pagedllm.core.request import Request


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        """O(n); used by aborts only."""
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        """O(n); used by aborts only."""
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"Request {request.request_id!r} is not waiting.")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In admission order. O(n log n): for tests and debugging."""
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}.")
