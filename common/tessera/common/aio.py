"""The services' asyncio entry point: `run(main, event_loop)`.

gRPC's aio API spends much of each streamed message in the event loop (futures,
callbacks, the poller's wake-ups). uvloop (libuv underneath) does that part
with less CPU per streamed gRPC message, on both ends of a stream, and on a
machine the engine shares that is CPU the engine gets back. `auto` takes it
when it is installed; `asyncio` is the standard library's loop.
"""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine

EVENT_LOOPS = ["auto", "uvloop", "asyncio"]


def uvloop_module(choice: str):
    """The uvloop module when `choice` asks for it and it is installed; None for the stdlib loop."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)} (got {choice!r})")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("--event-loop uvloop: the uvloop package is not installed") from None
        return None
    return uvloop


def run(main: Coroutine[Any, Any, Any], event_loop: str = "auto") -> Any:
    """asyncio.run(main) on the chosen event loop."""
    uvloop = uvloop_module(event_loop)
    if uvloop is None:
        return asyncio.run(main)
    return uvloop.run(main)


def loop_name() -> str:
    """The running loop's implementation, for the startup log line."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
