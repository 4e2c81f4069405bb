"""What the scheduler tells frontends about itself: the pong that answers every ping (health,
readiness and the numbers ``/metrics`` shows), and the admin queries' answers (stats, the live
requests). Built from the process's state, passed in; the process sends them."""

from __future__ import annotations

import time

from protocol.messages import ModelInfo, Pong
from protocol.process_memory import resident_mib
from scheduler.frontends import Frontends
from scheduler.scheduler import Scheduler
from scheduler.workers import Workers

PingStats = dict[str, float | int | bool | None]


class BusyMeter:
    """Worker compute time, for the device-idle ratio: busy seconds over wall seconds since the
    previous reading (1.0 = the device did nothing)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._mark = (time.monotonic(), 0.0)

    def add(self, busy_s: float) -> None:
        self.total_s += busy_s

    def idle_ratio(self) -> float:
        """Since the previous call (the previous ping): each call starts a new interval."""
        now = time.monotonic()
        mark_t, mark_busy = self._mark
        wall = now - mark_t
        idle = 1.0 - min(1.0, (self.total_s - mark_busy) / wall) if wall > 0 else 1.0
        self._mark = (now, self.total_s)
        return idle


def pong(sent_at: float, workers: Workers, model: ModelInfo | None, epoch: int, last_batch: int,
         stats: PingStats | None) -> Pong:
    """``last_batch``: the number of the last token batch sent to the frontend it goes to."""
    ready = model is not None and workers.failure is None
    return Pong(sent_at, workers.alive(), ready, stats, epoch, workers.failure or workers.outage or "", last_batch)


def ping_stats(core: Scheduler | None, counters: dict[str, float | int], busy: BusyMeter) -> PingStats | None:
    """The numbers /metrics shows, with the device-idle ratio since the previous ping (none
    before the workers were first ready: there is no core to count)."""
    if core is None:
        return None
    idle = busy.idle_ratio()
    stats: PingStats = {}
    for key, value in core.stats().items():
        if isinstance(value, (int, float, bool)):
            stats[key] = value
        elif isinstance(value, list):  # per position (speculative decoding's): one number each
            stats.update((f"{key}:{i}", v) for i, v in enumerate(value))
    return stats | counters | {"device_idle_ratio": idle}


def engine_stats(core: Scheduler, counters: dict[str, float | int], workers: Workers, frontends: Frontends,
                 plans_in_flight: list[int], worker_memory: dict[int, dict[str, float]]) -> dict[str, object]:
    """The admin stats: the core's, the process's counters, and every process's memory."""
    memory = {"scheduler": resident_mib()} | {f"worker {rank}": m for rank, m in sorted(worker_memory.items())}
    return core.stats() | counters | {
        "workers_alive": workers.alive(), "frontends": len(frontends),
        "plan_in_flight": plans_in_flight[0] if plans_in_flight else None,
        "process_memory": memory}


def request_summaries(core: Scheduler | None, frontends: Frontends) -> list[dict[str, object]]:
    """Only the asking frontend's requests: another frontend's ids mean nothing to it."""
    return [core.summary(r) for r in core.requests.values() if frontends.owns(r.rid)] if core else []


def request_summary(core: Scheduler | None, rid: int) -> dict[str, object] | None:
    req = core.requests.get(rid) if core is not None else None
    return core.summary(req) if core is not None and req is not None else None
