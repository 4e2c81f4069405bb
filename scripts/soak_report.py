"""How the soak's requests ended, and the report: progress lines while the load runs, then what was
sent, how each request ended, the faults by kind, the figures that must be 0, and each process's
RSS at start and end (scripts/soak.py)."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from soak_load import Soak
from soak_requests import Record

# A 503 that means "the engine is restarting" (or loading): the request was refused, not lost.
DEFERRED_CODES = {"engine_down", "not_ready", "overloaded"}


def classify(soak: Soak, rec: Record) -> str:
    """How a request ended: served, disconnected (by us), aborted (by us), rejected (503 while
    the engine restarts), ended by the scheduler crash, hostile-4xx, hostile-wrong,
    unexpected-error or lost."""
    if rec.kind == "hostile":
        if rec.status is not None and 400 <= rec.status < 500:
            return "hostile-4xx"
        if rec.status == 503 and rec.error_code in DEFERRED_CODES:
            return "rejected"
        return "hostile-wrong"
    if rec.disconnected:
        return "disconnected"
    if rec.status is None:
        return "lost"
    if rec.status == 503 and rec.error_code in DEFERRED_CODES:
        return "rejected"
    if rec.errors:
        # Open when the scheduler was killed, or sent before its successor took over: the new
        # scheduler never heard of it (or had no worker yet when it arrived).
        kill = soak.scheduler_kill
        by_crash = kill is not None and rec.started <= (soak.scheduler_back or float("inf")) \
            and (rec.ended or 0) >= kill
        return "scheduler-crash" if by_crash else "unexpected-error"
    if rec.status != 200:
        return "unexpected-error"
    finished = [rec.finishes.get(i) for i in range(rec.n)]
    if not all(finished):
        return "lost"
    reasons = {reason for f in finished if f for reason in f}
    if rec.stream and rec.done_count == 0:
        return "unexpected-error"  # a finish, then the stream broke off before [DONE]
    if "abort" in reasons:
        return "aborted" if rec.admin_aborted else "unexpected-error"
    return "served" if reasons <= {"length", "stop"} else "unexpected-error"


def greedy_verdict(soak: Soak, rec: Record) -> str | None:
    """None when there is nothing to compare; "match"; or what differs."""
    if rec.ref is None:
        return None
    ref = soak.refs[rec.ref]
    outcome = rec.outcome
    got_text, got_ids = rec.text.get(0, ""), rec.token_ids.get(0, [])
    if outcome == "served":
        if got_text != ref.text or (not ref.chat and got_ids != ref.token_ids):
            return f"differs: got {got_ids[:40]}... want {ref.token_ids[:40]}..."
        return "match"
    if outcome in ("disconnected", "aborted", "scheduler-crash"):
        if not ref.text.startswith(got_text) or got_ids != ref.token_ids[: len(got_ids)]:
            return f"cut-short prefix differs: got {got_ids[:40]}... want {ref.token_ids[:40]}..."
        return "prefix-match"
    return None


async def progress(soak: Soak) -> None:
    while not soak.stopping:
        await asyncio.sleep(soak.args.progress_every)
        ended = collections.Counter(classify(soak, r) for r in soak.records if r.ended is not None)
        print(f"[{soak.now():7.1f} s] sent {len(soak.records)}, in flight {len(soak.live)}, "
              f"served {ended['served']}, faults {sum(soak.faults.values())}, "
              f"lost so far {ended['lost']}", flush=True)


def report(soak: Soak, stats: dict[str, Any], memory_start: dict[str, tuple[int, int | None]],
           memory_end: dict[str, tuple[int, int | None]], health: int) -> int:
    for rec in soak.records:
        rec.outcome = classify(soak, rec)
    outcomes = collections.Counter(r.outcome for r in soak.records)
    kinds = collections.Counter(r.kind for r in soak.records)
    ids = collections.Counter(r.request_id for r in soak.records if r.request_id)
    duplicated = [r for r in soak.records if r.after_end or any(len(f) > 1 for f in r.finishes.values())]
    duplicated += [r for r in soak.records if r.request_id and ids[r.request_id] > 1]
    verdicts = [(r, greedy_verdict(soak, r)) for r in soak.records]
    compared = [(r, v) for r, v in verdicts if v is not None]
    differing = [(r, v) for r, v in compared if v not in ("match", "prefix-match")]
    survived = [r for r, v in compared if v == "match" and any(r.started <= k <= (r.ended or 0)
                                                                for k in soak.worker_kills)]
    lost = [r for r in soak.records if r.outcome == "lost"]
    unexpected = [r for r in soak.records if r.outcome == "unexpected-error"]
    hostile_wrong = [r for r in soak.records if r.outcome == "hostile-wrong"]

    print()
    print(f"=== soak: {soak.args.minutes} min of load on {soak.server.url} (server log: {soak.server.log_path})")
    print(f"requests sent:               {len(soak.records)} ({len(soak.records) / soak.args.minutes:.0f}/min: "
          f"{', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})")
    print(f"served (finished normally):  {outcomes['served']}")
    print(f"disconnected by the client:  {outcomes['disconnected']}")
    print(f"aborted by the admin API:    {outcomes['aborted']}")
    print(f"refused with 503 (restart):  {outcomes['rejected']}")
    print(f"ended by the scheduler crash:{outcomes['scheduler-crash']:>6}")
    crash_errors = collections.Counter(
        (r.errors[-1], "open at the kill" if r.started <= (soak.scheduler_kill or 0) else "sent after the kill")
        for r in soak.records if r.outcome == "scheduler-crash")
    for (message, when), count in sorted(crash_errors.items()):
        print(f"  {count:>4} {when}: {message!r}")
    print(f"hostile requests, 4xx:       {outcomes['hostile-4xx']}")
    print("faults injected:")
    for kind, count in sorted(soak.faults.items()):
        print(f"  {kind:<36} {count}")
    print(f"greedy outputs compared:     {sum(1 for _, v in compared if v == 'match')} whole "
          f"({len(survived)} of them lived through a worker kill), "
          f"{sum(1 for _, v in compared if v == 'prefix-match')} cut-short prefixes")
    print("must be 0:")
    figures = {
        "requests lost": len(lost),
        "requests duplicated": len(duplicated),
        "greedy outputs differing from the reference": len(differing),
        "unexpected errors": len(unexpected),
        "hostile requests not answered 4xx": len(hostile_wrong),
        "references differing alone vs batched": len(soak.reference_mismatch),
        "KV blocks used after the traffic": int(stats.get("kv_blocks_used", -1)),
        "requests running after the traffic": int(stats.get("running", -1)),
        "requests waiting after the traffic": int(stats.get("waiting", -1)),
        "requests listed by /admin/requests": int(stats.get("live_requests", -1)),
    }
    for name, value in figures.items():
        print(f"  {name:<46} {value}")
    print(f"/health at the end: {health}; scheduler internal errors: {stats.get('internal_errors')}, "
          f"malformed frames: {stats.get('malformed_frames')}, preemptions: {stats.get('preemptions')}")
    print("memory (RSS):")
    for role in ("frontend", "scheduler", "worker"):
        (pid0, rss0), (pid1, rss1) = memory_start.get(role, (0, None)), memory_end.get(role, (0, None))
        print(f"  {role:<10} start {_mib(rss0)} (pid {pid0})   end {_mib(rss1)} (pid {pid1})")
    for rec in (lost + duplicated + unexpected + hostile_wrong)[:20]:
        print(f"  ! {rec.outcome} {rec.kind} #{rec.seq} id={rec.request_id} status={rec.status} "
              f"t={rec.started:.1f}..{rec.ended} finishes={dict(rec.finishes)} errors={rec.errors[:2]} "
              f"exception={rec.exception}")
    for rec, verdict in differing[:10]:
        print(f"  ! greedy #{rec.seq} id={rec.request_id} ref {rec.ref} t={rec.started:.1f}..{rec.ended}: {verdict}")
    for line in soak.reference_mismatch:
        print(f"  ! {line}")
    failed = any(figures.values()) or health != 200
    print(f"result: {'FAIL' if failed else 'PASS'}")
    return 1 if failed else 0


def _mib(kib: int | None) -> str:
    return "   (gone)" if kib is None else f"{kib / 1024:6.1f} MiB"
