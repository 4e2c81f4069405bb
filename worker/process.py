"""The worker process: build the worker, announce readiness, run plans until told to stop.

Sockets (connecting to the scheduler, which binds): PULL for commands, read by the main thread;
PUSH for results, owned by the sender thread; a second PUSH owned by the heartbeat thread
(ZeroMQ sockets are not thread-safe). In a tensor-parallel group only rank 0 reads commands and
sends tokens: it relays each command to the other ranks at the point where it acts on it
(``worker.parallel``), and they act on it there too; every rank sends its own readiness,
heartbeats and failures. The main thread runs plans; each step's tokens go to the
sender thread, which encodes and sends them while the next step computes. Between steps the main
thread reads its inbox without blocking: ``CancelRows`` applies at once, a next plan waits its
turn. Any failure to load or to run a plan is reported as one ``WorkerFailed`` line, logged with
its traceback (or in one line for a model that cannot load), and ends the process with status 1;
``Shutdown``, SIGTERM and SIGINT end it with status 0.

Liveness: the heartbeat thread beats on whatever the main thread does, so each heartbeat carries
the main loop's step count (``WorkerProcess.steps``); the scheduler calls a worker whose plan makes
no progress hung, and kills it (``scheduler.workers.PlanClock``). ``Stall`` is a test-only hook
that makes the main loop hang inside a step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from types import FrameType
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.config import ConfigError, WorkerConfig
from protocol.curve import CurveKeys
from protocol.messages import (
    Announce,
    CancelRows,
    GrammarReady,
    PrepareGrammar,
    Shutdown,
    StepPlan,
    WorkerCommand,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerMessage,
    WorkerReady,
    WorkerStopping,
)
from protocol.process_identity import process_identity
from protocol.process_memory import resident_mib
from protocol.supervision import startup_failure_level, supervised
from protocol.transport import Endpoints, make_socket, scheduler_worker_codec, worker_codec
from worker.cpu_threads import configure_cpu_threads
from worker.engine import Worker
from worker.model.config import ModelLoadError
from worker.model.loader import resolve_device
from worker.parallel import KEEPALIVE_S, TensorParallelGroup

__all__ = ["Worker", "run"]

HEARTBEAT_S = 0.5
WAITING_LOG_INTERVAL_S = 5.0  # how long a worker is cut off from its scheduler before it says so
FINAL_LINGER_MS = 500  # let a last WorkerFailed reach the scheduler before the socket closes
log = logging.getLogger("sluice.worker")


# Test-only fault injection, never set in production: read once at start. "N:SECONDS[:RANK]"
# makes the main loop sleep SECONDS inside the Nth step this process runs (counted from 1 after
# warm-up; the step's tokens wait), on rank RANK only if given — as a main thread stuck in a kernel
# or a collective would, while the heartbeat thread beats on.
STALL_ENV = "SLUICE_TEST_STALL_STEP"
# Test-only too: a file the stall creates (saying which worker stalled); a worker that finds it
# there does not stall, so a restarted worker, which inherits the environment, runs normally.
STALL_ONCE_ENV = "SLUICE_TEST_STALL_ONCE"


@dataclasses.dataclass(frozen=True)
class Stall:
    """The test-only fault injection of ``STALL_ENV``."""

    step: int
    seconds: float
    once: str | None = None

    @classmethod
    def from_env(cls, rank: int) -> Stall | None:
        spec = os.environ.get(STALL_ENV)
        if not spec:
            return None
        try:
            parts = spec.split(":")
            if not 2 <= len(parts) <= 3:
                raise ValueError(spec)
            step, seconds = int(parts[0]), float(parts[1])
            only = int(parts[2]) if len(parts) == 3 else None
            if step < 1 or seconds < 0:
                raise ValueError(spec)
        except ValueError:
            log.error("%s=%r ignored: expected N:SECONDS[:RANK] (a test-only fault injection)", STALL_ENV, spec)
            return None
        if only is not None and only != rank:
            return None
        return cls(step, seconds, os.environ.get(STALL_ONCE_ENV) or None)

    def hold(self, step: int, who: dict[str, object]) -> None:
        """Inside step ``step`` (1-based): sleep there if it is the one."""
        if step != self.step:
            return
        if self.once is not None:
            try:
                fd = os.open(self.once, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return  # this worker's predecessor (or another engine's) stalled already
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(who))
        log.warning("test fault injection (%s): the main loop stalls inside step %d for %g s", STALL_ENV, step,
                    self.seconds)
        time.sleep(self.seconds)


def _heartbeat(ctx: zmq.Context[Any], address: str, rank: int, stop: threading.Event,
               curve: CurveKeys | None, steps: Callable[[], int]) -> None:
    sock = make_socket(ctx, zmq.PUSH, address, bind=False, curve=curve)
    codec = scheduler_worker_codec()
    pid, identity = os.getpid(), process_identity()
    try:
        while not stop.wait(HEARTBEAT_S):
            sock.send(codec.encode(WorkerHeartbeat(rank, resident_mib(), steps(), pid, identity)))
    finally:
        sock.close(linger=0)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Sender:
    """Owns the results socket: messages queued by the main thread are encoded and sent in
    order by this thread, so the next forward pass never waits for serialization or the socket."""

    def __init__(self, ctx: zmq.Context[Any], address: str, curve: CurveKeys | None) -> None:
        self.sock = make_socket(ctx, zmq.PUSH, address, bind=False, curve=curve)
        self.codec = scheduler_worker_codec()
        self.outbox: queue.SimpleQueue[WorkerMessage | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="sender")
        self.thread.start()

    def send(self, msg: WorkerMessage) -> None:
        self.outbox.put(msg)

    def _run(self) -> None:
        while (msg := self.outbox.get()) is not None:
            self.sock.send(self.codec.encode(msg))

    def close(self) -> None:
        """Send what is queued, then close the socket."""
        self.outbox.put(None)
        self.thread.join(timeout=5.0)
        self.sock.close(linger=FINAL_LINGER_MS)


class WorkerProcess:
    def __init__(self, config: WorkerConfig, ctx: zmq.Context[Any]) -> None:
        self.config = config
        self.endpoints = Endpoints.from_base(config.address)
        self.curve = CurveKeys.load(config.curve_keys, server=False)
        self.sender = Sender(ctx, self.endpoints.worker_to_scheduler, self.curve)
        self.recv_codec = worker_codec()
        self.backlog: deque[WorkerCommand] = deque()  # commands read mid-plan, run after it
        self.malformed_frames = 0
        self.group: TensorParallelGroup | None = None  # set once joined (tensor parallel)
        self.said_waiting = False
        self.connected = False
        self.steps = 0  # steps the main loop has finished: the heartbeats carry it
        self.stall = Stall.from_env(config.rank)  # test-only (STALL_ENV); None otherwise
        self.inbox: zmq.Socket[bytes] | None = None
        self.links: zmq.Socket[bytes] | None = None
        if config.rank > 0:
            return  # a tensor-parallel peer: its commands come from rank 0
        self.inbox = make_socket(ctx, zmq.PULL, self.endpoints.scheduler_to_worker, bind=None, curve=self.curve)
        # Whether the scheduler's command socket is reachable, from the socket's own events: a
        # wrong or unreachable address is said in the log, not waited on in silence. The monitor
        # is attached before connecting: a connection made first would never be reported, and an
        # idle worker would then call a scheduler it is connected to unreachable every 5 s.
        self.links = self.inbox.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.inbox.connect(self.endpoints.scheduler_to_worker)

    def fail(self, what: str, e: BaseException) -> int:
        if isinstance(e, ModelLoadError | ConfigError):  # a user's mistake, said in one line: no traceback
            message = f"{what}: {' '.join(str(e).split())}"
            log.log(startup_failure_level(), "%s", message)
        else:
            message = f"{what}: {_one_line(e)}"
            log.exception("%s", what)
        self.sender.send(WorkerFailed(self.config.rank, message))
        return 1

    def _wait_for_command(self) -> None:
        """Block until a command arrives. A scheduler unreachable for a while is said once (ZeroMQ
        keeps reconnecting meanwhile), and its return once. Rank 0 of a tensor-parallel group
        relays a keepalive to its peers every ``KEEPALIVE_S`` meanwhile."""
        assert self.inbox is not None and self.links is not None
        wait_s = KEEPALIVE_S if self.group is not None else WAITING_LOG_INTERVAL_S
        waited = 0.0
        while not self.inbox.poll(int(wait_s * 1000)):
            if self.group is not None:
                self.group.relay([])
            waited += wait_s
            if waited < WAITING_LOG_INTERVAL_S:
                continue
            waited = 0.0
            while self.links.poll(0):
                self.connected = recv_monitor_message(self.links)["event"] == zmq.EVENT_CONNECTED
            if not self.connected and not self.said_waiting:
                self.said_waiting = True
                log.warning("waiting for the scheduler at %s: not reachable (still trying)",
                            self.endpoints.scheduler_to_worker)
        if self.said_waiting:  # a command came: the scheduler is back
            self.said_waiting = False
            log.info("connected to the scheduler at %s", self.endpoints.scheduler_to_worker)

    def _receive(self, flags: int = 0) -> tuple[WorkerCommand, bytes]:
        """The scheduler's next command and its frame; frames that do not decode are logged and
        skipped, never fatal."""
        assert self.inbox is not None
        while True:
            if not flags & zmq.NOBLOCK:
                self._wait_for_command()
            frame = self.inbox.recv(flags, copy=False)
            try:
                cmd: WorkerCommand = self.recv_codec.decode(frame.buffer)
                return cmd, frame.bytes
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.malformed_frames += 1
                if self.malformed_frames == 1 or self.malformed_frames % 1000 == 0:
                    log.warning("dropped a frame that is not a Sluice command (%s); %d so far", e,
                                self.malformed_frames)

    def _read(self) -> WorkerCommand:
        """The next command, waiting for it (relayed to, or from, the rest of the group)."""
        if self.config.rank > 0:
            assert self.group is not None
            while not (frames := self.group.receive()):
                pass  # rank 0's keepalive
            return self.recv_codec.decode(frames[0])
        cmd, frame = self._receive()
        if self.group is not None:
            self.group.relay([frame])
        return cmd

    def _read_available(self) -> list[WorkerCommand]:
        """Between steps: the commands that have arrived, without waiting."""
        if self.config.rank > 0:
            assert self.group is not None
            return [self.recv_codec.decode(frame) for frame in self.group.receive()]
        cmds, frames = [], []
        while True:
            try:
                cmd, frame = self._receive(zmq.NOBLOCK)
            except zmq.Again:
                break
            cmds.append(cmd)
            frames.append(frame)
        if self.group is not None:
            self.group.relay(frames)
        return cmds

    def _poll_inbox(self, worker: Worker) -> None:
        """Between steps: apply cancels now, keep anything else for after the plan."""
        for cmd in self._read_available():
            if isinstance(cmd, CancelRows):
                worker.runner.cancel(cmd)
            elif isinstance(cmd, PrepareGrammar):  # compiling starts now, beside the plan
                self._prepare(worker, cmd)
            else:
                self.backlog.append(cmd)

    def _prepare(self, worker: Worker, cmd: PrepareGrammar) -> None:
        """Compile a grammar on the grammar thread; rank 0 tells the scheduler when it is done
        (every rank compiles it: each samples under the mask)."""
        grammars = worker.runner.grammars
        if self.config.rank != 0:
            if grammars is not None:
                grammars.prepare(cmd.grammar, lambda: None)
            return
        ready = GrammarReady([cmd.grammar_id])
        if grammars is None:
            self.sender.send(ready)
        else:
            grammars.prepare(cmd.grammar, lambda: self.sender.send(ready))

    def serve(self, worker: Worker) -> int:
        """Handle commands until ``Shutdown`` (0) or a failed plan (1)."""
        while True:
            cmd = self.backlog.popleft() if self.backlog else self._read()
            if isinstance(cmd, Shutdown):
                log.info("shutdown requested")
                return 0
            if isinstance(cmd, CancelRows):
                worker.runner.cancel(cmd)
            elif isinstance(cmd, PrepareGrammar):
                self._prepare(worker, cmd)
            elif isinstance(cmd, Announce):
                # A scheduler that does not know us (it restarted): its requests are all new.
                dropped = worker.runner.reset()
                log.info("announcing to a new scheduler (%d requests' state dropped)", dropped)
                self.sender.send(WorkerReady(self.config.rank, worker.info))
            elif isinstance(cmd, StepPlan):
                try:
                    for step in worker.runner.execute(cmd):
                        if self.stall is not None:
                            self.stall.hold(self.steps + 1, {"address": self.config.address, "rank": self.config.rank,
                                                             "pid": os.getpid()})
                        if self.config.rank == 0:
                            self.sender.send(step)
                        self.steps += 1
                        if not step.last:
                            self._poll_inbox(worker)
                except Exception as e:
                    return self.fail(f"plan {cmd.plan_id} failed", e)

    def close(self) -> None:
        self.sender.close()
        if self.inbox is not None and self.links is not None:
            self.inbox.disable_monitor()
            self.links.close(linger=0)
            self.inbox.close(linger=0)
        if self.group is not None:
            self.group.close()


def run(config: WorkerConfig) -> int:
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    if supervised():
        # Under ``sluice serve``, Ctrl-C is the parent's to handle: it drains, then stops us.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx: zmq.Context[Any] = zmq.Context()
    proc = WorkerProcess(config, ctx)
    stop = threading.Event()
    heartbeat = threading.Thread(target=_heartbeat, args=(ctx, proc.endpoints.worker_to_scheduler, config.rank, stop,
                                                          proc.curve, lambda: proc.steps),
                                 daemon=True, name="heartbeat")
    told_to_stop = False  # SIGTERM or Shutdown, not a failure: the scheduler hears a goodbye
    try:
        if config.tensor_parallel_size > 1:
            try:
                device = resolve_device(config.device, config.rank)
                proc.group = TensorParallelGroup(config.rank, config.tensor_parallel_size, device, config.tp_master,
                                                 config.tp_timeout)
            except Exception as e:
                return proc.fail("cannot join the tensor-parallel group", e)
        try:
            worker = Worker(config, proc.group)
            worker.runner.threads = configure_cpu_threads(worker.device, config.worker_threads, worker.num_params,
                                                          config.tensor_parallel_size)
            worker.warm_up()
            if proc.group is not None:
                proc.group.serving()
        except Exception as e:
            return proc.fail("cannot load the model", e)
        heartbeat.start()
        proc.sender.send(WorkerReady(config.rank, worker.info))
        log.info("ready: %s, max model len %d, %d KV blocks", worker.info.name, worker.max_model_len,
                 worker.info.num_kv_blocks)
        try:
            status = proc.serve(worker)
        except RuntimeError as e:  # a collective between plans: a rank of the group is gone
            if proc.group is None:
                raise
            return proc.fail("the tensor-parallel group broke", e)
        told_to_stop = status == 0
        return status
    except SystemExit:
        told_to_stop = True
        raise
    finally:
        # Already stopping: a second signal must not interrupt the clean-up.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        if heartbeat.is_alive():
            heartbeat.join(timeout=1.0)
        if told_to_stop:
            proc.sender.send(WorkerStopping(config.rank))
        proc.close()
        ctx.term()
