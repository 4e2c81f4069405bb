"""The load loop: send requests at their arrival times, at most ``max_concurrency`` at once, with
a live progress bar.

Arrivals and the concurrency limit combine as in ``vllm bench serve``: a request becomes due at
its arrival time, then waits for a free slot; its TTFT and latency are timed from when it is
actually sent, so time spent waiting for a slot on the client is not the server's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from client.stream import RequestRecord, stream_request

RATE_WINDOW_S = 2.0  # the live output rate is over this recent window


class TokenMeter:
    """Token chunks received, and their rate over the last RATE_WINDOW_S (for the live bar)."""

    def __init__(self) -> None:
        self.count = 0
        self._marks: deque[tuple[float, int]] = deque()

    def tick(self) -> None:
        self.count += 1

    def rate(self) -> float:
        now = time.perf_counter()
        self._marks.append((now, self.count))
        while len(self._marks) > 1 and now - self._marks[0][0] > RATE_WINDOW_S:
            self._marks.popleft()
        t_old, c_old = self._marks[0]
        return (self.count - c_old) / (now - t_old) if now > t_old else 0.0


@contextlib.contextmanager
def _progress(label: str, total: int, enabled: bool) -> Iterator[Progress | None]:
    if not enabled:
        yield None
        return
    # stderr: the report on stdout stays clean for redirection.
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[rate]:>8.1f} out tok/s"), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=False)
    with progress:
        yield progress


async def run_load(url: str, bodies: list[dict[str, Any]], records: list[RequestRecord],
                   *, t0: float, arrivals: list[float], max_concurrency: int | None, timeout: float | None,
                   headers: dict[str, str] | None = None, label: str = "requests",
                   show_progress: bool = True) -> float:
    """Send ``bodies[i]`` at ``t0 + arrivals[i]`` (perf_counter seconds), filling ``records[i]``;
    return the duration from ``t0`` to the end of the last request."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    meter = TokenMeter()
    with _progress(label, len(bodies), show_progress) as progress:
        bar = progress.add_task(label, total=len(bodies), rate=0.0) if progress else None

        async def one(i: int) -> None:
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots or contextlib.nullcontext():
                await stream_request(url, bodies[i], records[i], t0=t0, timeout=timeout,
                                     headers=headers, on_token=meter.tick)
            if progress is not None and bar is not None:
                progress.update(bar, advance=1, rate=meter.rate())

        async def refresh() -> None:  # the rate moves between completions too
            while progress is not None and bar is not None:
                await asyncio.sleep(0.25)
                progress.update(bar, rate=meter.rate())

        ticker = asyncio.create_task(refresh())
        try:
            await asyncio.gather(*(one(i) for i in range(len(bodies))))
            end = time.perf_counter()
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
    return end - t0
