"""The workers as the scheduler knows them, and the engine state that follows from them.

    STARTING ──every rank ready──▶ SERVING ──a rank lost──▶ OUTAGE ──every rank ready──▶ SERVING
    OUTAGE ──no worker back within --worker-restart-wait──▶ FAILED
    SERVING ──a crash past --max-worker-restarts──▶ FAILED
    STARTING ──a rank fails to load──▶ FAILED

A rank is lost when its process exits (its connection drops: noticed within milliseconds), when
it sends nothing for ``WORKER_TIMEOUT_S``, when a plan in flight makes no progress for longer
than ``PlanClock`` allows (a hang: the heartbeat thread beats on while the main loop is stuck in a
kernel, a collective or a lock), when it reports a failure, or when it says it was told to stop —
the last is not counted as a crash. A hung or silent worker is then killed (``Workers.kill``,
every rank of its group) where it runs on this machine, so it exits as a crashed one does. In an
outage the live requests wait to be recomputed on the next worker that announces itself
(``sluice serve`` restarts it; a container restart policy does the same for separately run
components).

This class decides and logs; the scheduler process applies what a transition means for the
requests (recompute them, or end them with an error).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

import zmq

from protocol.messages import ModelInfo, StepPlan
from protocol.process_identity import process_identity
from protocol.supervision import startup_failure_level

if TYPE_CHECKING:
    from scheduler.request import Request

log = logging.getLogger("sluice.scheduler")

WORKER_TIMEOUT_S = 5.0
ANNOUNCE_INTERVAL_S = 1.0  # how often an unknown worker is asked to announce itself
REFUSED_LOG_INTERVAL_S = 10.0  # a port scan must not flood the log
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Workers:
    def __init__(self, tensor_parallel_size: int, max_worker_restarts: int, restart_wait_s: float = 60.0) -> None:
        self.size = tensor_parallel_size
        self.max_restarts = max_worker_restarts
        self.restart_wait_s = restart_wait_s  # how long live requests wait for a lost worker
        self.ready: dict[int, ModelInfo] = {}
        self.last_seen: dict[int, float] = {}
        self.was_ready = False  # a worker has been ready once: later failures are not start-up failures
        self.failure: str | None = None  # FAILED, and why
        self.outage: str | None = None  # OUTAGE, and why
        self.outage_since = 0.0
        self.crashes = 0
        self._announce_asked = 0.0
        # A connection that never became a ZeroMQ peer (a port scan, a wrong Curve key, plain
        # ZeroMQ against Curve) also ends in DISCONNECTED, right after its HANDSHAKE_FAILED event
        # (both come from the one I/O thread, in order): those are not a worker's.
        self.failed_handshakes = 0  # their DISCONNECTED events still to come
        self.refused_links = 0
        self._refused_logged = -REFUSED_LOG_INTERVAL_S
        self.processes: dict[int, tuple[int, str]] = {}  # rank -> (pid, identity), from its heartbeats

    @property
    def serving(self) -> bool:
        return self.failure is None and self.outage is None and len(self.ready) >= self.size

    def alive(self) -> bool:
        """Every rank ready and heard from lately."""
        if self.failure is not None or len(self.ready) < self.size:
            return False
        now = time.monotonic()
        return all(now - self.last_seen.get(r, 0.0) < WORKER_TIMEOUT_S for r in self.ready)

    def heard(self, rank: int) -> None:
        self.last_seen[rank] = time.monotonic()

    def heard_process(self, rank: int, pid: int, identity: str) -> None:
        if pid:
            self.processes[rank] = (pid, identity)

    def kill(self) -> str:
        """Kill every rank of the group that runs on this machine (SIGKILL: a main thread stuck in
        C never runs a Python signal handler), so that it exits as a crashed one does and is
        restarted (``sluice serve``, or a restart policy), the group whole. A rank is killed only
        if ``/proc`` shows the very process its heartbeats described: same boot, same pid
        namespace, same start time; never a pid that was reused or belongs to another machine or
        container. Returns what was done, for the log."""
        killed, elsewhere = [], []
        for rank in range(self.size):
            pid, identity = self.processes.pop(rank, (0, ""))
            if pid and identity and identity == process_identity(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(f"rank {rank} (pid {pid})")
                    continue
                except OSError:
                    pass
            elsewhere.append(str(rank))
        done = f"killed {', '.join(killed)}" if killed else ""
        if elsewhere:
            done += ("; " if done else "") + (
                f"rank {', '.join(elsewhere)} not running on this machine (or gone): stop it there, or it is "
                "asked to announce itself again if it recovers")
        return done

    def announced(self, rank: int, model: ModelInfo) -> ModelInfo | None:
        """Rank ``rank`` is ready with ``model``; once every rank is, rank 0's model (the engine
        serves from now on: any outage or failure is over), else None."""
        self.heard(rank)
        if model.tensor_parallel_size != self.size:
            # The ranks know their group (their --tensor-parallel-size); the scheduler's flag only
            # says how many to wait for before the first announces itself.
            log.warning("worker %d is one of %d tensor-parallel ranks (--tensor-parallel-size here: %d): waiting for "
                        "%d", rank, model.tensor_parallel_size, self.size, model.tensor_parallel_size)
            self.size = model.tensor_parallel_size
            self.ready = {r: m for r, m in self.ready.items() if r < self.size}
        self.ready[rank] = model
        self.was_ready = True
        if len(self.ready) < self.size:
            return None
        self.failure = self.outage = None
        return self.ready.get(0, model)

    def should_ask_to_announce(self, rank: int) -> bool:
        """A live worker this scheduler does not know (it restarted, or declared the worker
        lost) is asked to announce itself, at most every ``ANNOUNCE_INTERVAL_S``."""
        now = time.monotonic()
        if rank in self.ready or now - self._announce_asked < ANNOUNCE_INTERVAL_S:
            return False
        self._announce_asked = now
        log.info("worker %d is alive but unknown here: asking it to announce itself", rank)
        return True

    def link_event(self, event: int) -> str | None:
        """A monitor event of the worker link; the loss it means, if any."""
        if event & HANDSHAKE_FAILED:
            self.failed_handshakes += 1
            self.refused_links += 1
            now = time.monotonic()
            if now - self._refused_logged >= REFUSED_LOG_INTERVAL_S:
                self._refused_logged = now
                log.warning("refused a connection on the worker port: its handshake failed (%s; %d so far)",
                            zmq.Event(event).name, self.refused_links)
        elif event == zmq.EVENT_DISCONNECTED:
            if self.failed_handshakes:
                self.failed_handshakes -= 1  # the refused connection's own end
            elif self.ready:
                return "the worker's connection dropped (its process exited or was killed)"
        return None

    def lose(self, reason: str, crashed: bool) -> str | None:
        """A ready rank is gone with every KV block it held. Returns None if an outage starts
        (call ``start_outage`` once the requests are set to be recomputed), or the failure to
        declare: one crash more than ``--max-worker-restarts``."""
        if crashed:
            self.crashes += 1
            if self.crashes > self.max_restarts:
                return f"{reason}; lost {self.crashes} times, more than --max-worker-restarts {self.max_restarts}"
        self.ready.clear()
        return None

    def start_outage(self, reason: str, crashed: bool, live: int) -> None:
        self.outage = f"worker lost ({reason}); waiting for it to restart"
        self.outage_since = time.monotonic()
        if crashed:
            log.error("worker lost: %s. %d live requests will be recomputed once a worker is back within %g s "
                      "(loss %d of at most %d)", reason, live, self.restart_wait_s, self.crashes, self.max_restarts)
        else:
            log.log(logging.WARNING if live else logging.INFO, "%s; %d live requests will be recomputed once a "
                    "worker is back (within %.0f s)", reason, live, self.restart_wait_s)

    def silent(self) -> str | None:
        """A rank that sent nothing for ``WORKER_TIMEOUT_S`` (frozen whole, or cut off): the loss,
        if one did."""
        if self.failure is None and self.ready and not self.alive():
            return f"a worker sent nothing for {WORKER_TIMEOUT_S:.0f} s"
        return None

    def outage_expired(self) -> str | None:
        """No worker came back within ``--worker-restart-wait``: the failure to declare, if so."""
        if self.outage is not None and time.monotonic() - self.outage_since > self.restart_wait_s:
            outage, self.outage = self.outage, None
            return f"{outage}; no worker came back within {self.restart_wait_s:g} s (--worker-restart-wait)"
        return None

    def fail(self, reason: str) -> bool:
        """FAILED from now on; False if it already was."""
        if self.failure is not None:
            return False
        # Before any worker was ready this is a start-up failure, which ``sluice serve`` prints.
        log.log(logging.ERROR if self.was_ready else startup_failure_level(), "engine failed: %s", reason)
        self.failure = reason
        self.ready.clear()
        return True


# ------------------------------------------------------------------------------ liveness: progress

HANG_FLOOR_S = 5.0  # no step is called hung sooner than this ...
HANG_FACTOR = 10.0  # ... nor before this many times what it is expected to take
COLD_FLOOR_S = 60.0  # the floor of a worker's first step, and of the first after IDLE_COLD_S without plans
IDLE_COLD_S = 60.0
COLD_UNIT_S = 0.05  # seconds per unit of work before any step was measured: 20 tokens a second
CONTEXT_TOKENS = 1024  # a token's modelled cost grows by its own again every this many tokens of context
FAST, SLOW = 0.5, 0.05  # how far one measurement moves a smoothed time (``PlanClock``)
LAG_S = 1.0  # a gap this long between the scheduler's own checks is not counted against the worker


def step_work(tokens: int, context: int) -> float:
    """A forward step's work, in units of one token without context: each of its ``tokens``
    costs ``1 + c / CONTEXT_TOKENS``, ``c`` being the length its row reaches in the step
    (attention reads every earlier position for each token); ``context`` is the sum of those
    ``c`` over the step's tokens."""
    return tokens + context / CONTEXT_TOKENS


