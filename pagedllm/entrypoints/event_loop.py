"""The event loop the server and ``pagedllm bench serve`` run on: uvloop where installed
(``uvicorn[standard]`` brings it; its loop is written in C and costs about a tenth less CPU
per request on the server), else asyncio's own."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop ``run`` uses in this environment."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coroutine)`` on uvloop's loop where it is installed."""
    if loop_name() == "asyncio":
        return asyncio.run(coroutine)
    import uvloop

    if sys.version_info < (3, 11):  # no asyncio.Runner
        uvloop.install()
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)
