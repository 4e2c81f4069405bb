"""The scheduler process: one loop that owns every socket and the scheduling core.

    while running:
        wait for an inbox to be readable (no wait if a plan could be sent now)
        dispatch every waiting message by type
        check worker and frontend liveness (a plan in flight that makes no progress is a hang)
        send the next plan if the worker is free

The scheduler binds all four sockets; frontends and workers connect. Frontends talk over ROUTER
sockets: each request is owned by the frontend that sent it, and its tokens go to that frontend
alone. A frontend silent for ``FRONTEND_TIMEOUT_S`` has its requests aborted (their blocks come
back). A worker heard from but unknown (this scheduler restarted, or lost it) is asked to
announce itself again. Sends never block, so an absent peer can never stall the loop.

No message can take the process down: a handler that raises ends the request the message was
about with an error (logged with its id), a frame that does not decode is logged and dropped, and
a failure inside the scheduling core ends the live requests with an error and starts a clean
core. Each is counted (``internal_errors``, ``malformed_frames`` in the stats and ``/metrics``).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, cast

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.config import SchedulerConfig
from protocol.curve import CurveKeys, start_authenticator
from protocol.messages import (
    AbortRequest,
    AddRequest,
    CancelRows,
    EngineReady,
    Finish,
    FinishReason,
    GrammarReady,
    ModelInfo,
    PauseAll,
    PauseRequest,
    Ping,
    PrepareGrammar,
    QueryReply,
    RequestQuery,
    RequestsQuery,
    ResetPrefixCache,
    ResumeAll,
    ResumeRequest,
    SetPriority,
    Shutdown,
    StatsQuery,
    StepPlan,
    StepTokens,
    TokenBatch,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerReady,
    WorkerStopping,
    new_epoch,
)
from protocol.supervision import supervised
from protocol.transport import Endpoints, make_socket, scheduler_frontend_codec, scheduler_worker_codec
from scheduler.frontends import FRONTEND_TIMEOUT_S, Frontends
from scheduler.outbox import Outbox
from scheduler.reports import BusyMeter, engine_stats, ping_stats, pong, request_summaries, request_summary
from scheduler.scheduler import Scheduler
from scheduler.worker_events import WorkerEvents
from scheduler.workers import HANDSHAKE_FAILED, PlanClock, Workers, plan_work

log = logging.getLogger("sluice.scheduler")

IDLE_POLL_S = 0.1
# pyzmq's constants are enum flags: ``events & zmq.POLLIN`` builds an enum member, 2 us, on a path
# taken once per message. Plain ints test the same bits.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
CHECK_INTERVAL_S = 0.05  # how often silent workers and frontends and a long outage are looked for
MALFORMED_LOG_INTERVAL_S = 10.0


class SchedulerProcess(WorkerEvents):
    """The loop, the sockets and the dispatch of every message. What the workers' coming and going
    means for the requests is ``WorkerEvents`` (scheduler/worker_events.py); the pongs' and the
    admin queries' contents are built in scheduler/reports.py, and batches reach their frontends
    through the ``Outbox``."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        ep = Endpoints.from_base(config.address)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.epoch = new_epoch()  # tells frontends that a scheduler restarted
        # With keys, every socket is a CURVE server and the authenticator admits known clients
        # only; it must run before the first bind.
        curve = CurveKeys.load(config.curve_keys, server=True)
        self.authenticator = start_authenticator(self.ctx, curve) if curve else None
        self.from_frontend = make_socket(self.ctx, zmq.ROUTER, ep.frontend_to_scheduler, bind=True, curve=curve)
        self.to_frontend = make_socket(self.ctx, zmq.ROUTER, ep.scheduler_to_frontend, bind=True, curve=curve)
        self.from_workers = make_socket(self.ctx, zmq.PULL, ep.worker_to_scheduler, bind=True, curve=curve)
        self.to_workers = make_socket(self.ctx, zmq.PUSH, ep.scheduler_to_worker, bind=True, curve=curve)
        # A worker process that dies drops its connection at once: this is how its loss is
        # noticed within milliseconds (heartbeats only catch a worker that hangs).
        self.worker_links = self.to_workers.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        # The loop waits on the inboxes' ZeroMQ file descriptors (epoll on Linux), not ``zmq.Poller``:
        # zmq_poll asks every socket for its events before and after it waits (a getpid and a
        # poll syscall each), about a dozen syscalls per worker step. A socket's descriptor is
        # readable once something may have arrived; its drain reads until ``ZMQ_EVENTS`` says
        # nothing is left, which also re-arms the descriptor. So each wake-up asks only the
        # sockets that woke it. (The descriptor is level-triggered: a message landing between
        # the drain's last check and the wait makes the wait return at once.)
        self.inboxes = selectors.DefaultSelector()
        for sock, drain in ((self.from_workers, self._drain_workers), (self.from_frontend, self._drain_frontends),
                            (self.worker_links, self._on_worker_link_event)):
            fd = cast(int, sock.get(zmq.FD))  # ZMQ_FD is an int
            self.inboxes.register(fd, selectors.EVENT_READ, drain)
        self.frontend_codec = scheduler_frontend_codec()
        self.worker_codec = scheduler_worker_codec()
        self.core: Scheduler | None = None
        self.model: ModelInfo | None = None
        self.workers = Workers(config.tensor_parallel_size, config.max_worker_restarts, config.worker_restart_wait)
        self.worker_memory: dict[int, dict[str, float]] = {}  # rank -> its last heartbeat's figures
        self.frontends = Frontends(self.to_frontend, self.frontend_codec)
        self.outbox = Outbox(self.frontends, self._output_lost)
        self.internal_errors = 0
        self.malformed_frames = 0
        self._malformed_logged = 0.0
        self.plans_in_flight: list[int] = []  # oldest first; a second one is speculative
        self.clock = PlanClock()  # times them: no progress past its limit is a hung worker
        self.cut_short: set[int] = set()  # speculative plans called off
        self.stopping = False
        # A prefix-cache reset waits for the plans in flight to end (their blocks' KV is still
        # being written). Everything else acts at once, in the order it arrived (aborts and
        # pauses also reach the worker: ``_cancel_in_flight``).
        self.reset_cache_pending = False
        self._next_check = 0.0
        self.busy = BusyMeter()  # worker compute time, for the device-idle ratio
        self.handlers: dict[type, Callable[[Any], None]] = {
            AddRequest: self.on_add,
            AbortRequest: self.on_abort,
            Ping: self.on_ping,
            StatsQuery: self.on_stats_query,
            RequestsQuery: self.on_requests_query,
            RequestQuery: self.on_request_query,
            PauseAll: self.on_pause_all,
            ResumeAll: self.on_resume_all,
            PauseRequest: self.on_pause,
            ResumeRequest: self.on_resume,
            SetPriority: self.on_set_priority,
            ResetPrefixCache: self.on_reset_prefix_cache,
            StepTokens: self.on_step_tokens,
            WorkerReady: self.on_worker_ready,
            WorkerHeartbeat: self.on_heartbeat,
            WorkerFailed: self.on_worker_failed,
            WorkerStopping: self.on_worker_stopping,
            GrammarReady: self.on_grammar_ready,
        }

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        log.info("scheduler listening at %s", self.config.address)
        try:
            # Everything that arrived before the loop started (the descriptors may not say so).
            every = [key.data for key in self.inboxes.get_map().values()]
            ready: list[Callable[[], None]] = every
            while not self.stopping:
                for drain in ready:
                    drain()
                now = time.monotonic()
                if now >= self._next_check:  # timeouts are seconds: not worth every wake-up
                    self._next_check = now + CHECK_INTERVAL_S
                    self._check_workers()
                    self._check_frontends()
                if not self.plans_in_flight and self.reset_cache_pending:
                    self._reset_prefix_cache()
                if self._can_send_plan():
                    self._send_plan()
                timeout = 0 if self._can_send_plan() else IDLE_POLL_S
                # A wait that ends with no descriptor readable asks every socket anyway (three
                # ZMQ_EVENTS reads): a message whose signal some other call on its socket took is
                # then read within IDLE_POLL_S, as zmq_poll's own checks would have read it.
                ready = [key.data for key, _ in self.inboxes.select(timeout)] or every
        finally:
            self._close()

    def _drain_frontends(self) -> None:
        self._drain(self.from_frontend, self.frontend_codec, routed=True)

    def _drain(self, sock: zmq.Socket[Any], codec: Any, routed: bool) -> None:
        # Asking the socket beats catching zmq.Again at the end of every drain (an exception
        # built per wake-up, and there is one per worker step).
        while sock.get(_EVENTS) & _POLLIN:  # type: ignore[operator]  # an int for ZMQ_EVENTS
            frames = sock.recv_multipart(copy=False)
            try:
                msg = codec.decode(frames[-1].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._malformed(e)
                continue
            self.frontends.heard_from(frames[0].bytes if routed and len(frames) == 2 else None)
            try:
                self.handlers[type(msg)](msg)
            except Exception:
                self._handler_failed(msg)

    def _malformed(self, e: Exception) -> None:
        self.malformed_frames += 1
        now = time.monotonic()
        if now - self._malformed_logged >= MALFORMED_LOG_INTERVAL_S:
            self._malformed_logged = now
            log.warning("dropped a frame that is not a Sluice message (%s); %d so far", e, self.malformed_frames)

    def _handler_failed(self, msg: object) -> None:
        """A handler raised: a bug. Say so loudly, count it, end the request it was about (the
        client gets an error, never silence) and go on serving everyone else."""
        self.internal_errors += 1
        rid = getattr(msg, "rid", None)
        log.exception("INTERNAL ERROR handling %s%s; the scheduler goes on (%d internal errors so far)",
                      type(msg).__name__, f" for rid {rid}" if rid is not None else "", self.internal_errors)
        if rid is None or self.core is None:
            return
        try:
            self._abort(rid, FinishReason.ERROR, "internal scheduler error (logged); request ended")
        except Exception:
            log.exception("INTERNAL ERROR ending rid %s after a failed handler", rid)

    def _can_send_plan(self) -> bool:
        return self.core is not None and not self.plans_in_flight and self.workers.serving and self.core.has_work

    def _send_plan(self) -> None:
        assert self.core is not None
        try:
            plan = self.core.schedule()
        except Exception:
            self._core_failed()
            return
        if plan is None:
            return
        self.plans_in_flight.append(plan.plan_id)
        self._timed(plan)
        self._to_workers(plan)
        self._send_continuation()

    def _send_continuation(self) -> None:
        """Async scheduling: queue the next decode window behind the one plan in flight, so
        the worker never waits for the scheduler between windows. Anything that must change
        what runs (a waiting prompt, a deferred control) ends the chain: the next plan is then
        made normally, once the worker is done."""
        if (self.core is None or not self.config.async_scheduling or len(self.plans_in_flight) != 1
                or self.reset_cache_pending or self.workers.failure is not None):
            return
        try:
            plan = self.core.continue_plan()
        except Exception:
            self._core_failed()
            return
        if plan is not None:
            self.plans_in_flight.append(plan.plan_id)
            self._timed(plan)
            self._to_workers(plan)

    def _timed(self, plan: StepPlan) -> None:
        """The plan's clock starts (``PlanClock``) with its steps' work."""
        assert self.core is not None
        self.clock.sent(*plan_work(plan, self.core.requests), time.monotonic())

    def _close(self) -> None:
        shutdown = self.worker_codec.encode(Shutdown())
        for _ in self.workers.ready:
            with contextlib.suppress(zmq.Again):  # a worker already gone needs no goodbye
                self.to_workers.send(shutdown, zmq.NOBLOCK)
        self.to_workers.disable_monitor()
        self.inboxes.close()
        for sock in (self.worker_links, self.from_frontend, self.to_frontend, self.from_workers, self.to_workers):
            sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()
        log.info("scheduler stopped")

    # ------------------------------------------------------------------ sending

    def _core_failed(self) -> None:
        """The scheduling core raised mid-plan: its state cannot be trusted. End every live
        request with an error and carry on with a clean core; the worker drops their state."""
        self.internal_errors += 1
        log.exception("INTERNAL ERROR in the scheduling core; ending every live request and starting a clean "
                      "core (%d internal errors so far)", self.internal_errors)
        core = self.core
        assert core is not None and self.model is not None
        message = "internal scheduler error (logged); request ended"
        # Built from the request table alone: the core's other structures may be what broke.
        finishes = [Finish(r.rid, FinishReason.ERROR, r.num_prompt_tokens, 0, r.num_outputs, message)
                    for r in core.requests.values()]
        forget = core.rids_on_worker()
        self.core = self._new_core(self.model, first_plan_id=core.last_plan_id)
        self.core.forget_on_worker(forget)
        self.outbox.send(TokenBatch([], [], finishes))

    def _output_lost(self, rid: int) -> None:
        """A batch with ``rid``'s output could not reach its frontend (``Outbox``): if it is still
        running it is aborted now, freeing its blocks."""
        if self.core is not None and rid in self.core.requests:
            self._abort(rid, FinishReason.ERROR, "output lost on the link to the frontend")

    def _to_workers(self, msg: object) -> None:
        """To the worker (a tensor-parallel group's rank 0, which relays to the other ranks)."""
        try:
            self.to_workers.send(self.worker_codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self._fail("no worker connected to receive the next plan")

    # ------------------------------------------------------------------ frontend messages

    def on_add(self, msg: AddRequest) -> None:
        rids = range(msg.rid, msg.rid + msg.n)
        reason = None
        if self.core is None or self.workers.failure is not None:
            reason = (self.workers.failure
                      or "the engine is not ready yet (a scheduler that just started waits for its workers)")
        elif self.workers.outage is not None:
            # Live requests wait for the worker to come back; a new one is refused now (503),
            # rather than wait in silence for a worker that may not come.
            reason = f"no worker: {self.workers.outage}; retry when /ready answers 200"
        elif any(rid in self.frontends.owner for rid in rids):
            reason = f"duplicate request rid {msg.rid}"
        if reason is not None:
            self.frontends.reply(TokenBatch([], [], [Finish(rid, FinishReason.ERROR, 0, 0, 0, reason) for rid in rids]))
            return
        assert self.core is not None
        for rid in rids:
            self.frontends.own(rid)
        rejected = self.core.add(msg)
        if rejected:
            self.outbox.send(TokenBatch([], [], rejected))
        else:
            self._prepare_grammars()
            self._cut_speculative()

    def _prepare_grammars(self) -> None:
        """Grammars that constrained requests wait for go to the worker to compile now (once
        there is a worker: after a loss, the new one gets them when it is ready)."""
        core = self.core
        if core is None or not core.grammars.to_prepare or self.workers.outage is not None:
            return
        for grammar_id, grammar in core.grammars.to_prepare:
            self._to_workers(PrepareGrammar(grammar_id, grammar))
        core.grammars.to_prepare.clear()

    def on_grammar_ready(self, msg: GrammarReady) -> None:
        if self.core is not None and any([self.core.grammar_compiled(g) for g in msg.grammar_ids]):
            self._cut_speculative()

    def on_abort(self, msg: AbortRequest) -> None:
        if self.core is not None:
            self._abort(msg.rid)

    def _abort(self, rid: int, reason: str = FinishReason.ABORT, message: str = "") -> None:
        assert self.core is not None
        plans = self.core.plans_with(rid)
        finish = self.core.abort(rid, reason, message)
        if finish is not None:
            self.outbox.send(TokenBatch([], [], [finish]))
            self._cancel_in_flight(plans, [rid], forget=True)

    def _acknowledge(self, query_id: int, rid: int) -> None:
        """Controls asked to be answered: found = the request was live, the change applied."""
        if query_id:
            self.frontends.reply(QueryReply(query_id, self.core is not None and rid in self.core.requests))

    def on_pause(self, msg: PauseRequest) -> None:
        if self.core is not None and self.core.pause(msg.rid):
            self._cancel_in_flight(self.core.plans_with(msg.rid), [msg.rid], forget=False)
        self._acknowledge(msg.query_id, msg.rid)

    def on_resume(self, msg: ResumeRequest) -> None:
        if self.core is not None:
            self.core.resume(msg.rid)
        self._acknowledge(msg.query_id, msg.rid)

    def on_set_priority(self, msg: SetPriority) -> None:
        """Applied at once, so a read or a pause right after sees it; a queued speculative
        window is called off, as the change may alter what runs next."""
        if self.core is not None and self.core.set_priority(msg.rid, msg.priority, msg.cut_in):
            self._cut_speculative()
        self._acknowledge(msg.query_id, msg.rid)

    def _cancel_in_flight(self, plan_ids: list[int], rids: list[int], forget: bool) -> None:
        """Have the worker drop ``rids`` from ``plan_ids`` at its next step boundary, rather than
        after the whole multi-step window. Their tokens until then still arrive and count."""
        if self.workers.failure is not None:
            return
        for plan_id in plan_ids:
            self._to_workers(CancelRows(plan_id, rids, forget))

    def on_ping(self, msg: Ping) -> None:
        sender = self.frontends.sender
        if sender is not None:
            stats = ping_stats(self.core, self._counters(), self.busy)
            self.frontends.send(sender, pong(msg.sent_at, self.workers, self.model, self.epoch,
                                             self.frontends.seq.get(sender, 0), stats))
        if msg.need_model and self.model is not None and self.workers.failure is None:
            self.frontends.reply(EngineReady(self.model))

    def _counters(self) -> dict[str, float | int]:
        return {"worker_busy_s_total": self.busy.total_s, "internal_errors": self.internal_errors,
                "lost_batches": self.frontends.lost_batches, "malformed_frames": self.malformed_frames}

    def on_stats_query(self, msg: StatsQuery) -> None:
        if self.core is None:
            self.frontends.reply(QueryReply(msg.query_id, False))
            return
        stats = engine_stats(self.core, self._counters(), self.workers, self.frontends, self.plans_in_flight,
                             self.worker_memory)
        self.frontends.reply(QueryReply(msg.query_id, True, stats))

    def on_requests_query(self, msg: RequestsQuery) -> None:
        self.frontends.reply(QueryReply(msg.query_id, self.core is not None,
                                        request_summaries(self.core, self.frontends)))

    def on_request_query(self, msg: RequestQuery) -> None:
        summary = request_summary(self.core, msg.rid)
        self.frontends.reply(QueryReply(msg.query_id, summary is not None, summary))

    def on_pause_all(self, msg: PauseAll) -> None:
        if self.core is not None:
            self.core.paused = True
            for plan_id, plan in self.core.in_flight.items():
                self._cancel_in_flight([plan_id], plan.rids, forget=False)

    def on_resume_all(self, msg: ResumeAll) -> None:
        if self.core is not None:
            self.core.paused = False

    def on_reset_prefix_cache(self, msg: ResetPrefixCache) -> None:
        self.reset_cache_pending = True
        self._cut_speculative()

    def _cut_speculative(self) -> None:
        """Something must change what runs (a new prompt, a control): the speculative window
        queued behind the running one is called off, so the change waits for one window at
        most, not two. If it has started, it ends at its next step boundary."""
        if len(self.plans_in_flight) == 2 and self.plans_in_flight[1] not in self.cut_short:
            assert self.core is not None
            plan_id = self.plans_in_flight[1]
            self.cut_short.add(plan_id)
            self._cancel_in_flight([plan_id], self.core.in_flight[plan_id].rids, forget=False)

    def _reset_prefix_cache(self) -> None:
        self.reset_cache_pending = False
        if self.core is not None:
            dropped = self.core.reset_prefix_cache()
            log.info("prefix cache reset: %d cached blocks dropped", dropped)

    # ------------------------------------------------------------------ worker messages

    def _drain_workers(self) -> None:
        """Everything the workers sent. The steps' tokens drained in one wake-up go to each
        frontend as one batch: nothing waits for it (they have all arrived), and a scheduler that
        fell behind catches up with a send per wake-up, not one per step."""
        with self.outbox.merged():
            self._drain(self.from_workers, self.worker_codec, routed=False)

    def _on_worker_link_event(self) -> None:
        # A worker that is told to stop says goodbye and then disconnects: the monitor may report
        # the disconnect before this loop has read the goodbye, so read what it sent first.
        if self.from_workers.poll(0):
            self._drain_workers()
        while self.worker_links.poll(0):
            lost = self.workers.link_event(recv_monitor_message(self.worker_links)["event"])
            if lost is not None:
                self._worker_lost(lost)

    def on_step_tokens(self, msg: StepTokens) -> None:
        self.workers.heard(0)
        self.busy.add(msg.busy_s)
        if self.core is None or msg.plan_id not in self.plans_in_flight:
            return
        if msg.plan_id == self.plans_in_flight[0]:
            self.clock.step_done(msg.busy_s, msg.last, time.monotonic())
        batch = TokenBatch([], [], [], msg.logprobs, prompt_logprobs=msg.prompt_logprobs, embeddings=msg.embeddings)
        failed = False
        try:
            self.core.update(msg, batch)
        except Exception:
            failed = True
        finally:  # whatever happened to the tokens, the plan's bookkeeping must move on
            if msg.last:
                self.plans_in_flight.remove(msg.plan_id)
                self.cut_short.discard(msg.plan_id)
        if batch.rids or batch.finished:
            self.outbox.send(batch)  # what was done before a failure: those finishes are real
        if failed:
            self._core_failed()
        elif msg.last:
            self._send_continuation()

    # ------------------------------------------------------------------ liveness

    def _check_frontends(self) -> None:
        """A frontend silent for FRONTEND_TIMEOUT_S is gone (crashed, restarted, cut off): its
        requests have nobody to stream to, so they are aborted and their blocks freed."""
        for frontend, rids in self.frontends.gone():
            for rid in rids:
                if self.core is not None:
                    self._abort(rid)
            log.warning("frontend %s silent for %.0f s: %d of its requests aborted", frontend.decode(errors="replace"),
                        FRONTEND_TIMEOUT_S, len(rids))

    def _check_workers(self) -> None:
        hang = self._hang()
        if hang is not None and self.from_workers.poll(0):
            # What the workers sent is read before any verdict: a scheduler that fell behind must
            # not call a worker hung whose tokens or heartbeats wait in its own inbox.
            self._drain_workers()
            hang = self._hang()
        if hang is not None:
            self._worker_hung(hang)
        if (expired := self.workers.outage_expired()) is not None:
            self._fail(expired)


def run(config: SchedulerConfig) -> int:
    process = SchedulerProcess(config)

    def stop(signum: int, frame: FrameType | None) -> None:
        process.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if supervised():
        # Under ``sluice serve``, Ctrl-C is the parent's to handle: it drains, then stops us.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process.run()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # already stopping: a second signal changes nothing
    return 0

