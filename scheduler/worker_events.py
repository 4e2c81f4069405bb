"""What the workers' coming and going means for the live requests: the scheduler process's
handlers for a worker that is ready, beats, stops, fails, drops its connection or hangs.

``Workers`` (scheduler/workers.py) decides the engine's state and logs it; these handlers apply
what each transition means: a core for the model the workers serve, live requests recomputed on
a worker that came back or ended with an error, the plans in flight forgotten, every frontend
told at once. They act on the whole process's state (its core, its plans in flight, its sockets),
so they are a mixin of ``SchedulerProcess`` rather than a class of their own: one object, its
handlers kept by concept in two files.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import zmq

from protocol.config import SchedulerConfig
from protocol.messages import (
    Announce,
    EngineError,
    FinishReason,
    ModelInfo,
    TokenBatch,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerReady,
    WorkerStopping,
)
from protocol.transport import Codec
from scheduler.frontends import Frontends
from scheduler.outbox import Outbox
from scheduler.reports import pong
from scheduler.scheduler import Scheduler
from scheduler.workers import PlanClock, Workers

log = logging.getLogger("sluice.scheduler")


class WorkerEvents:
    # The process's state these handlers act on (``SchedulerProcess.__init__`` sets it up).
    config: SchedulerConfig
    core: Scheduler | None
    model: ModelInfo | None
    workers: Workers
    worker_memory: dict[int, dict[str, float]]
    frontends: Frontends
    outbox: Outbox
    epoch: int
    plans_in_flight: list[int]
    cut_short: set[int]
    clock: PlanClock
    stopping: bool
    to_workers: zmq.Socket[Any]
    worker_codec: Codec[Any]

    def _prepare_grammars(self) -> None:
        raise NotImplementedError  # SchedulerProcess's: the grammars waiting to compile go to the worker

    def on_worker_ready(self, msg: WorkerReady) -> None:
        outage = self.workers.outage
        info = self.workers.announced(msg.rank, msg.model)
        if info is None:
            return  # more ranks to come
        core = self.core
        same_engine = self.model is not None and (
            info.num_kv_blocks, info.block_size, info.dtype, info.quantization, info.kv_cache_dtype) == (
            self.model.num_kv_blocks, self.model.block_size, self.model.dtype, self.model.quantization,
            self.model.kv_cache_dtype)
        if core is not None and core.requests and same_engine:
            # A worker came back (or announced itself again) with an empty state: every live
            # request is recomputed from its prompt and the tokens it has streamed.
            if outage is None:
                core.recompute_all()
            log.info("workers ready again: %s; %d live requests resume (recomputed)", info.name, len(core.requests))
        else:
            if core is not None and core.requests:
                finishes = core.finish_all(FinishReason.ERROR, "the worker came back with a different KV cache or dtype")
                self.outbox.send(TokenBatch([], [], finishes))
            self.core = self._new_core(info)
            log.info("workers ready: %s, %d KV blocks of %d tokens", info.name, info.num_kv_blocks, info.block_size)
        self.model = info
        self.plans_in_flight = []
        self.cut_short.clear()
        self.clock.new_life(time.monotonic())
        self._tell_frontends()
        self._prepare_grammars()

    def _new_core(self, info: ModelInfo, first_plan_id: int = 0) -> Scheduler:
        return Scheduler(self.config, info.num_kv_blocks, info.block_size, info.max_model_len, info.eos_token_ids,
                         first_plan_id)

    def on_heartbeat(self, msg: WorkerHeartbeat) -> None:
        self.workers.heard(msg.rank)
        self.workers.heard_process(msg.rank, msg.pid, msg.process)
        self.clock.heartbeat(msg.rank, msg.pid, msg.steps, time.monotonic())
        if msg.memory:
            self.worker_memory[msg.rank] = msg.memory
        if self.workers.should_ask_to_announce(msg.rank):
            with contextlib.suppress(zmq.Again):
                self.to_workers.send(self.worker_codec.encode(Announce()), zmq.NOBLOCK)

    def on_worker_stopping(self, msg: WorkerStopping) -> None:
        if msg.rank in self.workers.ready and not self.stopping:
            self._worker_lost(f"worker {msg.rank} was told to stop", crashed=False)

    def on_worker_failed(self, msg: WorkerFailed) -> None:
        reason = f"worker {msg.rank} failed: {msg.message}"
        if msg.rank in self.workers.ready:
            self._worker_lost(reason)
        else:
            self._fail(reason)  # it never came up: nothing to wait for

    def _worker_lost(self, reason: str, crashed: bool = True) -> None:
        """A ready worker is gone with every KV block it held: its live requests are set to be
        recomputed on the next one (an outage), or end with an error past the restart budget."""
        if self.core is None or not self.workers.serving or self.stopping:
            return  # (stopping: the workers were told to stop with it)
        failure = self.workers.lose(reason, crashed)
        if failure is not None:
            self._fail(failure)
            return
        self.plans_in_flight = []
        self.cut_short.clear()
        self.clock.clear(time.monotonic())
        self.workers.start_outage(reason, crashed, self.core.recompute_all())
        self._tell_frontends()

    def _hang(self) -> str | None:
        """A worker silent for ``WORKER_TIMEOUT_S``, or a plan in flight that made no progress
        within ``PlanClock``'s limit: the loss to declare, if so (only while serving: before every
        rank has announced itself a rank is not late, only not there yet)."""
        overdue = self.clock.overdue(time.monotonic())
        if self.core is None or not self.workers.serving or self.stopping:
            return None
        return overdue if overdue is not None and self.plans_in_flight else self.workers.silent()

    def _worker_hung(self, hang: str) -> None:
        """As after a crash: its requests go back in line to be recomputed, and the process
        (every rank of its group) is killed, so that it exits and is restarted."""
        self._worker_lost(hang)
        self.clock.clear(time.monotonic())
        log.error("the hung worker: %s", self.workers.kill())

    def _fail(self, reason: str) -> None:
        if not self.workers.fail(reason):
            return
        self.plans_in_flight = []
        self.cut_short.clear()
        self.clock.clear(time.monotonic())
        if self.core is not None:
            finishes = self.core.finish_all(FinishReason.ERROR, reason)
            if finishes:
                self.outbox.send(TokenBatch([], [], finishes))
        self.outbox.flush()  # the finishes go before the word that the engine failed
        self.frontends.broadcast(EngineError(reason))

    def _tell_frontends(self) -> None:
        """The workers' state changed (lost, back): every frontend hears it now, so /health,
        /ready and admission turn at once, not at the next ping."""
        for frontend in list(self.frontends.last_heard):
            self.frontends.send(frontend, pong(0.0, self.workers, self.model, self.epoch,
                                               self.frontends.seq.get(frontend, 0), None))
