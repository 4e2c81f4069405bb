"""The scheduler process in-process, over its real ZeroMQ sockets: a failure while handling one
message ends that message's request with an error, is counted, and the process serves on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from protocol.config import SchedulerConfig
from protocol.messages import (
    AddRequest,
    ModelInfo,
    PauseAll,
    Ping,
    Pong,
    ResumeAll,
    SamplingParams,
    SetPriority,
    StepPlan,
    StepTokens,
    TokenBatch,
    WorkerReady,
    WorkerStopping,
)
from protocol.transport import (
    Endpoints,
    frontend_codec,
    frontend_identity,
    make_socket,
    scheduler_frontend_codec,
    scheduler_worker_codec,
    worker_codec,
)
from scheduler.process import SchedulerProcess
from scheduler.request import Request


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[SchedulerProcess]:
    proc = SchedulerProcess(SchedulerConfig(address=f"ipc://{tmp_path}/sched"))
    proc.on_worker_ready(WorkerReady(0, ModelInfo("m", 512, 100, [2], None, "", None, False, 64, 16)))
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    try:
        yield proc
    finally:
        proc.stopping = True
        thread.join(10)


def registered(push: zmq.Socket[Any], pull: zmq.Socket[Any]) -> None:
    """Ping until a Pong comes back: the scheduler then knows this frontend's return route. (A
    reply sent before the frontend's receiving socket is connected is lost: "host unreachable".)"""
    send, decode = scheduler_frontend_codec().encode, frontend_codec().decode
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        push.send(send(Ping(0.0)))
        while pull.poll(200):
            if isinstance(decode(pull.recv()), Pong):
                return
    raise AssertionError("the scheduler never answered a ping")


