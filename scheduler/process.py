"""The scheduler process: one loop that owns every socket and the scheduling core.

    while running:
        poll both inboxes (no wait if a plan could be sent now)
        dispatch every waiting message by type
        check worker liveness
        send the next plan if the worker is free

The scheduler binds all four sockets; frontend and workers connect. It never sends to a frontend
that has not pinged, nor to workers before they announced themselves, and sends without blocking,
so an absent peer can never stall the loop.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import zmq

from protocol.config import SchedulerConfig
from protocol.messages import (
    AbortRequest,
    AddRequest,
    CancelRows,
    EngineError,
    EngineReady,
    Finish,
    FinishReason,
    ModelInfo,
    PauseAll,
    PauseRequest,
    Ping,
    Pong,
    Query,
    QueryReply,
    ResetPrefixCache,
    ResumeAll,
    ResumeRequest,
    SetPriority,
    Shutdown,
    StepTokens,
    TokenBatch,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerReady,
)
from protocol.transport import Endpoints, make_socket, scheduler_frontend_codec, scheduler_worker_codec
from scheduler.scheduler import Scheduler

log = logging.getLogger("sluice.scheduler")

IDLE_POLL_MS = 100
WORKER_TIMEOUT_S = 5.0


class SchedulerProcess:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        ep = Endpoints.from_base(config.address)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.from_frontend = make_socket(self.ctx, zmq.PULL, ep.frontend_to_scheduler, bind=True)
        self.to_frontend = make_socket(self.ctx, zmq.PUSH, ep.scheduler_to_frontend, bind=True)
        self.from_workers = make_socket(self.ctx, zmq.PULL, ep.worker_to_scheduler, bind=True)
        self.to_workers = make_socket(self.ctx, zmq.PUSH, ep.scheduler_to_worker, bind=True)
        self.poller = zmq.Poller()
        self.poller.register(self.from_frontend, zmq.POLLIN)
        self.poller.register(self.from_workers, zmq.POLLIN)
        self.frontend_codec = scheduler_frontend_codec()
        self.worker_codec = scheduler_worker_codec()
        self.core: Scheduler | None = None
        self.model: ModelInfo | None = None
        self.ready_ranks: dict[int, ModelInfo] = {}
        self.last_seen: dict[int, float] = {}
        self.frontend_seen = False
        self.plans_in_flight: list[int] = []  # oldest first; a second one is speculative
        self.cut_short: set[int] = set()  # speculative plans called off
        self.failure: str | None = None
        self.stopping = False
        # Priority changes and cache resets wait for the plan in flight to end: they only shape
        # the next plan. Aborts and pauses act at once (see ``_cancel_in_flight``).
        self.deferred: list[object] = []
        # Worker compute time, for the device-idle ratio: busy seconds over wall seconds since
        # the previous ping (1.0 = the device did nothing).
        self.busy_total_s = 0.0
        self._busy_mark = (time.monotonic(), 0.0)
        self.handlers: dict[type, Callable[[Any], None]] = {
            AddRequest: self.on_add,
            AbortRequest: self.on_abort,
            Ping: self.on_ping,
            Query: self.on_query,
            PauseAll: self.on_pause_all,
            ResumeAll: self.on_resume_all,
            PauseRequest: self.on_pause,
            ResumeRequest: self.on_resume,
            SetPriority: self.defer,
            ResetPrefixCache: self.defer,
            StepTokens: self.on_step_tokens,
            WorkerReady: self.on_worker_ready,
            WorkerHeartbeat: self.on_heartbeat,
            WorkerFailed: self.on_worker_failed,
        }

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        log.info("scheduler listening at %s", self.config.address)
        try:
            while not self.stopping:
                timeout = 0 if self._can_send_plan() else IDLE_POLL_MS
                ready = dict(self.poller.poll(timeout))
                if self.from_workers in ready:
                    self._drain(self.from_workers, self.worker_codec)
                if self.from_frontend in ready:
                    self._drain(self.from_frontend, self.frontend_codec)
                self._check_workers()
                if not self.plans_in_flight and self.deferred:
                    self._apply_deferred()
                if self._can_send_plan():
                    self._send_plan()
        finally:
            self._close()

    def _drain(self, sock: zmq.Socket[Any], codec: Any) -> None:
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg = codec.decode(frame.buffer)
            self.handlers[type(msg)](msg)

    def _can_send_plan(self) -> bool:
        return (self.core is not None and not self.plans_in_flight and self.failure is None
                and self.core.has_work)

    def _send_plan(self) -> None:
        assert self.core is not None
        plan = self.core.schedule()
        if plan is None:
            return
        self.plans_in_flight.append(plan.plan_id)
        self._to_workers(plan)
        self._send_continuation()

    def _send_continuation(self) -> None:
        """Async scheduling: queue the next decode window behind the one plan in flight, so
        the worker never waits for the scheduler between windows. Anything that must change
        what runs (a waiting prompt, a deferred control) ends the chain: the next plan is then
        made normally, once the worker is done."""
        if (self.core is None or not self.config.async_scheduling or len(self.plans_in_flight) != 1
                or self.deferred or self.failure is not None):
            return
        plan = self.core.continue_plan()
        if plan is not None:
            self.plans_in_flight.append(plan.plan_id)
            self._to_workers(plan)

    def _close(self) -> None:
        shutdown = self.worker_codec.encode(Shutdown())
        for _ in self.ready_ranks:
            with contextlib.suppress(zmq.Again):  # a worker already gone needs no goodbye
                self.to_workers.send(shutdown, zmq.NOBLOCK)
        for sock in (self.from_frontend, self.to_frontend, self.from_workers, self.to_workers):
            sock.close(linger=0)
        self.ctx.term()
        log.info("scheduler stopped")

    # ------------------------------------------------------------------ sending

    def _to_frontend(self, msg: object) -> None:
        if not self.frontend_seen:
            return
        try:
            self.to_frontend.send(self.frontend_codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            # The frontend's receiving socket connects in the background; a ping can arrive
            # before it does. Pings repeat, so nothing is lost for long.
            log.debug("frontend not connected; dropped a %s", type(msg).__name__)

    def _to_workers(self, msg: object) -> None:
        data = self.worker_codec.encode(msg)
        for _ in range(self.config.tensor_parallel_size):
            try:
                self.to_workers.send(data, zmq.NOBLOCK)
            except zmq.Again:
                self._fail("no worker connected to receive the next plan")
                return

    # ------------------------------------------------------------------ frontend messages

    def on_add(self, msg: AddRequest) -> None:
        if self.core is None or self.failure is not None:
            reason = self.failure or "the model is not loaded yet"
            self._to_frontend(TokenBatch([], [], [Finish(msg.rid, FinishReason.ERROR, 0, 0, 0, reason)]))
            return
        rejected = self.core.add(msg)
        if rejected is not None:
            self._to_frontend(TokenBatch([], [], [rejected]))
        else:
            self._cut_speculative()

    def on_abort(self, msg: AbortRequest) -> None:
        if self.core is not None:
            plans = self.core.plans_with(msg.rid)
            finish = self.core.abort(msg.rid)
            if finish is not None:
                self._to_frontend(TokenBatch([], [], [finish]))
                self._cancel_in_flight(plans, [msg.rid], forget=True)

    def on_pause(self, msg: PauseRequest) -> None:
        if self.core is not None and self.core.pause(msg.rid):
            self._cancel_in_flight(self.core.plans_with(msg.rid), [msg.rid], forget=False)

    def on_resume(self, msg: ResumeRequest) -> None:
        if self.core is not None:
            self.core.resume(msg.rid)

    def _cancel_in_flight(self, plan_ids: list[int], rids: list[int], forget: bool) -> None:
        """Have the worker drop ``rids`` from ``plan_ids`` at its next step boundary, rather than
        after the whole multi-step window. Their tokens until then still arrive and count."""
        if self.failure is not None:
            return
        for plan_id in plan_ids:
            self._to_workers(CancelRows(plan_id, rids, forget))

    def on_ping(self, msg: Ping) -> None:
        self.frontend_seen = True
        ready = self.model is not None and self.failure is None
        self._to_frontend(Pong(msg.sent_at, self._workers_alive(), ready, self._stats()))
        if msg.need_model and ready:
            assert self.model is not None
            self._to_frontend(EngineReady(self.model))

    def _stats(self) -> dict[str, float | int | bool | None] | None:
        if self.core is None:
            return None
        now = time.monotonic()
        mark_t, mark_busy = self._busy_mark
        wall = now - mark_t
        idle = 1.0 - min(1.0, (self.busy_total_s - mark_busy) / wall) if wall > 0 else 1.0
        self._busy_mark = (now, self.busy_total_s)
        stats: dict[str, float | int | bool | None] = {}
        for k, v in self.core.stats().items():
            if isinstance(v, (int, float, bool)):
                stats[k] = v
        stats["worker_busy_s_total"] = self.busy_total_s
        stats["device_idle_ratio"] = idle
        return stats

    def on_query(self, msg: Query) -> None:
        core = self.core
        if core is None:
            self._to_frontend(QueryReply(msg.query_id, False))
        elif msg.what == "stats":
            plan_in_flight = self.plans_in_flight[0] if self.plans_in_flight else None
            stats = core.stats() | {"workers_alive": self._workers_alive(), "plan_in_flight": plan_in_flight,
                                    "worker_busy_s_total": self.busy_total_s}
            self._to_frontend(QueryReply(msg.query_id, True, stats))
        elif msg.what == "requests":
            items = [core.summary(r) for r in core.requests.values()]
            self._to_frontend(QueryReply(msg.query_id, True, items))
        else:
            req = core.requests.get(msg.rid)
            self._to_frontend(QueryReply(msg.query_id, req is not None, core.summary(req) if req else None))

    def on_pause_all(self, msg: PauseAll) -> None:
        if self.core is not None:
            self.core.paused = True
            for plan_id, plan in self.core.in_flight.items():
                self._cancel_in_flight([plan_id], plan.rids, forget=False)

    def on_resume_all(self, msg: ResumeAll) -> None:
        if self.core is not None:
            self.core.paused = False

    def defer(self, msg: object) -> None:
        self.deferred.append(msg)
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

    def _apply_deferred(self) -> None:
        msgs, self.deferred = self.deferred, []
        core = self.core
        if core is None:
            return
        for msg in msgs:
            if isinstance(msg, SetPriority):
                core.set_priority(msg.rid, msg.priority, msg.cut_in)
            elif isinstance(msg, ResetPrefixCache):
                dropped = core.reset_prefix_cache()
                log.info("prefix cache reset: %d cached blocks dropped", dropped)

    # ------------------------------------------------------------------ worker messages

    def on_worker_ready(self, msg: WorkerReady) -> None:
        self.last_seen[msg.rank] = time.monotonic()
        self.ready_ranks[msg.rank] = msg.model
        if len(self.ready_ranks) < self.config.tensor_parallel_size:
            return
        info = self.ready_ranks.get(0, msg.model)
        self.model = info
        self.core = Scheduler(self.config, info.num_kv_blocks, info.block_size, info.max_model_len,
                              info.eos_token_ids)
        self.plans_in_flight = []
        self.cut_short.clear()
        self.failure = None
        log.info("workers ready: %s, %d KV blocks of %d tokens", info.name, info.num_kv_blocks, info.block_size)

    def on_heartbeat(self, msg: WorkerHeartbeat) -> None:
        self.last_seen[msg.rank] = time.monotonic()

    def on_worker_failed(self, msg: WorkerFailed) -> None:
        self._fail(f"worker {msg.rank} failed: {msg.message}")

    def on_step_tokens(self, msg: StepTokens) -> None:
        self.last_seen[0] = time.monotonic()
        self.busy_total_s += msg.busy_s
        if self.core is None or msg.plan_id not in self.plans_in_flight:
            return
        batch = self.core.update(msg)
        if batch.rids or batch.finished:
            self._to_frontend(batch)
        if msg.last:
            self.plans_in_flight.remove(msg.plan_id)
            self.cut_short.discard(msg.plan_id)
            self._send_continuation()

    # ------------------------------------------------------------------ failure

    def _workers_alive(self) -> bool:
        if self.failure is not None or len(self.ready_ranks) < self.config.tensor_parallel_size:
            return False
        now = time.monotonic()
        return all(now - self.last_seen.get(r, 0.0) < WORKER_TIMEOUT_S for r in self.ready_ranks)

    def _check_workers(self) -> None:
        if self.failure is None and self.ready_ranks and not self._workers_alive():
            self._fail(f"a worker sent nothing for {WORKER_TIMEOUT_S:.0f} s")

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        log.error("engine failed: %s", reason)
        self.failure = reason
        self.ready_ranks.clear()
        self.plans_in_flight = []
        self.cut_short.clear()
        if self.core is not None:
            finishes = self.core.finish_all(FinishReason.ERROR, reason)
            if finishes:
                self._to_frontend(TokenBatch([], [], finishes))
        self._to_frontend(EngineError(reason))


def run(config: SchedulerConfig) -> int:
    process = SchedulerProcess(config)

    def stop(signum: int, frame: FrameType | None) -> None:
        process.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        process.run()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # already stopping: a second signal changes nothing
    return 0
