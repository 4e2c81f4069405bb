"""The faults the soak injects while its load runs: a worker SIGKILL every ``--worker-kill-every``
seconds and one scheduler SIGKILL (``schedule``), each timed until /health and /ready say the
engine is back, and admin controls on live requests (aborts, priority changes, cut-ins, pauses,
prefix-cache resets) and on the whole server (pause + resume) (scripts/soak.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import time

import httpx
from soak_load import Soak


def schedule(args: argparse.Namespace) -> tuple[list[float], float | None]:
    """Seconds into the load of the worker kills (every ``--worker-kill-every`` s from 30 s on, none
    in the last 15 s) and of the scheduler kill (the middle of the gap between worker kills that
    holds half-time, or ``--scheduler-kill-at``; None with ``--no-scheduler-kill``)."""
    duration, every = 60.0 * args.minutes, args.worker_kill_every
    kills: list[float] = []
    while 30.0 + every * len(kills) < duration - 15.0:
        kills.append(30.0 + every * len(kills))
    if not args.scheduler_kill:
        return kills, None
    if args.scheduler_kill_at is not None:
        return kills, float(args.scheduler_kill_at)
    edges = [0.0, *kills, duration]
    for a, b in itertools.pairwise(edges):
        if a <= duration / 2 < b:
            return kills, (a + b) / 2
    return kills, duration / 2


def _secs(value: float | None) -> str:
    return "(never)" if value is None else f"{value:.2f} s"


async def faults_on_schedule(soak: Soak, admin: httpx.AsyncClient) -> None:
    kills, scheduler_at = schedule(soak.args)
    events = sorted([(t, "worker") for t in kills] + ([(scheduler_at, "scheduler")] if scheduler_at else []))
    for at, what in events:
        await asyncio.sleep(max(0.0, at - soak.now()))
        if soak.stopping:
            return
        await (_kill_worker(soak, admin) if what == "worker" else _kill_scheduler(soak, admin))


async def _kill(soak: Soak, role: str) -> int | None:
    for _ in range(100):  # a restart in progress: wait for the process to be there
        pid = soak.server.children().get(role)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            return pid
        await asyncio.sleep(0.1)
    soak.note(f"no {role} process to kill")
    return None


async def _wait_health(soak: Soak, admin: httpx.AsyncClient, route: str, want_ok: bool, timeout: float) -> float | None:
    """Seconds until ``route`` answers 200 (``want_ok``) or anything else (not ``want_ok``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        with contextlib.suppress(httpx.HTTPError):
            if ((await admin.get(soak.url + route, timeout=5)).status_code == 200) == want_ok:
                return time.monotonic() - start
        await asyncio.sleep(0.05)
    return None


async def _busy(soak: Soak, at_least: int = 2, timeout: float = 15.0) -> None:
    """Wait (a little) for a few streams to be mid-flight, so the kill has something to hit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not soak.stopping:
        streaming = [r for r in soak.live.values() if r.stream and r.token_ids.get(0)]
        if len(streaming) >= at_least:
            return
        await asyncio.sleep(0.05)


async def _kill_worker(soak: Soak, admin: httpx.AsyncClient) -> None:
    await _busy(soak)
    live = len(soak.live)
    pid = await _kill(soak, "worker")
    if pid is None:
        return
    soak.worker_kills.append(soak.now())
    soak.faults["worker SIGKILL"] += 1
    noticed = await _wait_health(soak, admin, "/health", False, 10)
    back = await _wait_health(soak, admin, "/health", True, 120)
    soak.note(f"worker pid {pid} SIGKILLed with {live} requests in flight: /health 503 after "
              f"{_secs(noticed)}, 200 again after {_secs(back)} more")


async def _kill_scheduler(soak: Soak, admin: httpx.AsyncClient) -> None:
    await _busy(soak)
    live = len(soak.live)
    pid = await _kill(soak, "scheduler")
    if pid is None:
        return
    soak.scheduler_kill = soak.now()
    soak.faults["scheduler SIGKILL"] += 1
    started = time.monotonic()
    while time.monotonic() - started < 60 and soak.server.children().get("scheduler", pid) == pid:
        await asyncio.sleep(0.05)
    respawned = time.monotonic() - started
    answering = None
    while time.monotonic() - started < 120:
        # A short timeout: a query sent while no scheduler listens waits out the frontend's 5 s.
        with contextlib.suppress(httpx.HTTPError):
            if (await admin.get(f"{soak.url}/admin/stats", timeout=0.5)).status_code == 200 and \
                    (await admin.get(f"{soak.url}/ready")).status_code == 200:
                answering = time.monotonic() - started
                break
        await asyncio.sleep(0.05)
    # Streams of the old scheduler end with their error at the next pong of the new one.
    soak.scheduler_back = soak.now() + 5.0
    soak.note(f"scheduler pid {pid} SIGKILLed with {live} requests in flight: a new one started after "
              f"{respawned:.2f} s, answering /admin/stats after {_secs(answering)}")



async def admin_actions(soak: Soak, admin: httpx.AsyncClient) -> None:
    """Every ``--admin-every`` s, a control on a random live single-choice stream; every
    ``--server-pause-every`` s, the whole server paused for a moment."""
    next_server_pause = soak.args.server_pause_every / 2
    while soak.now() < soak.duration and not soak.stopping:
        await asyncio.sleep(soak.rng.uniform(0.5, 1.5) * soak.args.admin_every)
        if soak.now() >= next_server_pause:
            next_server_pause += soak.args.server_pause_every
            await _server_pause(soak, admin)
            continue
        targets = [r for r in soak.live.values()
                   if r.request_id and r.stream and r.n == 1 and not r.admin_touched and not r.disconnected]
        if not targets:
            continue
        rec = soak.rng.choice(targets)
        rec.admin_touched = True
        action = soak.rng.choice(("abort", "priority", "priority", "cut-in", "pause", "pause", "reset"))
        base = f"{soak.url}/admin/requests/{rec.request_id}"
        with contextlib.suppress(httpx.HTTPError):
            if action == "abort":
                r = await admin.post(f"{base}/abort")
                rec.admin_aborted = r.status_code == 200
            elif action in ("priority", "cut-in"):
                body = {"priority": soak.rng.choice((-2, 0, 3, 9)), "cut_in": action == "cut-in"}
                await admin.post(f"{base}/priority", json=body)
            elif action == "pause":
                r = await admin.post(f"{base}/pause")
                await asyncio.sleep(soak.rng.uniform(0.2, 2.0))
                if r.status_code == 200:
                    await soak.until_answered(admin, f"{base}/resume")
            else:
                await admin.post(f"{soak.url}/admin/prefix-cache/reset")
        soak.faults[{"abort": "admin abort", "priority": "admin priority change", "cut-in": "admin cut-in",
                     "pause": "admin pause+resume (one request)",
                     "reset": "admin prefix-cache reset"}[action]] += 1


async def _server_pause(soak: Soak, admin: httpx.AsyncClient) -> None:
    with contextlib.suppress(httpx.HTTPError):
        await admin.post(f"{soak.url}/admin/pause")
    soak.faults["admin pause+resume (server)"] += 1
    await asyncio.sleep(soak.rng.uniform(0.5, 2.0))
    await soak.until_answered(admin, f"{soak.url}/admin/resume")
