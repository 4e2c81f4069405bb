"""The load loop: send requests at their arrival times, at most ``max_concurrency`` at once, with
a live progress bar; a stop (Ctrl-C, ``client.interrupt``) ends it early.

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
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from client.interrupt import first_or_stop
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


@dataclass(frozen=True)
class LoadResult:
    """How a load loop ended. ``duration``: from ``t0`` to the end of the last request, or to the
    stop. A stopped run's unfinished requests are ``in_flight`` (sent, then cancelled: their
    records have no ``done``) or ``not_sent``; its finished ones are those with a ``done``."""

    duration: float
    stopped: bool = False
    in_flight: int = 0
    not_sent: int = 0


def finished(records: list[RequestRecord]) -> list[RequestRecord]:
    """The records of requests that ended, well or not (a stopped run's others did not)."""
    return [r for r in records if r.done is not None]


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
                   show_progress: bool = True, stop: asyncio.Event | None = None) -> LoadResult:
    """Send ``bodies[i]`` at ``t0 + arrivals[i]`` (perf_counter seconds), filling ``records[i]``.
    Once ``stop`` is set nothing more is sent and the requests in flight are cancelled (their
    connections closed: Sluice aborts them and frees their KV blocks)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    meter = TokenMeter()
    sent = [False] * len(bodies)
    with _progress(label, len(bodies), show_progress) as progress:
        bar = progress.add_task(label, total=len(bodies), rate=0.0) if progress else None

        async def one(i: int) -> None:
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots or contextlib.nullcontext():
                sent[i] = True
                await stream_request(url, bodies[i], records[i], t0=t0, timeout=timeout,
                                     headers=headers, on_token=meter.tick)
            if progress is not None and bar is not None:
                progress.update(bar, advance=1, rate=meter.rate())

        async def every() -> None:
            await asyncio.gather(*(one(i) for i in range(len(bodies))))

        async def refresh() -> None:  # the rate moves between completions too
            while progress is not None and bar is not None:
                await asyncio.sleep(0.25)
                progress.update(bar, rate=meter.rate())

        ticker = asyncio.create_task(refresh())
        requests = asyncio.create_task(every())
        try:
            stopped = await first_or_stop(requests, stop)
            end = time.perf_counter()
        finally:
            # Cancelled and awaited, never swallowing a cancellation of this task (a
            # suppress(CancelledError) around the await would).
            ticker.cancel()
            requests.cancel()  # nothing if it is done; else every request not yet finished
            await asyncio.wait({ticker, requests})
        if stopped and progress is not None and bar is not None:
            progress.update(bar, description=f"{label}: stopped by Ctrl-C")
    if not stopped:
        requests.result()  # an exception of the loop itself
        return LoadResult(end - t0)
    unfinished = [i for i, r in enumerate(records) if r.done is None]
    return LoadResult(end - t0, stopped=True, in_flight=sum(1 for i in unfinished if sent[i]),
                      not_sent=sum(1 for i in unfinished if not sent[i]))
