"""Running the frontend under uvicorn, and ``sluice serve``: scheduler and worker as children.

Once the engine is ready, a child that exits is started again after a backoff (0.5 s, doubling
to 8 s): a worker up to ``--max-worker-restarts`` times (the scheduler recomputes its live
requests on the new one, so their streams continue), the scheduler up to
``SCHEDULER_RESTARTS`` times (frontend and worker find the new one by themselves).

Shutdown on Ctrl-C / SIGTERM, within ``--shutdown-grace`` + ``STOP_AFTER_GRACE_S`` seconds (3 + 2
by default, SPEC's 5): the frontend drains (``frontend/shutdown.py``: no new requests, those in
flight finish within the grace or end with ``abort``), uvicorn stops, then the children get
SIGTERM together and SIGKILL at the deadline. A child that exits meanwhile is neither restarted
nor reported as a crash. The children run in their own process group, so a signal to this
process's group (Ctrl-C in a terminal, ``kill -- -PGID``) reaches this process alone and the
shutdown happens in that order; they get SIGTERM from the kernel if this process dies without
cleaning up (PR_SET_PDEATHSIG on Linux), so no orphan keeps a model in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence

import uvicorn
from starlette.applications import Starlette

from frontend.app import build_app
from frontend.errors import APIError
from frontend.shutdown import GracefulServer, say
from protocol import supervision
from protocol.config import FrontendConfig, SchedulerConfig, WorkerConfig, to_json

log = logging.getLogger("sluice.serve")

KEEP_ALIVE_S = 30
# What the stop may take after the grace: the aborts' last chunks, uvicorn closing its
# connections, the children exiting (each stage takes what is left of this).
STOP_AFTER_GRACE_S = 2.0
CHILD_STOP_MIN_S = 0.5  # the children get at least this long to exit before SIGKILL


def _uvicorn_config(app: Starlette, config: FrontendConfig) -> uvicorn.Config:
    loop = "uvloop" if sys.platform != "win32" else "asyncio"
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop=loop,
        http="httptools",
        # uvicorn's own start-up lines ("running on http://…" while the model is still loading)
        # would say the wrong thing; Sluice prints the URL once the engine is ready.
        log_level=config.log_level if config.log_level == "debug" else "warning",
        access_log=config.log_level == "debug",
        # By then the drain has ended every stream: only idle keep-alive connections are left.
        timeout_graceful_shutdown=1,
        # uvicorn's 5 s default races clients reusing a connection it is closing (a request sent
        # as the server hangs up fails on the client); inference clients keep connections long.
        timeout_keep_alive=KEEP_ALIVE_S,
    )


STARTUP_POLL_S = 0.25
# While the engine starts, a line this often says that it still is and for how long: a first start
# (torch imported, the C kernels compiled for this CPU, the weights read) is tens of seconds.
STARTUP_NOTE_EVERY_S = 15.0
CHILD_EXIT_GRACE_S = 2.0  # a child that failed to load has usually told the scheduler why
SCHEDULER_RESTARTS = 10
SUPERVISE_POLL_S = 0.1


@dataclasses.dataclass
class Child:
    """A component process of ``sluice serve``, and what it takes to start it again."""

    name: str
    module: str
    config: object
    max_restarts: int
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    given_up: bool = False
    # The ranks of a tensor-parallel group (this one among them): they stop and start together,
    # since a group that lost a rank cannot go on, and a new rank joins only a new group.
    group: list[Child] = dataclasses.field(default_factory=list)
    log_name: str | None = None  # what its log lines say they come from (several engines: which one)

    def start(self) -> None:
        self.proc = _spawn(self.module, self.config, self.log_name)

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None


class _Startup:
    """Watches the engine come up: prints the URL when it is ready, or — when it never will be
    (the worker failed to load, a child process exited) — one line saying why, and stops the
    server with status 1. A failure after start-up keeps serving /health (503) instead."""

    def __init__(self, app: Starlette, config: FrontendConfig, children: Sequence[Child]) -> None:
        self.app = app
        self.config = config
        self.children = children
        self.server: uvicorn.Server | None = None
        self.exit_code = 0

    def install(self) -> None:
        inner = self.app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(a: Starlette) -> AsyncIterator[None]:
            async with inner(a):
                task = asyncio.create_task(self._watch())
                try:
                    yield
                finally:
                    task.cancel()

        self.app.router.lifespan_context = lifespan

    async def _watch(self) -> None:
        state = self.app.state.sluice
        client = state.client
        exited_at: float | None = None
        began = time.monotonic()
        noted = began
        # Every engine: sluice serve starts them together, and says ready once all are.
        while not all(engine.ready.is_set() for engine in client.engines):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(client.all_ready(), STARTUP_POLL_S)
                break
            if time.monotonic() - noted >= STARTUP_NOTE_EVERY_S:
                noted = time.monotonic()
                log.info("still starting (%.0f s): waiting for the worker to load the model (its log lines say "
                         "what it is doing)", noted - began)
            if client.engine_error is not None:
                self._fail(client.engine_error)
                return
            dead = [c for c in self.children if c.exited() is not None]
            if dead:
                now = time.monotonic()
                exited_at = exited_at or now
                if now - exited_at >= CHILD_EXIT_GRACE_S:
                    self._fail(f"the {dead[0].name} process exited with status {dead[0].exited()} "
                               "before the engine was ready")
                    return
        if client.engine_error is not None:  # an engine came up with another model
            self._fail(client.engine_error)
            return
        with contextlib.suppress(APIError):  # built now, not on the first request's path (82 ms for SmolLM2's)
            state.require_tokenizer()
        say(f"Sluice is ready: serving {state.model_name} {where(self.config.host, self.config.port)} "
            "(OpenAI API under /v1)")
        await self._supervise()

    async def _supervise(self) -> None:
        """Start again a child that exits after start-up, with backoff, within its budget. Once
        shutting down, a child that exits is left alone (it was told to stop, or is about to)."""
        state = self.app.state.sluice
        while True:
            await asyncio.sleep(SUPERVISE_POLL_S)
            for child in self.children:
                status = child.exited()
                if status is None or child.given_up:
                    continue
                if state.draining:
                    child.given_up = True
                    log.info("the %s process exited (status %s) while shutting down", child.name, status)
                    continue
                if child.restarts >= child.max_restarts:
                    child.given_up = True
                    log.error("the %s process exited with status %s; not starting it again (%d restarts used)",
                              child.name, status, child.restarts)
                    continue
                delay = min(8.0, 0.5 * 2**child.restarts)
                child.restarts += 1
                log.warning("the %s process exited with status %s; starting it again in %.1f s (restart %d of %d)",
                            child.name, status, delay, child.restarts, child.max_restarts)
                peers = [c for c in child.group if c is not child]
                running = [c.proc for c in peers if c.proc is not None and c.exited() is None]
                if running:
                    log.warning("stopping the other tensor-parallel ranks: the group starts again whole")
                    await asyncio.to_thread(_stop, running, time.monotonic() + STOP_AFTER_GRACE_S)
                await asyncio.sleep(delay)
                for c in (child, *peers):
                    c.start()

    def _fail(self, message: str) -> None:
        print(f"sluice: error: {message}", file=sys.stderr, flush=True)
        self.exit_code = 1
        if self.server is not None:
            self.server.should_exit = True


def where(host: str, port: int) -> str:
    """Where clients reach the server, as a URL one can open: a wildcard address (all interfaces,
    as in a container) is no URL, so name the local one and what it stands for."""
    if host in ("0.0.0.0", "::", ""):
        return (f"at http://127.0.0.1:{port} on all interfaces ({host or '0.0.0.0'}:{port}; in a container, at the "
                "port it publishes)")
    return f"at http://{'[' + host + ']' if ':' in host else host}:{port}"


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


class ListenError(Exception):
    """The HTTP address cannot be listened on; the message says why and what to do."""


def listen(config: FrontendConfig) -> socket.socket:
    """The HTTP listening socket, bound now: a port already taken is said in one line before any
    process starts loading a model (uvicorn would find out only after)."""
    try:
        family = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((config.host, config.port), family=family, backlog=2048)
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        if e.errno == errno.EADDRINUSE:
            why += " (another server is listening there); choose another port with --port"
        elif e.errno == errno.EACCES:
            why += " (ports below 1024 need privileges); choose another port with --port"
        raise ListenError(f"cannot listen on {config.host}:{config.port}: {why}") from None


def run_frontend(config: FrontendConfig, children: Sequence[Child] = (), sock: socket.socket | None = None,
                 stop_by: list[float] | None = None) -> int:
    """Serve HTTP until a signal (0) or an engine that fails to start (1); returns the status.
    ``stop_by[0]`` is set to the monotonic deadline of the whole stop once a signal arrives."""
    if sock is None:
        try:
            sock = listen(config)
        except ListenError as e:
            print(f"sluice: error: {e}", file=sys.stderr, flush=True)
            return 1
    # uvicorn handles SIGINT/SIGTERM itself, then restores these handlers and re-raises the
    # signal; with the defaults that would kill the process before ``serve`` stops its children.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    app = build_app(config)
    app.state.sluice.client.attach(app.state.sluice.metrics, config.request_timeout,
                                   quiet_startup_errors=True)  # _Startup says them, once
    startup = _Startup(app, config, children)
    startup.install()
    deadline = stop_by if stop_by is not None else [float("inf")]
    startup.server = GracefulServer(_uvicorn_config(app, config), app.state.sluice, config.shutdown_grace,
                                    STOP_AFTER_GRACE_S, deadline)
    try:
        startup.server.run(sockets=[sock])
    finally:
        if stop_by is None and deadline[0] != float("inf"):
            say("Stopped.")  # ``sluice frontend``; ``serve`` says it once its children are gone
    return startup.exit_code


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGTERM the child if ``sluice serve`` dies (Linux only)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(module: str, config: object, log_name: str | None = None) -> subprocess.Popen[bytes]:
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return subprocess.Popen(
        [sys.executable, "-m", module, "--config", to_json(config), *(["--log-name", log_name] if log_name else [])],
        preexec_fn=preexec,
        process_group=0,
        # Ctrl-C reaches the whole process group: the children leave it to this process, which
        # drains the requests in flight first and then stops them (SIGTERM).
        env=dict(os.environ, **{supervision.ENV: "1"}),
    )


def _free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (the tensor-parallel rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stop(children: Sequence[subprocess.Popen[bytes]], deadline: float) -> None:
    """SIGTERM to every child at once, SIGKILL to those still running at ``deadline`` (monotonic;
    at least ``CHILD_STOP_MIN_S`` from now). A worker says goodbye to the scheduler as it leaves,
    so neither takes the other's exit for a crash."""
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = max(deadline, time.monotonic() + CHILD_STOP_MIN_S)
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop in time; killing it", child.pid)
            child.kill()
            child.wait()


