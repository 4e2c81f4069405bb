"""Running the frontend under uvicorn, and ``sluice serve``: scheduler and worker as children.

Shutdown order on Ctrl-C / SIGTERM: uvicorn stops accepting and closes streams (at most
``GRACEFUL_S``), then the children get SIGTERM, then SIGKILL after ``CHILD_STOP_S`` — all well
inside the 5 s SPEC allows. Children also get SIGTERM from the kernel if this process dies
without cleaning up (PR_SET_PDEATHSIG on Linux), so no orphan keeps a model in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable

import uvicorn
from starlette.applications import Starlette

from frontend.app import build_app
from protocol.config import FrontendConfig, SchedulerConfig, WorkerConfig, to_json

log = logging.getLogger("sluice.serve")

GRACEFUL_S = 1.5
CHILD_STOP_S = 2.0


def _uvicorn_config(app: Starlette, config: FrontendConfig) -> uvicorn.Config:
    loop = "uvloop" if sys.platform != "win32" else "asyncio"
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop=loop,
        http="httptools",
        log_level=config.log_level,
        access_log=config.log_level == "debug",
        timeout_graceful_shutdown=int(GRACEFUL_S) or 1,
    )


def _announce_when_ready(app: Starlette, config: FrontendConfig, extra: Callable[[], None] | None = None) -> None:
    """Print the URL once the engine is ready (wrapping the app's lifespan)."""
    state = app.state.sluice
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Starlette) -> AsyncIterator[None]:
        async with inner(a):
            async def announce() -> None:
                await state.client.ready.wait()
                print(f"Sluice is serving {state.model_name} at http://{config.host}:{config.port}", flush=True)

            task = asyncio.create_task(announce())
            try:
                yield
            finally:
                task.cancel()

    app.router.lifespan_context = lifespan


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def run_frontend(config: FrontendConfig) -> None:
    # uvicorn handles SIGINT/SIGTERM itself, then restores these handlers and re-raises the
    # signal; with the defaults that would kill the process before ``serve`` stops its children.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    app = build_app(config)
    _announce_when_ready(app, config)
    uvicorn.Server(_uvicorn_config(app, config)).run()


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGTERM the child if ``sluice serve`` dies (Linux only)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(module: str, config: object) -> subprocess.Popen[bytes]:
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return subprocess.Popen(
        [sys.executable, "-m", module, "--config", to_json(config)],
        preexec_fn=preexec,
    )


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(timeout=CHILD_STOP_S)
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop in %.0f s; killing it", child.pid, CHILD_STOP_S)
            child.kill()
            child.wait()


def serve(frontend: FrontendConfig, scheduler: SchedulerConfig, worker: WorkerConfig) -> None:
    """``sluice serve``: one machine, ipc:// sockets in a private temp dir removed at exit."""
    sock_dir = tempfile.mkdtemp(prefix="sluice-")
    address = f"ipc://{sock_dir}/engine"
    frontend = dataclasses.replace(frontend, address=address)
    scheduler = dataclasses.replace(scheduler, address=address)
    worker = dataclasses.replace(worker, address=address, served_model_name=frontend.served_model_name)
    children: list[subprocess.Popen[bytes]] = []
    try:
        children.append(_spawn("scheduler", scheduler))
        for rank in range(worker.tensor_parallel_size):
            children.append(_spawn("worker", dataclasses.replace(worker, rank=rank)))
        run_frontend(frontend)
    finally:
        _stop(children)
        shutil.rmtree(sock_dir, ignore_errors=True)