def connected_worker_inbox(ctx: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
    """A PULL socket standing in for a worker, returned once its link to the scheduler is up: the
    scheduler sends a plan without waiting, and one sent before a worker is connected fails."""
    sock = make_socket(ctx, zmq.PULL, address, bind=None)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    assert monitor.poll(10_000), "the stand-in worker did not connect"
    sock.disable_monitor()
    monitor.close(linger=0)
    return sock


def test_a_handler_that_raises_ends_its_request_and_the_process_goes_on(scheduler: SchedulerProcess,
                                                                          tmp_path: Path) -> None:
    assert scheduler.core is not None

    def injected_bug(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("injected")

    scheduler.core.set_priority = injected_bug  # type: ignore[method-assign]
    ctx: zmq.Context[Any] = zmq.Context()
    ep = Endpoints.from_base(f"ipc://{tmp_path}/sched")
    identity = frontend_identity(7)
    push = make_socket(ctx, zmq.DEALER, ep.frontend_to_scheduler, bind=False, identity=identity)
    pull = make_socket(ctx, zmq.DEALER, ep.scheduler_to_frontend, bind=False, identity=identity)
    pull.setsockopt(zmq.RCVTIMEO, 10_000)
    send, decode = scheduler_frontend_codec().encode, frontend_codec().decode
    try:
        registered(push, pull)
        push.send(send(PauseAll()))  # keep the request queued: no worker is attached to run it
        push.send(send(AddRequest(1, "r1", [5, 6, 7], SamplingParams(max_tokens=4))))
        push.send(send(AddRequest(2, "r2", [5, 6, 8], SamplingParams(max_tokens=4))))
        push.send(send(SetPriority(1, 0)))
        ended = None
        while ended is None:
            msg = decode(pull.recv())
            if isinstance(msg, TokenBatch) and msg.finished:
                ended = msg.finished[0]
        assert ended.rid == 1 and ended.reason == "error" and "internal" in ended.message
        push.send(send(Ping(0.0)))
        while not isinstance(msg := decode(pull.recv()), Pong):
            pass
        assert msg.stats is not None and msg.stats["internal_errors"] == 1
        assert scheduler.core is not None and set(scheduler.core.requests) == {2}  # the other one is untouched
    finally:
        ctx.destroy(linger=0)


def test_a_failure_inside_the_core_ends_live_requests_and_a_clean_core_goes_on(scheduler: SchedulerProcess,
                                                                                 tmp_path: Path) -> None:
    assert scheduler.core is not None

    def injected_bug() -> None:
        raise RuntimeError("injected")

    scheduler.core.schedule = injected_bug  # type: ignore[method-assign,assignment]
    ctx: zmq.Context[Any] = zmq.Context()
    ep = Endpoints.from_base(f"ipc://{tmp_path}/sched")
    identity = frontend_identity(9)
    push = make_socket(ctx, zmq.DEALER, ep.frontend_to_scheduler, bind=False, identity=identity)
    pull = make_socket(ctx, zmq.DEALER, ep.scheduler_to_frontend, bind=False, identity=identity)
    worker_inbox = connected_worker_inbox(ctx, ep.scheduler_to_worker)
    for sock in (pull, worker_inbox):
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
    send, decode = scheduler_frontend_codec().encode, frontend_codec().decode
    try:
        registered(push, pull)
        push.send(send(AddRequest(1, "r1", [5, 6, 7], SamplingParams(max_tokens=4))))
        while not isinstance(msg := decode(pull.recv()), TokenBatch) or not msg.finished:
            pass
        assert msg.finished[0].rid == 1 and msg.finished[0].reason == "error"
        push.send(send(AddRequest(2, "r2", [5, 6, 8], SamplingParams(max_tokens=4))))
        plan = worker_codec().decode(worker_inbox.recv())
        assert isinstance(plan, StepPlan) and plan.rids == [2]
    finally:
        ctx.destroy(linger=0)


def test_a_failure_while_applying_tokens_sends_what_was_done_and_a_clean_core_goes_on(
        scheduler: SchedulerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Scheduler.update`` raising halfway through a step's rows: the finishes it had already
    made (their blocks freed) still reach the frontend, every other live request ends with an
    error instead of hanging, and the scheduler goes on planning with a clean core."""
    real_add_output = Request.add_output

    def add_output(self: Request, *args: Any) -> str | None:
        if self.rid == 2:
            raise RuntimeError("injected")
        return real_add_output(self, *args)

    monkeypatch.setattr(Request, "add_output", add_output)
    ctx: zmq.Context[Any] = zmq.Context()
    ep = Endpoints.from_base(f"ipc://{tmp_path}/sched")
    identity = frontend_identity(11)
    push = make_socket(ctx, zmq.DEALER, ep.frontend_to_scheduler, bind=False, identity=identity)
    pull = make_socket(ctx, zmq.DEALER, ep.scheduler_to_frontend, bind=False, identity=identity)
    worker_inbox = connected_worker_inbox(ctx, ep.scheduler_to_worker)
    worker_outbox = make_socket(ctx, zmq.PUSH, ep.worker_to_scheduler, bind=False)
    for sock in (pull, worker_inbox):
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
    send, decode = scheduler_frontend_codec().encode, frontend_codec().decode
    try:
        registered(push, pull)
        push.send(send(PauseAll()))  # both requests in one plan
        push.send(send(AddRequest(1, "r1", [5, 6, 7], SamplingParams(max_tokens=1))))
        push.send(send(AddRequest(2, "r2", [5, 6, 8], SamplingParams(max_tokens=5))))
        push.send(send(ResumeAll()))
        plan = worker_codec().decode(worker_inbox.recv())
        assert isinstance(plan, StepPlan) and plan.rids == [1, 2]
        worker_outbox.send(scheduler_worker_codec().encode(StepTokens(plan.plan_id, 0, [1, 2], [40, 41], True)))
        finishes: dict[int, Any] = {}
        tokens: dict[int, list[int]] = {}
        while len(finishes) < 2:
            msg = decode(pull.recv())
            if isinstance(msg, TokenBatch):
                for rid, token in zip(msg.rids, msg.token_ids, strict=True):
                    tokens.setdefault(rid, []).append(token)
                finishes.update((f.rid, f) for f in msg.finished)
        assert tokens == {1: [40]} and finishes[1].reason == "length", "what update did before failing is sent"
        assert finishes[2].reason == "error" and "internal" in finishes[2].message
        push.send(send(AddRequest(3, "r3", [5, 6, 9], SamplingParams(max_tokens=4))))
        while not isinstance(plan := worker_codec().decode(worker_inbox.recv()), StepPlan) or 3 not in plan.rids:
            pass
        assert scheduler.core is not None and set(scheduler.core.requests) == {3} and scheduler.internal_errors == 1
    finally:
        ctx.destroy(linger=0)


def test_a_request_that_arrives_while_the_worker_is_gone_is_refused_at_once(scheduler: SchedulerProcess,
                                                                              tmp_path: Path) -> None:
    """Live requests wait for a lost worker to come back; a new one is refused at once (the
    frontend answers 503) rather than wait in silence for a worker that may never come."""
    ctx: zmq.Context[Any] = zmq.Context()
    ep = Endpoints.from_base(f"ipc://{tmp_path}/sched")
    identity = frontend_identity(13)
    push = make_socket(ctx, zmq.DEALER, ep.frontend_to_scheduler, bind=False, identity=identity)
    pull = make_socket(ctx, zmq.DEALER, ep.scheduler_to_frontend, bind=False, identity=identity)
    worker_outbox = make_socket(ctx, zmq.PUSH, ep.worker_to_scheduler, bind=False)
    pull.setsockopt(zmq.RCVTIMEO, 10_000)
    send, decode = scheduler_frontend_codec().encode, frontend_codec().decode
    try:
        registered(push, pull)
        worker_outbox.send(scheduler_worker_codec().encode(WorkerStopping(0)))
        pong = None
        while pong is None or pong.workers_alive:
            push.send(send(Ping(0.0)))
            if isinstance(msg := decode(pull.recv()), Pong):
                pong = msg
        assert "told to stop" in pong.unhealthy_reason
        started = time.monotonic()
        push.send(send(AddRequest(21, "r21", [5, 6, 7], SamplingParams(max_tokens=4), n=2)))
        while not isinstance(msg := decode(pull.recv()), TokenBatch):
            pass
        assert [(f.rid, f.reason) for f in msg.finished] == [(21, "error"), (22, "error")]
        assert "no worker" in msg.finished[0].message and time.monotonic() - started < 5
    finally:
        ctx.destroy(linger=0)
