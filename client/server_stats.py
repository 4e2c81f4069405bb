"""Samples of the server's own view during a run: Sluice's ``GET /admin/stats`` every ~0.5 s.

Fields read (``scheduler.Scheduler.stats`` via ``frontend/admin.py``): ``kv_usage`` (fraction of KV
blocks in use), ``running`` and ``waiting`` (queue lengths), ``preemptions`` (a running total).
Other servers have no such route: the first answer that is not this JSON stops the sampling and
says why, and the KV / queue plots are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

INTERVAL_S = 0.5


@dataclass(frozen=True)
class ServerSample:
    t: float  # seconds from the run's start
    kv_usage: float
    running: int
    waiting: int
    preemptions: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class AdminSampler:
    """``start()`` before the run, ``await stop()`` after: ``samples`` then holds one sample at
    the start, one every INTERVAL_S and one at the end; ``note`` says why there are none."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, token: str, t0: float) -> None:
        self.client, self.url, self.t0 = client, f"{base_url}/admin/stats", t0
        self.headers = {"Authorization": f"Bearer {token}"}
        self.samples: list[ServerSample] = []
        self.note: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> bool:
        """One sample; False (with ``note``) when the server has no usable admin stats."""
        try:
            r = await self.client.get(self.url, headers=self.headers, timeout=5.0)
        except httpx.HTTPError as e:  # a slow answer under load is not a verdict: skip this one
            if not self.samples and self.note is None:
                self.note = f"GET /admin/stats failed ({type(e).__name__}); retrying"
            return True
        t = time.perf_counter() - self.t0
        if r.status_code != 200:
            self.note = f"GET /admin/stats answered HTTP {r.status_code} (not Sluice, or a wrong --admin-token)"
            return False
        try:
            data = r.json()
            sample = ServerSample(t, float(data["kv_usage"]), int(data["running"]), int(data["waiting"]),
                                  int(data["preemptions"]) if "preemptions" in data else None)
        except (ValueError, KeyError, TypeError):
            self.note = "GET /admin/stats answered without kv_usage/running/waiting (not Sluice's admin API)"
            return False
        self.samples.append(sample)
        self.note = None
        return True

    async def _loop(self) -> None:
        while await self.sample():
            await asyncio.sleep(INTERVAL_S)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is None:
            return
        if self._task.done():  # it stopped itself: the server has no admin stats
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.sample()  # the state at the end of the run
