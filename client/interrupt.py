"""Ctrl-C in ``sluice bench``: the first one stops the run and keeps what finished, a second one
aborts at once.

``ctrl_c_stops`` turns the first SIGINT inside a running event loop into an ``asyncio.Event``
instead of a ``KeyboardInterrupt``: the load loop (``client.runner.run_load``) then sends nothing
more, cancels the requests in flight (closing their connections, so the server frees them) and
returns, and the run reports, saves and plots the requests that finished. The handler puts the
previous one back as it fires, so a second Ctrl-C is ``asyncio.run``'s again: the main task is
cancelled and ``KeyboardInterrupt`` leaves ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Interrupted(Exception):
    """Ctrl-C before anything was measured (model lookup, calibration, warm-up): nothing to report."""


@contextlib.contextmanager
def ctrl_c_stops() -> Iterator[asyncio.Event]:
    """Within (a coroutine of the running loop, in the main thread): the first SIGINT sets the
    event. Where the loop takes no signal handlers (not the main thread, Windows), or SIGINT is
    ignored (a background job of a non-interactive shell), the event is never set and SIGINT does
    what it did before."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        yield stop
        return

    def restore() -> None:
        loop.remove_signal_handler(signal.SIGINT)
        # remove_signal_handler leaves Python's default handler; asyncio.run's (which cancels the
        # main task) was there before.
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)

    def first() -> None:
        stop.set()
        restore()

    try:
        loop.add_signal_handler(signal.SIGINT, first)
    except (NotImplementedError, RuntimeError, ValueError):
        yield stop
        return
    try:
        yield stop
    finally:
        if not stop.is_set():
            restore()


async def first_or_stop(task: asyncio.Future[T], stop: asyncio.Event | None) -> bool:
    """Wait for ``task`` or for ``stop``, whichever comes first; True if it was ``stop`` (the task
    still running, for the caller to cancel)."""
    if stop is None:
        await asyncio.wait({task})
        return False
    stopper = asyncio.ensure_future(stop.wait())
    either: set[asyncio.Future[Any]] = {task, stopper}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        await asyncio.wait({stopper})
    return not task.done()


async def unless_stopped(aw: Awaitable[T], stop: asyncio.Event | None) -> T:
    """``aw``'s result; if ``stop`` is set first, ``aw`` is cancelled and ``Interrupted`` raised."""
    task = asyncio.ensure_future(aw)
    try:
        stopped = await first_or_stop(task, stop)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if stopped:
        raise Interrupted
    return task.result()
