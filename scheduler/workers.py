"""The workers as the scheduler knows them, and the engine state that follows from them.

    STARTING ──every rank ready──▶ SERVING ──a rank lost──▶ OUTAGE ──every rank ready──▶ SERVING
    OUTAGE ──no worker back within --worker-restart-wait──▶ FAILED
    SERVING ──a crash past --max-worker-restarts──▶ FAILED
    STARTING ──a rank fails to load──▶ FAILED

A rank is lost when its process exits (its connection drops: noticed within milliseconds), when
it sends nothing for ``WORKER_TIMEOUT_S`` (a hang), when it reports a failure, or when it says it
was told to stop — the last is not counted as a crash. In an outage the live requests wait to be
recomputed on the next worker that announces itself (``sluice serve`` restarts it; a container
restart policy does the same for separately run components).

This class decides and logs; the scheduler process applies what a transition means for the
requests (recompute them, or end them with an error).
"""

from __future__ import annotations

import logging
import time

import zmq

from protocol.messages import ModelInfo
from protocol.supervision import startup_failure_level

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
        """A rank that sent nothing for ``WORKER_TIMEOUT_S`` (hung): the loss, if one did."""
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