def plan_work(plan: StepPlan, requests: Mapping[int, Request]) -> tuple[float, float]:
    """A plan's first step's ``step_work`` and each later step's (multi-step windows decode one
    token a row): each row's tokens at the context the row reaches (its request's computed
    count, once the plan is made)."""
    tokens = context = rows_context = 0
    for rid, n in zip(plan.rids, plan.num_tokens, strict=True):
        req = requests.get(rid)
        reached = req.num_computed if req is not None and req.num_computed > n else n
        tokens += n
        context += n * reached
        rows_context += reached
    rows = len(plan.rids)
    later = step_work(rows, rows_context + rows * plan.num_steps) if plan.num_steps > 1 else 0.0
    return step_work(tokens, context), later


def _smooth(old: float | None, new: float, up: float, down: float) -> float:
    if old is None:
        return new
    return old + (up if new > old else down) * (new - old)


@dataclasses.dataclass(slots=True)
class _Timed:
    first: float  # the work of a plan's first step (prefill chunks and decodes together)
    later: float  # of each later step of its window (every row decodes one token)


class PlanClock:
    """Times the plans in flight on one engine (its worker, or its tensor-parallel group) and says
    when the running one has hung: liveness that means progress, not a heartbeat thread that beats
    on while the main loop is stuck in a C kernel, a gloo/NCCL wait, a grammar wait or a deadlock.

    The rule: the step running now has hung when for longer than

        limit = max(HANG_FLOOR_S, HANG_FACTOR * expected)          (5 s, 10x)

    nothing showed progress — no ``StepTokens`` of the running plan arrived and no rank's
    heartbeat step count moved — where

        expected = max(step_s, unit_s * work)

    ``work`` is the step's ``step_work`` (its tokens, each weighted by the context it attends to);
    ``unit_s`` is the measured time of one unit of work and ``step_s`` the time of the quickest
    steps (what any step costs, however small: reading the weights once), smoothed over the steps
    before, from each step's ``busy_s`` (the worker's own time, without transport).
    So the limit follows the step: a decode step of milliseconds is hung after 5 s, while a
    prompt of 8k tokens in one step is given ten times what its 8k tokens at up to 8k context
    cost at the measured rate.

    A healthy long prefill must never be called hung (the worker is killed for it), so every
    estimate errs long:

    * Context: a token is charged a whole extra token per 1024 of context it attends to. On
      SmolLM2-135M attention costs what the weights do only near 3k tokens of context (more on
      larger models), so a long prompt is charged more than its share; a decode row at 8k
      context counts 9 units.
    * Steps are measured and predicted in the same units: after 2k chunks (3 units a token) an
      8k prompt in one step is charged 9 units a token, three times the chunks' rate, where
      attention's share makes it cost less than that more. Measured here (2 cores, SmolLM2 with
      ``--max-num-batched-tokens 8192``): after 16 batched streams, a 7.8k prompt's one step
      took 43.5 s and was not called hung.
    * ``unit_s`` believes a slower rate at once (half-way) and a faster one slowly (5% a step).
      ``step_s`` follows the quickest steps (down fast, up slowly): it keeps a decode step of a
      big model (seconds on a CPU) from being predicted by a prefill's per-token rate, without
      a long prefill stretching the limit of the decode steps after it.
    * Before any step was measured: ``COLD_UNIT_S`` per unit, 20 tokens a second, slower than
      any CPU that serves a model usefully. A worker's first step, and the first after a minute
      without plans, may take ``COLD_FLOOR_S``: lazy initialisation that warm-up did not reach,
      memory paged back in.
    * Only the oldest plan is timed: one queued behind it (async scheduling) starts its clock
      when the first ends, as the worker starts it then.
    * A gap in the scheduler's own checks (the scheduler starved of CPU, or stopped) does not
      count against the worker; nor does a hang verdict come before the worker's inbox is read
      (``SchedulerProcess._check_workers``).

    The price: a hang inside a long prefill is found only after ten times its expected time (a
    forward pass reports no progress before it ends), while decode steps, where a stuck engine
    starves every stream at once, are caught within seconds.
    """

    def __init__(self) -> None:
        self.unit_s: float | None = None  # seconds per unit of work, smoothed
        self.step_s: float | None = None  # seconds per step, smoothed
        self.plans: deque[_Timed] = deque()  # in flight, the running one first
        self.work = 0.0  # of the step running now
        self.since = 0.0  # when it started, or last showed progress
        self.cold = True  # it is a worker's first step (or the first after a long idle)
        self.idle_since = time.monotonic()
        self.counts: dict[tuple[int, int], int] = {}  # (rank, pid) -> its heartbeats' step count
        self._checked: float | None = None  # when ``overdue`` last ran

    def new_life(self, now: float) -> None:
        """A worker (group) announced itself: nothing in flight, its first step may be slow. What
        was measured stays: the same engine on the same hardware."""
        self.clear(now)
        self.cold = True
        self.counts.clear()

    def clear(self, now: float) -> None:
        """Nothing in flight any more (the worker was lost, or the engine failed)."""
        self.plans.clear()
        self.idle_since = now

    def sent(self, first: float, later: float, now: float) -> None:
        """A plan went to the worker: ``first`` and ``later`` are its steps' ``step_work``."""
        self.plans.append(_Timed(first, later))
        if len(self.plans) == 1:  # the worker was idle: it starts this one now
            self.cold = self.cold or now - self.idle_since >= IDLE_COLD_S
            self.work, self.since = first, now

    def step_done(self, busy_s: float, last: bool, now: float) -> None:
        """The running plan's step reported its tokens, ``busy_s`` of the worker's time."""
        if not self.plans:
            return
        if busy_s > 0:
            self.step_s = _smooth(self.step_s, busy_s, SLOW, FAST)
            if self.work > 0:
                self.unit_s = _smooth(self.unit_s, busy_s / self.work, FAST, SLOW)
        self.cold = False
        if not last:
            self.work, self.since = self.plans[0].later, now
            return
        self.plans.popleft()
        if self.plans:
            self.work, self.since = self.plans[0].first, now
        else:
            self.idle_since = now

    def heartbeat(self, rank: int, pid: int, steps: int, now: float) -> None:
        """A rank's heartbeat: its main loop's step count moving is progress."""
        key = (rank, pid)
        if self.counts.get(key) != steps:
            self.counts[key] = steps
            self.since = now

    def expected(self) -> float:
        if self.unit_s is None:
            return COLD_UNIT_S * self.work
        return max(self.step_s or 0.0, self.unit_s * self.work)

    def limit(self) -> float:
        return max(COLD_FLOOR_S if self.cold else HANG_FLOOR_S, HANG_FACTOR * self.expected())

    def overdue(self, now: float) -> str | None:
        """The verdict, if the running step has hung: why, for the log and ``/health``."""
        checked, self._checked = self._checked, now
        if checked is not None and now - checked > LAG_S:
            # The scheduler itself did not run meanwhile: no evidence against the worker.
            self.since = self.since + (now - checked) if self.since <= checked else now
        if not self.plans:
            return None
        waited, limit = now - self.since, self.limit()
        if waited <= limit:
            return None
        return (f"no progress for {waited:.1f} s in a step expected to take {self.expected():.2g} s (a worker that "
                f"hangs: the limit is {limit:.0f} s)")
