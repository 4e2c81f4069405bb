"""Soak (issue 14): mixed streaming load on a fresh ``sluice serve --model tiny`` for N minutes,
with faults injected on a schedule, and a count of everything that must never happen.

    python scripts/soak.py --minutes 10

It starts its own server (127.0.0.1, a free port, an admin token, its own process group; always
stopped at the end, its log kept in a temp dir), computes the greedy reference outputs of a fixed
set of prompts one at a time before any fault, then drives a few hundred requests a minute
(``--rate``, at most ``--max-in-flight`` at once) while it injects:

- a worker SIGKILL every ``--worker-kill-every`` seconds (``sluice serve`` starts it again, and
  the scheduler recomputes the live requests: their streams must simply continue);
- one scheduler SIGKILL (``sluice serve`` starts it again; streams open at that moment end with an
  error chunk, counted as "ended by the scheduler crash", not as lost);
- client disconnects (a stream closed after k chunks), hostile requests (bad JSON, bad fields: a
  4xx is expected), admin aborts, pauses + resumes (of one request and of the whole server),
  priority changes and cut-ins, prefix-cache resets.

It prints what was sent and how each request ended, the faults by kind, the figures that must be
0 — requests lost (neither a finish nor an error), duplicated (two finishes, or tokens after a
finish), greedy outputs differing from the undisturbed reference (every greedy request that ended
normally, worker kill or not; and the tokens a cut-short one got must be a prefix of it),
unexpected errors, hostile requests not answered with a 4xx, KV blocks still used and requests
still running or waiting once the traffic has stopped — and the RSS of each process (frontend =
the serve process, scheduler, worker) at start and end. Exit status 0 when every must-be-0
figure is 0, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

# Its parts, beside it: soak_server (the server under test), soak_requests (what is sent), soak_load
# (the traffic and its records), soak_faults (kills and admin controls), soak_report (the verdicts).
sys.path.insert(0, os.path.dirname(__file__))
from soak_faults import admin_actions, faults_on_schedule, schedule
from soak_load import READ_TIMEOUT_S, Soak
from soak_report import progress, report
from soak_server import AUTH, Server


async def run(args: argparse.Namespace, server: Server) -> int:
    soak = Soak(args, server)
    limits = httpx.Limits(max_connections=args.max_in_flight + 8, max_keepalive_connections=args.max_in_flight)
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client, \
            httpx.AsyncClient(timeout=10.0, headers=AUTH) as admin:
        soak.t0 = time.monotonic()
        await soak.compute_references(client)
        print(f"{len(soak.refs)} greedy references computed in {soak.now():.1f} s", flush=True)
        memory_start = server.memory()
        kills, scheduler_at = schedule(args)
        print(f"load: {args.rate} requests/min, at most {args.max_in_flight} in flight, {args.minutes} min; "
              f"worker SIGKILL at {', '.join(f'{t:.0f}' for t in kills) or 'never'} s, scheduler SIGKILL at "
              f"{'never' if scheduler_at is None else f'{scheduler_at:.0f} s'}", flush=True)
        soak.t0 = time.monotonic()
        background = [asyncio.create_task(faults_on_schedule(soak, admin)),
                      asyncio.create_task(admin_actions(soak, admin)),
                      asyncio.create_task(progress(soak))]
        try:
            await soak.load(client)
        finally:
            soak.stopping = True
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        stats = await soak.settle(admin)
        memory_end = server.memory()
        health = 0
        with contextlib.suppress(httpx.HTTPError):
            health = (await admin.get(f"{server.url}/health")).status_code
    return report(soak, stats, memory_start, memory_end, health)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    p.add_argument("--rate", type=float, default=300.0, help="requests sent per minute (on average)")
    p.add_argument("--max-in-flight", type=int, default=24, help="most requests open at once")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--worker-kill-every", type=float, default=120.0, help="seconds between worker SIGKILLs")
    p.add_argument("--scheduler-kill", action=argparse.BooleanOptionalAction, default=True,
                   help="SIGKILL the scheduler once")
    p.add_argument("--scheduler-kill-at", type=float, default=None, help="seconds into the load (default: mid-run)")
    p.add_argument("--admin-every", type=float, default=3.0, help="mean seconds between admin controls")
    p.add_argument("--server-pause-every", type=float, default=40.0, help="seconds between server pauses")
    p.add_argument("--progress-every", type=float, default=15.0)
    p.add_argument("--max-worker-restarts", type=int, default=None,
                   help="passed to sluice serve (default: the scheduled kills + 5)")
    p.add_argument("--serve-args", default="", help="extra flags for `sluice serve`")
    args = p.parse_args()

    restarts = args.max_worker_restarts
    if restarts is None:
        restarts = len(schedule(args)[0]) + 5
    flags = ["--model", "tiny", "--num-kv-blocks", "2048", "--max-worker-restarts", str(restarts),
             *args.serve_args.split()]
    log_path = Path(tempfile.mkdtemp(prefix="sluice-soak-")) / "server.log"
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))  # a SIGTERM still stops the server
    server = Server(flags, log_path)
    try:
        server.wait_ready()
        print(f"sluice serve {' '.join(flags)} ready at {server.url} (log: {log_path})", flush=True)
        return asyncio.run(run(args, server))
    finally:
        code = server.stop()
        print(f"sluice serve stopped (exit status {code})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
