"""Graceful shutdown: the first SIGTERM (or Ctrl-C) drains, the second exits at once.

Draining: admission stops at once (new requests and ``/ready`` answer 503), requests in flight
get up to ``--shutdown-grace`` seconds to finish, and those still running then are aborted, so
every open stream ends with ``finish_reason: "abort"`` and ``[DONE]`` instead of being cut off
mid-way. Only then does uvicorn stop (closing the listener and the connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from frontend.state import AppState

log = logging.getLogger("sluice.frontend")

ABORT_FLUSH_S = 0.5  # after the aborts, time for their final chunks to reach the clients
POLL_S = 0.05


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: AppState, grace_s: float, after_grace_s: float = 2.0,
                 stop_by: list[float] | None = None) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self.after_grace_s = after_grace_s
        # ``stop_by[0]``: the monotonic deadline of the whole stop, set when a signal comes (a
        # list its owner shares: uvicorn re-raises the signal once it stops, so whoever waits for
        # it learns of it by an exception, not a return value).
        self.stop_by = stop_by if stop_by is not None else [float("inf")]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal (or not started yet): stop now
            return
        # Nothing here may raise before the drain is scheduled: a handler that stops half-way
        # leaves a server that answers 503 to everything and holds its port until a second signal.
        self.state.draining = True
        self.stop_by[0] = time.monotonic() + self.grace_s + self.after_grace_s
        self._captured_signals.append(sig)
        self._loop.call_soon_threadsafe(self._start_drain)
        live = self.state.client.num_live
        requests = "1 request in flight gets" if live == 1 else f"{live} requests in flight get"
        say(f"Stopping: {requests} up to {self.grace_s:g} s to finish (press Ctrl-C again to stop at once)…")

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        client = self.state.client
        log.info("shutting down: no new requests; %d in flight get up to %.0f s to finish (a second signal "
                 "stops at once)", client.num_live, self.grace_s)
        await _wait(lambda: client.num_live == 0, self.grace_s)
        if client.num_live:
            log.warning("shutting down: aborting %d requests still running after %.0f s", client.num_live,
                        self.grace_s)
            await client.abort_all()
            await _wait(lambda: client.num_live == 0, ABORT_FLUSH_S)
        self.should_exit = True


def say(line: str) -> None:
    """A line for the person at the terminal, from a signal handler: stdout may be a closed pipe
    (``sluice serve | head -1``) or gone, and a stop must never fail for want of an audience."""
    with contextlib.suppress(OSError, ValueError):  # BrokenPipeError, or stdout closed
        print(line, flush=True)


async def _wait(done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
