"""``python -m worker`` as a real process on real sockets, with the test playing the scheduler:
readiness, a multi-step plan, heartbeats, Shutdown; a load failure; SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from worker_testing import one_cpu_thread

from protocol.config import WorkerConfig, to_json
from protocol.messages import (
    NewRequest,
    SamplingParams,
    Shutdown,
    StepPlan,
    StepTokens,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerMessage,
    WorkerReady,
)
from protocol.transport import Endpoints, make_socket, scheduler_worker_codec, worker_codec
from worker.engine import Worker
from worker.model.tiny import materialize_tiny

WAIT_MS = 60_000  # generous: the machine may be busy; nothing here asserts on timing
pytestmark = pytest.mark.timeout(180)


class FakeScheduler:
    """Binds the two worker sockets, as the scheduler does, and starts a worker against them."""

    def __init__(self, tmp_path: Path, **config: Any) -> None:
        self.config = WorkerConfig(address=f"ipc://{tmp_path}/engine", **config)
        ep = Endpoints.from_base(self.config.address)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.inbox = make_socket(self.ctx, zmq.PULL, ep.worker_to_scheduler, bind=True)
        self.outbox = make_socket(self.ctx, zmq.PUSH, ep.scheduler_to_worker, bind=True)
        self.decoder, self.encoder = scheduler_worker_codec(), worker_codec()
        self.proc = subprocess.Popen([sys.executable, "-m", "worker", "--config", to_json(self.config)])
        self.heartbeats = 0

    def send(self, msg: object) -> None:
        self.outbox.send(self.encoder.encode(msg))

    def receive(self, heartbeats: bool = False) -> WorkerMessage:
        """The next message; heartbeats are counted and skipped unless asked for."""
        while True:
            assert self.inbox.poll(WAIT_MS), "the worker went silent"
            msg = self.decoder.decode(self.inbox.recv())
            if not isinstance(msg, WorkerHeartbeat):
                return msg
            self.heartbeats += 1
            if heartbeats:
                return msg

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.inbox.close(0)
        self.outbox.close(0)
        self.ctx.term()


@pytest.fixture
def scheduler_for(tmp_path: Path) -> Iterator[Any]:
    started: list[FakeScheduler] = []

    def start(**config: Any) -> FakeScheduler:
        started.append(FakeScheduler(tmp_path, **config))
        return started[-1]

    yield start
    for s in started:
        s.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize_tiny(tmp_path_factory.mktemp("cache"))


def test_worker_serves_a_plan_and_shuts_down(tiny: Path, scheduler_for: Any) -> None:
    s = scheduler_for(model=str(tiny), num_kv_blocks=16, dtype="float32")
    ready = s.receive()
    assert isinstance(ready, WorkerReady) and ready.rank == 0
    assert (ready.model.num_kv_blocks, ready.model.block_size, ready.model.vocab_size) == (16, 16, 512)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plan = StepPlan(1, [NewRequest(7, [1, 40, 41, 42, 43], 5, params)], [7], [5], [[3]], num_steps=6)
    s.send(plan)
    steps: list[StepTokens] = []
    while not steps or not steps[-1].last:
        msg = s.receive()
        assert isinstance(msg, StepTokens), msg
        steps.append(msg)
    while s.heartbeats == 0:  # one eventually arrives, from its own thread and socket
        assert isinstance(s.receive(heartbeats=True), WorkerHeartbeat)
    s.send(Shutdown())
    assert s.proc.wait(timeout=60) == 0
    assert [m.step for m in steps] == list(range(6)) and all(m.rids == [7] for m in steps)
    with one_cpu_thread():
        local = Worker(WorkerConfig(model=str(tiny), num_kv_blocks=16, dtype="float32"))
        expected = [t for m in local.runner.execute(plan) for t in m.token_ids]
    assert [t for m in steps for t in m.token_ids] == expected


def test_a_model_that_cannot_load_is_reported_then_exit_1(tmp_path: Path, scheduler_for: Any) -> None:
    s = scheduler_for(model=str(tmp_path / "nowhere"), num_kv_blocks=4)
    failed = s.receive()
    assert isinstance(failed, WorkerFailed) and failed.rank == 0
    assert "nowhere: no such file or directory" in failed.message and "\n" not in failed.message
    assert s.proc.wait(timeout=60) == 1


def test_sigterm_stops_the_worker_cleanly(tiny: Path, scheduler_for: Any) -> None:
    s = scheduler_for(model=str(tiny), num_kv_blocks=4)
    assert isinstance(s.receive(), WorkerReady)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=60) == 0