def serve(frontend: FrontendConfig, scheduler: SchedulerConfig, worker: WorkerConfig,
          data_parallel_size: int = 1) -> int:
    """``sluice serve``: one machine, ipc:// sockets in a private temp dir removed at exit; with
    ``data_parallel_size`` m, m engines (a scheduler and its worker ranks each) behind the
    frontend, sharing the machine's cores. Returns the exit status (1 when the engine failed to start)."""
    try:
        sock = listen(frontend)
    except ListenError as e:
        print(f"sluice: error: {e}", file=sys.stderr, flush=True)
        return 1
    sock_dir = tempfile.mkdtemp(prefix="sluice-")
    m = data_parallel_size
    addresses = [f"ipc://{sock_dir}/engine" + (str(i) if m > 1 else "") for i in range(m)]
    frontend = dataclasses.replace(frontend, address=",".join(addresses))
    k = worker.tensor_parallel_size
    if m > 1 and worker.worker_threads == 0:  # each engine's ranks get their share of the cores
        worker = dataclasses.replace(worker, worker_threads=max(1, len(os.sched_getaffinity(0)) // (m * k)))
    children = []
    for i, address in enumerate(addresses):
        engine = f" {i}" if m > 1 else ""
        children.append(Child(f"scheduler{engine}", "scheduler", dataclasses.replace(scheduler, address=address),
                              SCHEDULER_RESTARTS, log_name=f"scheduler[{i}]" if m > 1 else None))
        ranks_config = dataclasses.replace(worker, address=address, served_model_name=frontend.served_model_name)
        if k > 1:
            ranks_config = dataclasses.replace(ranks_config, tp_master=f"127.0.0.1:{_free_port()}")
        ranks = [Child(f"worker{engine}" + (f" rank {rank}" if k > 1 else ""), "worker",
                       dataclasses.replace(ranks_config, rank=rank), scheduler.max_worker_restarts,
                       log_name=f"worker[{i}.{rank}]" if m > 1 else None)
                 for rank in range(k)]
        for rank in ranks:
            rank.group = ranks if k > 1 else []
        children += ranks
    stop_by = [float("inf")]
    log.info("starting %s for %s: the worker imports torch and loads the model (seconds; a first start on a "
             "machine also compiles Sluice's C kernels for its CPU, up to a minute)",
             f"{m} engines" if m > 1 else "the scheduler and " + (f"{k} worker ranks" if k > 1 else "the worker"),
             worker.model)
    try:
        for child in children:
            child.start()
        return run_frontend(frontend, children, sock, stop_by)
    finally:
        stopping = stop_by[0] != float("inf")
        deadline = stop_by[0] if stopping else time.monotonic() + STOP_AFTER_GRACE_S
        _stop([child.proc for child in children if child.proc is not None], deadline)
        shutil.rmtree(sock_dir, ignore_errors=True)
        if stopping:
            say("Stopped.")
